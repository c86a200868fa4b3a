"""Synthetic and recorded routing for benchmarks: where a MoE layer's expert ids come from.

Random weights route almost uniformly, which hides what an expert cache is for. A RoutingSource
replaces the router's *choice of experts* (never its cost: the router still runs) with ids from a
skewed, temporally correlated generator or a recorded trace, so cache policies can be compared
under realistic locality. Benchmarks only: serving never installs a source (see
`tidal.layers.moe.set_routing_override`).

Specs (`parse_routing`, the `--routing` flag of `tidal bench decode`):
  model                      the model's own router (no source)
  uniform[,seed:N]           K distinct experts uniformly at random per token
  zipf:S[,reuse:P][,seed:N]  per layer a Zipf(S) popularity over a per-layer random permutation of
                             the experts, K distinct experts per token drawn without replacement
                             (successive sampling); with probability P a token's set for a layer
                             repeats the previous token's set for that layer (temporal correlation)
  trace:FILE                 replays the decode steps of a `tidal trace` file in order, cycling

Every source sees, per layer, one stream of tokens: a call for T tokens consumes the next T tokens
of that layer's stream (a prefill chunk consumes T, a decode step of one sequence consumes 1; in a
decode batch of several sequences "the previous token" is the previous row of the batch). `reset()`
restarts every stream, so runs that reset before each row see identical expert ids.
"""
from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional, Sequence

import torch

from tidal.errors import ConfigError
from tidal.jsonl import iter_jsonl

log = logging.getLogger(__name__)

SPEC_HELP = "model | uniform[,seed:N] | zipf:S[,reuse:P][,seed:N] | trace:FILE"


class RoutingSource(ABC):
    """Where a MoE layer's routed expert ids come from, instead of its router's top-k.

    Rules:
    - `ids` returns a [T, K] int64 tensor on `device`; each row holds K distinct ids in [0, E).
    - The result depends only on the source's seed/trace and the sequence of calls per layer since
      the last `reset()` (layers do not influence each other's streams).
    - `bind` is called once when the source is installed on a model, before any `ids` call; it
      raises ConfigError when the source cannot serve that model's shapes.
    """

    spec: str = "?"

    def bind(self, layers: Sequence[int], num_experts: int, top_k: int) -> None:
        """The model's MoE layer indices (ascending), experts per layer and experts per token."""
        if top_k > num_experts:
            raise ConfigError(f"routing {self.spec}: top_k {top_k} exceeds the {num_experts} experts per layer")

    def reset(self) -> None:
        """Restart every layer's stream from the beginning (same seed, first trace step)."""

    @abstractmethod
    def ids(self, layer: int, num_tokens: int, top_k: int, num_experts: int,
            device: torch.device | str = "cpu") -> torch.Tensor:
        """Expert ids for the next `num_tokens` tokens of `layer`: [T, K] int64, distinct per row."""


# -- generators --------------------------------------------------------------------------------------
class _SeededSource(RoutingSource):
    """Per-layer CPU generators seeded from (seed, layer): streams independent of call order."""

    def __init__(self, seed: int):
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self._gens: dict[int, torch.Generator] = {}

    def _gen(self, layer: int) -> torch.Generator:
        g = self._gens.get(layer)
        if g is None:
            g = self._gens[layer] = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
        return g


class UniformRouting(_SeededSource):
    def __init__(self, seed: int = 0):
        self.spec = "uniform" + (f",seed:{seed}" if seed else "")
        super().__init__(seed)

    def ids(self, layer, num_tokens, top_k, num_experts, device="cpu"):
        # The first K of a uniform random permutation per row: K distinct, uniformly chosen.
        keys = torch.rand(num_tokens, num_experts, generator=self._gen(layer))        # [T, E]
        return keys.argsort(dim=-1)[:, :top_k].to(device)                            # [T, K]


