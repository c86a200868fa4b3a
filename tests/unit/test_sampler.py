"""Sampler: statistical checks against independent computations, not snapshots of our own outputs.

Allowed sets (top-k, nucleus, min-p) and target distributions are computed here in float64 numpy,
straight from the definitions; penalties by explicit Python loops over the ids.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tidal.runner.sampler import CPU_CANDIDATES, Sampler, apply_penalties, make_generator
from tidal.runner.sampler import _drop_among, _top_k_top_p_drop
from tidal.types import SamplingParams

sampler = Sampler()
# The sampler runs on the logits' device; on a machine with a GPU every device-aware test runs on both.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def run(logits, params, prompt=None, output=None, generators=None):
    B = logits.shape[0]
    params = params if isinstance(params, list) else [params] * B
    return sampler(logits, params, prompt or [[] for _ in range(B)], output or [[] for _ in range(B)],
                   generators or [None] * B)


def softmax64(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def distinct_logits(V: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    """Logits with no ties (so every filter boundary is unambiguous)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, generator=g, dtype=torch.float64) * scale
    return (x + torch.arange(V, dtype=torch.float64) * 1e-3).float()


def draw(logits_row: torch.Tensor, p: SamplingParams, n: int, seed: int = 0, device="cpu") -> np.ndarray:
    torch.manual_seed(seed)                         # seeds the CUDA generators too
    return run(logits_row.to(device).expand(n, -1).contiguous(), p).token_ids.cpu().numpy()


# ---- greedy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype, device):
    logits = (torch.randn(32, 5000, generator=torch.Generator().manual_seed(0)) * 4).to(device, dtype)
    out = run(logits, SamplingParams())
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (32,)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None


def test_greedy_rows_in_a_mixed_batch_are_argmax(device):
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1)).to(device)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=5 if i % 4 == 0 else 0)
              for i in range(8)]
    out = run(logits, params)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(-1))


def test_input_logits_are_not_modified():
    logits = torch.randn(4, 100)
    before = logits.clone()
    run(logits, [SamplingParams(temperature=0.7, top_p=0.5, top_k=10, min_p=0.1, repetition_penalty=1.3,
                                presence_penalty=0.5, frequency_penalty=0.5, logprobs=3)] * 4,
        prompt=[[1, 2]] * 4, output=[[3, 3]] * 4)
    assert torch.equal(logits, before)


# ---- filters --------------------------------------------------------------------------------------
def test_top_k_never_leaves_the_top_k(device):
    logits = distinct_logits(200, seed=2, scale=1.0)
    allowed = set(np.argsort(-logits.numpy().astype(np.float64))[:7].tolist())
    tokens = draw(logits, SamplingParams(temperature=1.5, top_k=7), 4000, device=device)
    assert set(tokens.tolist()) == allowed          # inside, and every member actually reachable


def nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, top_p) + 1)        # smallest prefix whose mass >= top_p
    return set(order[:min(n, len(probs))].tolist())


@pytest.mark.parametrize("top_p,temperature", [(0.5, 1.0), (0.9, 0.8), (0.2, 1.3), (0.99, 1.0)])
def test_top_p_stays_in_the_nucleus(top_p, temperature, device):
    logits = distinct_logits(100, seed=3)
    probs = softmax64(logits.numpy().astype(np.float64) / temperature)
    allowed = nucleus(probs, top_p)
    cum = np.cumsum(np.sort(probs)[::-1])
    assert np.abs(cum - top_p).min() > 1e-4         # the boundary is unambiguous in float32
    tokens = draw(logits, SamplingParams(temperature=temperature, top_p=top_p), 5000, device=device)
    assert set(tokens.tolist()) <= allowed
    likely = {t for t in allowed if probs[t] / probs[list(allowed)].sum() > 0.01}
    assert likely <= set(tokens.tolist())


def peaky_logits(V: int, seed: int, head: int = 30) -> torch.Tensor:
    """LM-like logits: a few likely tokens over a long tail, V well above CPU_CANDIDATES."""
    x = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5
    x[torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:head]] += 9.0
    return x


@pytest.mark.parametrize("top_p", [0.6, 0.95])
def test_top_p_on_a_large_vocabulary(top_p, device):
    """Exercises the CPU candidate path (V > CPU_CANDIDATES) end to end."""
    logits = peaky_logits(3 * CPU_CANDIDATES, seed=11)
    probs = softmax64(logits.numpy().astype(np.float64))
    allowed = nucleus(probs, top_p)
    assert len(allowed) < CPU_CANDIDATES
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=top_p), 1500, device=device)
    assert set(tokens.tolist()) <= allowed and len(set(tokens.tolist())) > 3


