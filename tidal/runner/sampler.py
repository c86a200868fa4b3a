"""Next-token selection for a batch of rows, each with its own SamplingParams.

Order of processing, per row (everything on the logits' device, in float32, no loop over the vocab):
  1. repetition penalty (HF): over ids in prompt + output, positive logits / p, negative logits * p
  2. presence / frequency penalties (OpenAI): logit -= presence * (count > 0) + frequency * count,
     counts over the generated ids only
  3. temperature == 0 (greedy): argmax of the penalised logits, done
  4. temperature: logits / T
  5. top-k: keep the k largest (a tie at the boundary keeps some of the tied tokens, deterministically)
  6. top-p: keep the smallest set of most likely tokens whose mass >= top_p (at least one token)
  7. min-p: drop tokens with p < min_p * p_max (p_max is unchanged by the renormalisation above)
  8. sample with the row's generator, by the Gumbel-max trick:
       argmax(logits - log(E)), E ~ Exponential(1) drawn with the row's generator
     which picks token i with probability softmax(logits)_i. It needs no softmax and is elementwise
     per row, so a seeded row draws the same token whether it is alone or batched with any other
     rows (its generator always draws exactly V numbers per step, in vocabulary order).

Log-probabilities are always of the model's raw distribution (log_softmax of the unprocessed logits),
as the OpenAI API reports them, not of the filtered one we sampled from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.types import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                    # [B] int64, the chosen tokens
    logprobs: torch.Tensor | None = None       # [B] float32, raw logprob of the chosen token; None when
                                               # no row asked for logprobs
    top_ids: torch.Tensor | None = None        # [B, n] int64, n = max logprobs asked in the batch (rows
                                               # that asked for fewer use a prefix); None when n == 0
    top_logprobs: torch.Tensor | None = None   # [B, n] float32, raw, sorted descending


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for a seeded request (on the logits' device); None means "use the global RNG"."""
    if seed is None:
        return None
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)   # manual_seed takes 64 bits; negative seeds wrap
    return g


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _id_matrix(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, L] int64 ids, right-padded with `vocab` (an extra column that the caller discards)."""
    lens = [len(r) for r in rows]
    out = torch.full((len(rows), max(max(lens, default=0), 1)), vocab, dtype=torch.int64)
    if sum(lens):
        flat = torch.tensor([t for r in rows for t in r], dtype=torch.int64)                # [N]
        lens_t = torch.tensor(lens)
        row = torch.repeat_interleave(torch.arange(len(rows)), lens_t)                     # [N]
        starts = torch.repeat_interleave(torch.cumsum(lens_t, 0) - lens_t, lens_t)         # [N]
        out[row, torch.arange(len(flat)) - starts] = flat
    # Ids outside the logits (a tokenizer larger than the model's head) cannot be penalised.
    out[(out < 0) | (out > vocab)] = vocab
    return out.to(device, non_blocking=True)


def apply_penalties(x: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                    output_ids: list[list[int]]) -> None:
    """Penalise logits x [B, V] (float32) in place: steps 1 and 2 above."""
    B, V = x.shape
    device = x.device
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        # Rows without the penalty contribute no ids, so their mask stays empty.
        seen_ids = _id_matrix([list(prompt_ids[i]) + list(output_ids[i]) if rep[i] != 1.0 else []
                               for i in range(B)], V, device)                          # [B, L]
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, seen_ids, True)
        seen = seen[:, :V]                                                              # [B, V]
        r = torch.tensor(rep, dtype=torch.float32, device=device)[:, None]             # [B, 1]
        x.copy_(torch.where(seen, torch.where(x > 0, x / r, x * r), x))
    pres = [p.presence_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    if any(pres) or any(freq):
        out_ids = _id_matrix([list(output_ids[i]) if pres[i] or freq[i] else [] for i in range(B)],
                             V, device)                                                 # [B, L]
        counts = torch.zeros(B, V + 1, dtype=torch.float32, device=device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
        counts = counts[:, :V]                                                          # [B, V]
        pres_t = torch.tensor(pres, dtype=torch.float32, device=device)[:, None]        # [B, 1]
        freq_t = torch.tensor(freq, dtype=torch.float32, device=device)[:, None]        # [B, 1]
        x -= pres_t * (counts > 0).float() + freq_t * counts


# On the CPU a full sort of a large vocabulary dominates the step (~20 ms per row at V = 150k), while
# top-k / top-p only ever look at the most likely tokens. There we first filter within the top
# CPU_CANDIDATES and fall back to a full sort for the rows whose answer is not decided inside them.
# The candidate count is fixed (not batch-dependent) so each row's result depends only on that row.
# On the GPU the sort is cheap and the fallback's host sync is not, so it always sorts.
CPU_CANDIDATES = 1024


def _top_k_top_p_drop(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[S, V] bool, True for tokens removed by top-k (k [S, 1], V = off), then top-p (p [S, 1])."""
    S, V = x.shape
    if x.device.type != "cpu" or V <= CPU_CANDIDATES:
        return _drop_among(x, k, p, V)[0]
    drop, decided = _drop_among(x, k, p, CPU_CANDIDATES)
    undecided = (~decided).nonzero().flatten().tolist()
    if undecided:
        drop[undecided] = _drop_among(x[undecided], k[undecided], p[undecided], V)[0]
    return drop