class ZipfRouting(_SeededSource):
    """Zipf(S) popularity: the expert of rank r (1-based) has weight r^-S; each layer ranks its
    experts by its own random permutation. Tokens draw K distinct experts without replacement
    (torch.multinomial), so the top expert's inclusion probability is >= 1 - (1 - p_1)^K."""

    def __init__(self, s: float, reuse: float = 0.0, seed: int = 0):
        self.s, self.reuse = s, reuse
        self.spec = f"zipf:{s:g},reuse:{reuse:g}" + (f",seed:{seed}" if seed else "")
        super().__init__(seed)

    def reset(self) -> None:
        super().reset()
        self._probs: dict[int, torch.Tensor] = {}      # layer -> [E] popularity by expert id
        self._prev: dict[int, torch.Tensor] = {}       # layer -> [K] the last token's set

    def popularity(self, layer: int, num_experts: int) -> torch.Tensor:
        """[E] float64 probabilities by expert id (the permutation is drawn once per layer)."""
        p = self._probs.get(layer)
        if p is None or p.numel() != num_experts:
            ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
            by_rank = ranks.pow(-self.s)
            by_rank /= by_rank.sum()
            perm = torch.randperm(num_experts, generator=self._gen(layer))          # rank -> expert id
            p = torch.empty_like(by_rank)
            p[perm] = by_rank
            p = self._probs[layer] = p
        return p

    def ids(self, layer, num_tokens, top_k, num_experts, device="cpu"):
        g = self._gen(layer)
        p = self.popularity(layer, num_experts)
        fresh = torch.multinomial(p.expand(num_tokens, num_experts), top_k, replacement=False,
                                  generator=g)                                          # [T, K]
        # Token t repeats token t-1's set with probability P, so it carries the set of the last
        # token at or before t that drew fresh (or the previous call's last set).
        fresh_row = torch.rand(num_tokens, generator=g) >= self.reuse                     # [T]
        prev = self._prev.get(layer)
        if prev is None or prev.numel() != top_k:
            prev = None
            fresh_row[0] = True
        pos = torch.where(fresh_row, torch.arange(num_tokens), -1)
        last = torch.cummax(pos, dim=0).values                                             # [T]
        out = fresh[last.clamp(min=0)]
        if prev is not None:
            out[last < 0] = prev
        self._prev[layer] = out[-1].clone()
        return out.to(device)