def test_cpu_candidate_filter_equals_full_sort():
    V = 5 * CPU_CANDIDATES
    rows = [peaky_logits(V, seed=20), distinct_logits(V, seed=21, scale=0.05),   # flat: falls back
            peaky_logits(V, seed=22), peaky_logits(V, seed=23), distinct_logits(V, seed=24)]
    x = torch.stack(rows * 2)                                                    # [10, V]
    k = torch.tensor([V, V, 50, V, 3000, 7, V, V, 1, V])[:, None]             # V = top-k off
    p = torch.tensor([0.9, 0.9, 0.5, 1.0, 0.99, 1.0, 1.0, 0.3, 1.0, 0.999])[:, None]
    assert torch.equal(_top_k_top_p_drop(x, k, p), _drop_among(x, k, p, V)[0])
    assert not _top_k_top_p_drop(x[3:4], k[3:4], p[3:4]).any()                  # no filter: keep all


def test_top_p_keeps_at_least_one_token():
    logits = distinct_logits(50, seed=4)
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=1e-6), 200)
    assert set(tokens.tolist()) == {int(logits.argmax())}


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_drops_tokens_below_the_threshold(min_p, device):
    logits = distinct_logits(100, seed=5)
    probs = softmax64(logits.numpy().astype(np.float64) / 0.9)
    allowed = set(np.nonzero(probs >= min_p * probs.max())[0].tolist())
    tokens = draw(logits, SamplingParams(temperature=0.9, min_p=min_p), 4000, device=device)
    assert set(tokens.tolist()) <= allowed and int(probs.argmax()) in set(tokens.tolist())


def test_filters_compose_in_order(device):
    """temperature -> top-k -> top-p (on the renormalised top-k) -> min-p, computed independently."""
    logits = distinct_logits(300, seed=6)
    t, k, top_p, min_p = 1.2, 40, 0.8, 0.02
    x = logits.numpy().astype(np.float64) / t
    keep_k = np.argsort(-x)[:k]
    probs = np.zeros_like(x)
    probs[keep_k] = softmax64(x[keep_k])
    allowed = nucleus(probs, top_p)
    pmax = max(probs[i] for i in allowed)
    allowed = {i for i in allowed if probs[i] >= min_p * pmax}
    tokens = draw(logits, SamplingParams(temperature=t, top_k=k, top_p=top_p, min_p=min_p), 5000, device=device)
    assert set(tokens.tolist()) <= allowed and len(set(tokens.tolist())) > 3


# ---- the distribution itself ----------------------------------------------------------------------
def assert_frequencies(tokens: np.ndarray, expected: np.ndarray):
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(expected)) / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts - expected) <= 5 * sigma + 1e-9), (counts, expected)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_empirical_frequencies_match_softmax(temperature, device):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -12.0])
    tokens = draw(logits, SamplingParams(temperature=temperature), 20000, device=device)
    assert_frequencies(tokens, softmax64(logits.numpy().astype(np.float64) / temperature))


def test_seeded_rows_follow_the_distribution_too(device):
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 3000
    gens = [make_generator(1000 + i, device) for i in range(n)]
    tokens = run(logits.to(device).expand(n, -1).contiguous(), SamplingParams(temperature=1.0, seed=1),
                 generators=gens).token_ids.cpu().numpy()
    assert_frequencies(tokens, softmax64(logits.numpy().astype(np.float64)))


# ---- seeds and batch independence -----------------------------------------------------------------
def seeded_run(seed: int, steps: int, logits: torch.Tensor, p: SamplingParams, prompt=(), output=()) -> list[int]:
    g = make_generator(seed, logits.device)
    return [int(run(logits[s:s + 1], p, prompt=[list(prompt)], output=[list(output)], generators=[g]).token_ids[0])
            for s in range(steps)]


def test_seed_repeats_and_differs_across_seeds(device):
    logits = torch.randn(30, 500, generator=torch.Generator().manual_seed(7)).to(device)
    p = SamplingParams(temperature=1.0, seed=123)
    torch.manual_seed(0)
    a = seeded_run(123, 30, logits, p)
    torch.manual_seed(99)                           # the global RNG must not matter
    assert seeded_run(123, 30, logits, p) == a
    assert seeded_run(124, 30, logits, p) != a
    assert make_generator(None, "cpu") is None


@pytest.mark.parametrize("p", [SamplingParams(temperature=0.8, seed=5),
                               SamplingParams(temperature=1.1, top_k=20, top_p=0.9, min_p=0.01, seed=5),
                               SamplingParams(temperature=1.0, presence_penalty=0.5, seed=5)])
