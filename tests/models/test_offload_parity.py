"""Offload runtime with a tiny expert cache (cache device = CPU) vs the all-resident model."""
import pytest
import torch

from tests.models.test_parity import PROMPTS, prefill_logits
from tests.models.tiny import FAMILIES, make_reference, save
from tidal.engine.engine import Engine
from tidal.experts.runtime import OffloadExperts
from tidal.types import SamplingParams


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return save(make_reference(request.param, seed=3), tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def resident(checkpoint):
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", progress=False)
    logits = prefill_logits(engine, PROMPTS)
    greedy = [r.output_ids for r, _ in engine.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
    return logits, greedy


@pytest.mark.parametrize("policy", ["qstar", "transfer", "cpu", "static"])
def test_every_policy_computes_the_same_function(checkpoint, resident, policy):
    want_logits, want_greedy = resident
    # static: one whole layer resident, the others on the CPU; transfer: room for any one layer's
    # experts, so no miss ever has to fall back to the CPU; the others: a cache smaller than a layer.
    slots = 8 if policy in ("static", "transfer") else 3
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", progress=False, offload_device="cpu",
                    moe_policy=policy, expert_cache_slots=slots, adapt=False)
    runtime = engine.loaded.experts
    assert isinstance(runtime, OffloadExperts) and runtime.lru.num_slots == slots
    for got, want in zip(prefill_logits(engine, PROMPTS), want_logits):
        assert (got - want).abs().max().item() <= 1e-4
    got_greedy = [r.output_ids for r, _ in engine.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert got_greedy == want_greedy
    st = runtime.stats()
    assert st["hits"] + st["misses"] > 0
    if policy == "cpu":  # prefill chunks fill the cache; decode never does
        assert st["cpu_executed"] > 0
    if policy == "transfer":
        assert st["cpu_executed"] == 0 and st["fills"] == st["misses"]
    if policy == "qstar":
        assert st["fills"] >= 1 and st["cpu_executed"] >= 1
    assert len(runtime.resident_keys()) <= slots