class TraceRouting(RoutingSource):
    """Replays the decode steps of a `tidal trace` JSONL file, in order, cycling.

    Shapes: the model's i-th MoE layer replays the trace's i-th layer (layers sorted by index),
    modulo the trace's layer count, so a trace with fewer layers is reused cyclically (logged). A
    trace whose expert ids do not fit the model (id >= E) or with fewer experts per token than the
    model's top_k is refused (ConfigError): folding ids modulo E would merge experts and change the
    very locality being measured. A trace with more experts per token keeps each token's first K
    (the router's strongest)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.spec = f"trace:{path}"
        # layers: trace layer index -> [N, K_trace] int64, every decode token of that layer in order
        self.layers, self.top_k, self.max_id, self.steps = _read_trace(self.path)
        self._map: dict[int, int] = {}          # model layer -> trace layer (set by bind)
        self.reset()

    def bind(self, layers, num_experts, top_k):
        super().bind(layers, num_experts, top_k)
        if self.max_id >= num_experts:
            raise ConfigError(f"routing {self.spec}: the trace routes to expert {self.max_id}, but this model has "
                              f"{num_experts} experts per layer (record a trace with this model)")
        if self.top_k < top_k:
            raise ConfigError(f"routing {self.spec}: the trace has {self.top_k} experts per token, this model "
                              f"routes {top_k} (record a trace with this model)")
        keys = sorted(self.layers)
        if len(keys) < len(layers):
            log.warning("routing %s: the trace has %d MoE layers, the model %d; layers reuse the trace's "
                        "layers cyclically", self.spec, len(keys), len(layers))
        self._map = {layer: keys[i % len(keys)] for i, layer in enumerate(layers)}

    def reset(self) -> None:
        self._cursor: dict[int, int] = {}

    def ids(self, layer, num_tokens, top_k, num_experts, device="cpu"):
        key = self._map.get(layer)
        if key is None:                     # not bound (direct use): map by the layer's own index
            keys = sorted(self.layers)
            key = layer if layer in self.layers else keys[layer % len(keys)]
        rows = self.layers[key]                                                        # [N, K_trace]
        start = self._cursor.get(layer, 0)
        idx = (torch.arange(start, start + num_tokens) % rows.shape[0])
        self._cursor[layer] = (start + num_tokens) % rows.shape[0]
        return rows[idx, :top_k].to(device)


def _read_trace(path: Path) -> tuple[dict[int, torch.Tensor], int, int, int]:
    per_layer: dict[int, list] = {}
    top_k, steps = None, 0
    for n, rec in iter_jsonl(path, "the trace file", prefix="routing trace:"):
        if not isinstance(rec, dict) or rec.get("phase") != "decode":
            continue                        # request headers and prefill forwards
        layers = rec.get("layers")
        if not isinstance(layers, dict) or not layers:
            raise ConfigError(f"routing trace:{path}:{n}: a decode step without a \"layers\" object")
        if steps and set(int(k) for k in layers) != set(per_layer):
            raise ConfigError(f"routing trace:{path}:{n}: this step's layers differ from the first decode step's")
        for key, tokens in layers.items():
            for tok in tokens:
                if (not isinstance(tok, list) or not tok or len(set(tok)) != len(tok)
                        or not all(isinstance(e, int) and e >= 0 for e in tok)):
                    raise ConfigError(f"routing trace:{path}:{n}: layer {key}: expected distinct non-negative "
                                      f"expert ids per token, got {tok!r}")
                if top_k is None:
                    top_k = len(tok)
                elif len(tok) != top_k:
                    raise ConfigError(f"routing trace:{path}:{n}: layer {key}: {len(tok)} experts for a token, "
                                      f"earlier tokens have {top_k}")
            per_layer.setdefault(int(key), []).extend(tokens)
        steps += 1
    if not steps:
        raise ConfigError(f"routing trace:{path}: no decode steps (expected lines from `tidal trace`)")
    counts = {len(v) for v in per_layer.values()}
    if len(counts) != 1 or 0 in counts:
        raise ConfigError(f"routing trace:{path}: layers have different numbers of decode tokens")
    tensors = {k: torch.tensor(v, dtype=torch.int64) for k, v in per_layer.items()}
    max_id = max(int(t.max()) for t in tensors.values())
    return tensors, top_k, max_id, steps


# -- specs -------------------------------------------------------------------------------------------
def parse_routing(spec: Optional[str]) -> Optional[RoutingSource]:
    """A `--routing` spec -> a RoutingSource, or None for `model` (the router's own choice)."""
    spec = (spec or "model").strip()
    if spec == "model":
        return None
    if spec.startswith("trace:"):
        path = spec[len("trace:"):]
        if not path:
            raise ConfigError(f"routing {spec!r}: trace: needs a file, e.g. trace:benchmarks/traces/demo_trace.jsonl")
        return TraceRouting(path)
    head, *rest = [part.strip() for part in spec.split(",")]
    kind, _, value = head.partition(":")
    opts = _options(spec, rest)
    if kind == "uniform":
        if value:
            raise ConfigError(f"routing {spec!r}: uniform takes no value (got {head!r}); use {SPEC_HELP}")
        _only(spec, opts, {"seed"})
        return UniformRouting(seed=_int(spec, "seed", opts.get("seed", "0")))
    if kind == "zipf":
        if not value:
            raise ConfigError(f"routing {spec!r}: zipf needs an exponent, e.g. zipf:1.2,reuse:0.5")
        s = _float(spec, "zipf exponent", value)
        if not (math.isfinite(s) and s >= 0):
            raise ConfigError(f"routing {spec!r}: zipf exponent {value!r} must be a finite number >= 0")
        _only(spec, opts, {"reuse", "seed"})
        reuse = _float(spec, "reuse", opts.get("reuse", "0"))
        if not 0.0 <= reuse <= 1.0:
            raise ConfigError(f"routing {spec!r}: reuse {opts['reuse']!r} must be a probability in [0, 1]")
        return ZipfRouting(s, reuse, seed=_int(spec, "seed", opts.get("seed", "0")))
    raise ConfigError(f"routing {spec!r}: unknown source {kind!r}; use {SPEC_HELP}")


def _options(spec: str, parts: list[str]) -> dict[str, str]:
    opts: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition(":")
        if not sep or not key or not value:
            raise ConfigError(f"routing {spec!r}: option {part!r} is not of the form name:value")
        if key in opts:
            raise ConfigError(f"routing {spec!r}: option {key!r} is given twice")
        opts[key] = value
    return opts


def _only(spec: str, opts: dict, allowed: set[str]) -> None:
    bad = sorted(set(opts) - allowed)
    if bad:
        raise ConfigError(f"routing {spec!r}: unknown option {bad[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _float(spec: str, name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"routing {spec!r}: {name} {value!r} is not a number") from None


def _int(spec: str, name: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"routing {spec!r}: {name} {value!r} is not an integer") from None
    if n < 0:
        raise ConfigError(f"routing {spec!r}: {name} {value!r} must be >= 0")
    return n