def test_seeded_row_is_independent_of_its_batch(p, device):
    V, steps = 400, 12
    logits = (torch.randn(steps, 6, V, generator=torch.Generator().manual_seed(8)) * 2).to(device)
    alone = seeded_run(42, steps, logits[:, 2], p, prompt=[1, 2, 3], output=[4, 4])
    # Same row, batched at index 2 with rows that use other filters, seeds and the global RNG.
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3),
              None, SamplingParams(temperature=0.5, top_p=0.3, seed=1),
              SamplingParams(temperature=1.0, repetition_penalty=1.5), SamplingParams(temperature=2.0)]
    gens = [None, None, make_generator(42, device), make_generator(1, device), None, None]
    batched = []
    for s in range(steps):
        params = [q if q is not None else p for q in others]
        out = run(logits[s], params, prompt=[[1, 2, 3]] * 6, output=[[4, 4]] * 6, generators=gens)
        batched.append(int(out.token_ids[2]))
    assert batched == alone


# ---- penalties ------------------------------------------------------------------------------------
def penalise_by_hand(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    row = list(row)
    for tok in set(prompt) | set(output):                       # HF repetition penalty
        row[tok] = row[tok] / p.repetition_penalty if row[tok] > 0 else row[tok] * p.repetition_penalty
    for tok in set(output):                                     # OpenAI presence / frequency
        count = output.count(tok)
        row[tok] -= p.presence_penalty + p.frequency_penalty * count
    return row


def test_penalties_match_a_straightforward_implementation(device):
    rng = np.random.default_rng(9)
    V = 40
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.7),
              SamplingParams(frequency_penalty=0.4), SamplingParams(repetition_penalty=0.8,
                                                                    presence_penalty=-0.5,
                                                                    frequency_penalty=1.5),
              SamplingParams(), SamplingParams(repetition_penalty=2.0)]
    prompts = [rng.integers(0, V, size=rng.integers(0, 15)).tolist() for _ in params]
    outputs = [rng.integers(0, V, size=rng.integers(0, 15)).tolist() for _ in params]
    outputs[5] = []
    logits = torch.tensor(rng.normal(size=(len(params), V)) * 3, dtype=torch.float32)
    logits[0, prompts[0][:1]] = 0.0                             # a zero logit in the penalised set
    x = logits.clone().to(device)
    apply_penalties(x, params, prompts, outputs)
    x = x.cpu()
    for i, p in enumerate(params):
        expected = penalise_by_hand(logits[i].tolist(), p, prompts[i], outputs[i])
        np.testing.assert_allclose(x[i].numpy(), np.array(expected, dtype=np.float32), rtol=1e-6, atol=1e-6)


def test_penalised_sampling_end_to_end(device):
    logits = torch.tensor([3.0, 2.5, 1.0, -1.0, 0.5, -2.0])
    p = SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)
    prompt, output = [0, 3], [1, 1, 2]
    expected = softmax64(np.array(penalise_by_hand(logits.tolist(), p, prompt, output)))
    n = 20000
    torch.manual_seed(3)
    tokens = run(logits.to(device).expand(n, -1).contiguous(), p, prompt=[prompt] * n,
                 output=[output] * n).token_ids
    assert_frequencies(tokens.cpu().numpy(), expected)
    greedy = SamplingParams(repetition_penalty=3.0)
    pen = penalise_by_hand(logits.tolist(), greedy, [0], [])
    assert int(run(logits[None], greedy, prompt=[[0]]).token_ids[0]) == int(np.argmax(pen)) == 1


# ---- logprobs -------------------------------------------------------------------------------------
def test_logprobs_are_of_the_raw_distribution(device):
    logits = (torch.randn(5, 120, generator=torch.Generator().manual_seed(10)) * 3).to(device)
    params = [SamplingParams(logprobs=0), SamplingParams(temperature=0.5, top_k=3, logprobs=5),
              SamplingParams(temperature=1.0, repetition_penalty=1.8, logprobs=2),
              SamplingParams(), SamplingParams(temperature=1.0, top_p=0.3, logprobs=5)]
    out = run(logits, params, prompt=[[1, 2, 3]] * 5)
    raw = torch.log_softmax(logits.double(), -1)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (5,)
    torch.testing.assert_close(out.logprobs.double(), raw.gather(1, out.token_ids[:, None]).squeeze(1),
                               rtol=1e-5, atol=1e-5)
    assert out.top_ids.shape == (5, 5) and out.top_logprobs.shape == (5, 5)
    ref_vals, ref_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.top_ids, ref_ids)
    torch.testing.assert_close(out.top_logprobs.double(), ref_vals, rtol=1e-5, atol=1e-5)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])


def test_logprobs_fields_absent_when_not_requested():
    logits = torch.randn(3, 50)
    out = run(logits, [SamplingParams(temperature=1.0)] * 3)
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    out = run(logits, [SamplingParams(logprobs=0), SamplingParams(), SamplingParams()])
    assert out.logprobs is not None and out.top_ids is None
    assert math.isclose(float(out.logprobs[0]), float(torch.log_softmax(logits[0], -1).max()), rel_tol=1e-6)
