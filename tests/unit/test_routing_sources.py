"""Benchmark routing sources (tidal/experts/routing.py) and the MoE layer's routing override."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tidal.errors import ConfigError
from tidal.experts.routing import TraceRouting, UniformRouting, ZipfRouting, parse_routing


def _check_valid(ids: torch.Tensor, T: int, K: int, E: int) -> None:
    assert ids.shape == (T, K) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < E
    assert bool((ids.sort(dim=-1).values.diff(dim=-1) != 0).all()), "repeated expert within a token"


def _write_trace(path, layers=(0, 1), steps=5, K=3, E=8, prefill_tokens=4):
    """A small trace in `tidal trace`'s format; returns the decode ids as {layer: [[e, ...], ...]}."""
    g = torch.Generator().manual_seed(7)
    decode = {layer: [] for layer in layers}
    with open(path, "w") as f:
        f.write(json.dumps({"request": 0, "prompt_tokens": prefill_tokens}) + "\n")
        pre = {str(layer): [torch.randperm(E, generator=g)[:K].tolist() for _ in range(prefill_tokens)]
               for layer in layers}
        f.write(json.dumps({"step": 0, "phase": "prefill", "tokens": prefill_tokens, "layers": pre}) + "\n")
        for s in range(1, steps + 1):
            rec = {}
            for layer in layers:
                tok = torch.randperm(E, generator=g)[:K].tolist()
                decode[layer].append(tok)
                rec[str(layer)] = [tok]
            f.write(json.dumps({"step": s, "phase": "decode", "tokens": 1, "layers": rec}) + "\n")
    return decode


@pytest.mark.parametrize("spec", ["uniform", "uniform,seed:5", "zipf:1.2", "zipf:1.2,reuse:0.5", "zipf:0",
                                  "zipf:3,reuse:1,seed:2"])
@pytest.mark.parametrize("T,K,E", [(1, 4, 16), (37, 4, 16), (64, 8, 128), (5, 16, 16)])
def test_generated_ids_are_valid(spec, T, K, E):
    src = parse_routing(spec)
    src.bind([0, 3], E, K)
    for layer in (0, 3):
        for _ in range(3):
            _check_valid(src.ids(layer, T, K, E), T, K, E)


def test_trace_ids_are_valid(tmp_path):
    _write_trace(tmp_path / "t.jsonl")
    src = parse_routing(f"trace:{tmp_path / 't.jsonl'}")
    src.bind([0, 1], 8, 3)
    _check_valid(src.ids(1, 12, 3, 8), 12, 3, 8)


def test_model_spec_is_none():
    assert parse_routing("model") is None and parse_routing(None) is None


@pytest.mark.parametrize("spec", ["uniform", "zipf:1.2,reuse:0.3"])
def test_seeded_repeatability(spec):
    def run(src):
        return [src.ids(layer, t, 4, 32) for t in (7, 1, 1, 3) for layer in (0, 1)]

    a, b = parse_routing(spec), parse_routing(spec)
    first = run(a)
    assert all(torch.equal(x, y) for x, y in zip(first, run(b)))
    a.reset()
    assert all(torch.equal(x, y) for x, y in zip(first, run(a))), "reset() must restart the streams"
    other = parse_routing(spec + ",seed:1")
    assert not all(torch.equal(x, y) for x, y in zip(first, run(other)))
    # A layer's stream does not depend on the other layers' calls.
    c = parse_routing(spec)
    assert torch.equal(c.ids(1, 7, 4, 32), first[1])


def _zipf_p1(s: float, E: int) -> float:
    """Probability of the most popular expert under Zipf(s) over E experts, from the definition."""
    return 1.0 / math.fsum(r ** -s for r in range(1, E + 1))


def test_zipf_skew_matches_expectation():
    E, N, s = 128, 20000, 1.2
    p1 = _zipf_p1(s, E)                       # ~0.26, i.e. ~34x the uniform share 1/128
    # K = 1: the top expert's frequency is p1 itself.
    src = ZipfRouting(s)
    ids = src.ids(0, N, 1, E)
    top = int(torch.bincount(ids.reshape(-1), minlength=E).argmax())
    assert top == int(src.popularity(0, E).argmax())
    freq = float((ids == top).any(dim=-1).float().mean())
    assert abs(freq - p1) < 4 * math.sqrt(p1 * (1 - p1) / N)
    # K = 8 without replacement: each further draw picks the top expert with probability >= p1, so
    # it is in a token's set with probability >= 1 - (1 - p1)^8 (~0.91, 14.5x the uniform 8/128).
    K = 8
    ids = ZipfRouting(s).ids(0, N, K, E)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    incl = float(counts.max()) / N
    bound = 1 - (1 - p1) ** K
    assert incl >= bound - 0.02
    assert incl > 3 * K / E
    # S = 0 is uniform: nothing far above its share.
    flat = ZipfRouting(0.0).ids(0, N, K, E)
    assert float(torch.bincount(flat.reshape(-1), minlength=E).max()) / N < 1.3 * K / E
    # Each layer has its own permutation: the popular experts differ between layers.
    z = ZipfRouting(s)
    assert not torch.equal(z.popularity(0, E).argsort(), z.popularity(1, E).argsort())