def _drop_among(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, n: int):
    """Top-k then top-p decided among each row's n most likely tokens (n == V: exact sort).

    Returns the [S, V] drop mask and [S] whether it is exact: a row is decided when its top-k fits in
    the n candidates (then its renormalisation is exact too), or when it has no top-k and its nucleus
    ends inside them. Tokens outside the
    candidates are dropped for rows with a filter and kept for rows without one.
    """
    S, V = x.shape
    if n < V:
        vals, idx = x.topk(n, dim=-1)                                                   # [S, n] x2
    else:
        # Stable, so ties at the top-k boundary keep the lower token id on every device.
        vals, idx = x.sort(dim=-1, descending=True, stable=True)                         # [S, V] x2
    drop = torch.arange(n, device=x.device)[None, :] >= k                                # [S, n]
    vals = vals.masked_fill(drop, float("-inf"))
    # After top-k the distribution is renormalised over the k survivors; without top-k it is the
    # softmax over the whole vocabulary, part of which lies beyond the candidates.
    lse = torch.where(k < V, vals.logsumexp(-1, keepdim=True), x.logsumexp(-1, keepdim=True))  # [S, 1]
    probs = (vals - lse).exp()                                                            # [S, n]
    mass = probs.cumsum(dim=-1)                                                           # [S, n]
    # Keep a token while the mass before it is < top_p: the smallest set reaching top_p, never empty
    # (the first token has 0 before it). Rows with top_p == 1 skip this, so rounding in the cumsum
    # can never drop a token there.
    drop |= (mass - probs >= p) & (p < 1.0)
    if n == V:
        return torch.zeros_like(drop).scatter_(1, idx, drop), torch.ones(S, dtype=torch.bool)
    decided = ((k <= n) | ((k >= V) & ((p >= 1.0) | (mass[:, -1:] >= p)))).flatten()      # [S]
    filtered = (k < V) | (p < 1.0)                                                        # [S, 1]
    return filtered.expand(S, V).clone().scatter_(1, idx, drop), decided


class Sampler:
    """Stateless; call with one batch of logits per decode step."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                 output_ids: list[list[int]], generators: list[torch.Generator | None]) -> SamplerOutput:
        B, V = logits.shape
        assert len(params) == B and len(prompt_ids) == B and len(output_ids) == B and len(generators) == B
        device = logits.device
        n_top = max((p.logprobs or 0 for p in params), default=0)
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None   # [B, V]

        penalised = any(_uses_penalties(p) for p in params)
        if all(p.greedy for p in params) and not penalised:
            token_ids = logits.argmax(dim=-1)                                               # [B]
        else:
            x = logits.to(torch.float32, copy=True)                                          # [B, V]
            if penalised:
                apply_penalties(x, params, prompt_ids, output_ids)
            token_ids = x.argmax(dim=-1)                                                    # [B]
            sampled = [i for i, p in enumerate(params) if not p.greedy]
            if len(sampled) == B:
                token_ids = self._sample(x, params, generators)                             # [B]
            elif sampled:
                rows = torch.tensor(sampled, device=device)
                token_ids[rows] = self._sample(x[rows], [params[i] for i in sampled],
                                               [generators[i] for i in sampled])            # [S]

        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)            # [B]
            if n_top > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(min(n_top, V), dim=-1)    # [B, n] x2
        return out

    @staticmethod
    def _sample(x: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """Steps 4-8 for the non-greedy rows: x [S, V] penalised logits -> [S] token ids."""
        S, V = x.shape
        device = x.device
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        x = x / temp[:, None]                                                               # [S, V]

        top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
        top_p = [p.top_p for p in params]
        if any(k < V for k in top_k) or any(tp < 1.0 for tp in top_p):
            k = torch.tensor(top_k, device=device)[:, None]                                 # [S, 1]
            p = torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]            # [S, 1]
            x = x.masked_fill(_top_k_top_p_drop(x, k, p), float("-inf"))

        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            probs = torch.softmax(x, dim=-1)                                                # [S, V]
            m = torch.tensor(min_p, dtype=torch.float32, device=device)[:, None]            # [S, 1]
            x = x.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, float("-inf"))

        # Gumbel-max: argmax(x - log E) samples from softmax(x). E is clamped away from 0 so that a
        # -inf (filtered) logit can never become NaN and win.
        noise = torch.empty_like(x)                                                         # [S, V]
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == S:
            noise.exponential_()
        else:
            if unseeded:
                noise[unseeded] = torch.empty(len(unseeded), V, device=device).exponential_()
            for i, g in enumerate(generators):
                if g is not None:
                    noise[i].exponential_(generator=g)
        return (x - noise.clamp_min_(1e-30).log()).argmax(dim=-1)                           # [S]