def _repeat_fraction(src, steps=2000, K=8, E=128) -> float:
    sets = [src.ids(0, 1, K, E)[0] for _ in range(steps)]               # decode: one token per call
    return sum(torch.equal(a, b) for a, b in zip(sets, sets[1:])) / (steps - 1)


def test_reuse_repeats_previous_decode_set():
    src = ZipfRouting(1.2, reuse=1.0)
    first = src.ids(0, 1, 8, 128)
    for _ in range(50):
        assert torch.equal(src.ids(0, 1, 8, 128), first)
    assert torch.equal(src.ids(0, 9, 8, 128), first.expand(9, 8))       # within a multi-token call too
    assert not torch.equal(src.ids(1, 1, 8, 128), first)                 # per layer
    # P = 0: independent draws; identical consecutive 8-sets are rare even at S = 1.2.
    assert _repeat_fraction(ZipfRouting(1.2, reuse=0.0)) < 0.05
    frac = _repeat_fraction(ZipfRouting(1.2, reuse=0.5))
    assert 0.44 < frac < 0.58


def test_trace_replays_decode_steps_in_order(tmp_path):
    path = tmp_path / "t.jsonl"
    decode = _write_trace(path, layers=(0, 1), steps=5, K=3, E=8)
    src = parse_routing(f"trace:{path}")
    assert isinstance(src, TraceRouting) and src.steps == 5
    src.bind([0, 1], 8, 3)
    got = [src.ids(0, 1, 3, 8)[0].tolist() for _ in range(7)]             # cycles after 5
    assert got == decode[0] + decode[0][:2]
    assert src.ids(1, 4, 3, 8).tolist() == decode[1][:4]                  # multi-token calls consume rows
    src.reset()
    assert src.ids(0, 1, 3, 8)[0].tolist() == decode[0][0]
    # Fewer experts per token than the trace: the first (strongest) K of each token.
    src.bind([0, 1], 8, 2)
    src.reset()
    assert src.ids(0, 2, 2, 8).tolist() == [t[:2] for t in decode[0][:2]]
    # A model with more MoE layers (or other indices): layers map by position, modulo the trace's.
    src.bind([4, 9, 11], 8, 3)
    src.reset()
    assert src.ids(11, 1, 3, 8)[0].tolist() == decode[0][0]
    assert src.ids(9, 1, 3, 8)[0].tolist() == decode[1][0]


def test_trace_shape_mismatch_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    _write_trace(path, K=3, E=8)
    src = parse_routing(f"trace:{path}")
    with pytest.raises(ConfigError, match="experts per token"):
        src.bind([0, 1], 8, 4)
    with pytest.raises(ConfigError, match=r"routes to expert \d+, but this model has 4 experts"):
        src.bind([0, 1], 4, 2)


def test_demo_trace_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "demo_trace.jsonl"
    if not path.exists():
        pytest.skip("no demo trace in this checkout")
    src = parse_routing(f"trace:{path}")
    src.bind(list(range(6)), 16, 4)
    first = next(json.loads(line) for line in path.open() if '"decode"' in line)
    assert src.ids(2, 1, 4, 16)[0].tolist() == first["layers"]["2"][0]


@pytest.mark.parametrize("spec,needle", [
    ("zipf", "needs an exponent"),
    ("zipf:abc", "'abc' is not a number"),
    ("zipf:-1", "must be a finite number >= 0"),
    ("zipf:1.2,reuse:1.5", "reuse '1.5'"),
    ("zipf:1.2,reuse:x", "reuse 'x' is not a number"),
    ("zipf:1.2,reuse", "option 'reuse' is not of the form name:value"),
    ("zipf:1.2,reuse:0.1,reuse:0.2", "'reuse' is given twice"),
    ("zipf:1.2,bogus:3", "unknown option 'bogus'"),
    ("uniform:4", "uniform takes no value"),
    ("uniform,seed:x", "seed 'x' is not an integer"),
    ("gauss:1", "unknown source 'gauss'"),
    ("trace:", "needs a file"),
    ("trace:/no/such/trace.jsonl", "cannot read the trace file"),
])
def test_bad_specs(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_routing(spec)


def test_bad_trace_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"request": 0}) + "\n")
    with pytest.raises(ConfigError, match="no decode steps"):
        parse_routing(f"trace:{empty}")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"broken.jsonl:1: not valid JSON"):
        parse_routing(f"trace:{broken}")
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps({"step": 1, "phase": "decode", "tokens": 1, "layers": {"0": [[1, 1]]}}) + "\n")
    with pytest.raises(ConfigError, match="distinct"):
        parse_routing(f"trace:{dup}")


# -- the override inside a real model --------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    import tidal.weights.demo
    from tidal.engine.engine import Engine

    return Engine(str(tidal.weights.demo.demo_model_path()), device="cpu", dtype="float32", progress=False,
                  offload_device="cpu", moe_policy="qstar", expert_cache_slots=8, adapt=False)


def _record(engine, prompt, n):
    """Generate n tokens; return [(layer, ids)] as the expert runtime received them."""
    from tidal.types import SamplingParams

    runtime = engine.loaded.experts
    inner, calls = runtime.forward, []

    def recording(layer, hidden, ids, weights):
        calls.append((layer, ids.clone()))
        return inner(layer, hidden, ids, weights)

    runtime.forward = recording
    try:
        engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    finally:
        del runtime.forward
    return calls


def test_model_routes_to_source_ids(engine, tmp_path):
    from tidal.layers.moe import MoELayer, Router, routing_override

    cfg = engine.model_config
    E, K = cfg.num_experts, cfg.top_k
    model = engine.loaded.model
    prompt = list(range(1, 13))
    router_calls = []
    hook = [m.register_forward_hook(lambda *a: router_calls.append(1)) for m in model.modules()
            if isinstance(m, Router)]
    try:
        before = engine.loaded.experts.stats()
        with routing_override(model, parse_routing("zipf:1.2,reuse:0.5,seed:3")):
            calls = _record(engine, prompt, 6)
        after = engine.loaded.experts.stats()
    finally:
        for h in hook:
            h.remove()
    assert len(router_calls) == len(calls), "the router must still run once per MoE layer call"
    # Replay the same calls against a fresh source: the runtime saw exactly its ids.
    ref = ZipfRouting(1.2, reuse=0.5, seed=3)
    assert len(calls) == len(cfg.moe_layers) * 6 and calls[0][1].shape[0] == len(prompt)
    for layer, ids in calls:
        _check_valid(ids, ids.shape[0], K, E)
        assert torch.equal(ids, ref.ids(layer, ids.shape[0], K, E))
    # The offload runtime served them and counted them.
    assert after["layer_calls"] - before["layer_calls"] == len(calls)
    assert after["hits"] + after["misses"] > before["hits"] + before["misses"]
    # Removed: the router's own choice again (it differs from the source's for this prompt).
    assert all(m.routing_override is None for m in model.modules() if isinstance(m, MoELayer))
    plain = _record(engine, prompt, 1)
    assert not torch.equal(plain[0][1], calls[0][1])

    # A trace source on the same model replays the trace's decode ids.
    path = tmp_path / "t.jsonl"
    decode = _write_trace(path, layers=tuple(cfg.moe_layers), steps=4, K=K, E=E, prefill_tokens=2)
    with routing_override(model, parse_routing(f"trace:{path}")):
        calls = _record(engine, [5, 6, 7], 3)               # prefill of 3 tokens, then 2 decode steps
    for layer in cfg.moe_layers:
        seq = [ids for lay, ids in calls if lay == layer]
        rows = torch.cat(seq).tolist()
        assert rows == (decode[layer] * 2)[:5]


def test_override_refuses_incompatible_trace(engine, tmp_path):
    from tidal.layers.moe import MoELayer, set_routing_override

    path = tmp_path / "big.jsonl"
    _write_trace(path, layers=(0,), K=4, E=64)      # expert ids beyond the demo's 16
    with pytest.raises(ConfigError, match="experts per layer"):
        set_routing_override(engine.loaded.model, parse_routing(f"trace:{path}"))
    assert all(m.routing_override is None for m in engine.loaded.model.modules() if isinstance(m, MoELayer))


def test_uniform_source_class():
    assert UniformRouting().spec == "uniform" and UniformRouting(4).spec == "uniform,seed:4"
    assert ZipfRouting(1.2, 0.5).spec == "zipf:1.2,reuse:0.5"
