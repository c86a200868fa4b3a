"""Tidal vs transformers on tiny random checkpoints of every family, in float32 on the CPU."""
from __future__ import annotations

import pytest
import torch

from tests.models.tiny import FAMILIES, make_reference, reference_greedy, reference_logits, save
from tidal.engine.engine import Engine
from tidal.types import Request, RequestStatus, SamplingParams, ScheduledBatch, ScheduledSeq

PROMPTS = [[5, 17, 33, 2, 60, 7], list(range(3, 40)), [11, 12, 13, 14, 90, 91, 92, 93, 94, 20, 21, 22, 70]]
VARIANTS = [  # (save_original_format, hub_style config.json)
    (True, False), (False, False), (True, True),
]


def load_reference(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, experts_implementation="eager",
                                                attn_implementation="eager", dtype=torch.float32).eval()


def prefill_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Run all prompts as one batched forward through Tidal's runner; logits at every position."""
    seqs = []
    for i, ids in enumerate(prompts):
        req = Request(f"p{i}", ids, SamplingParams(), status=RequestStatus.RUNNING)
        req.pages = engine.scheduler.allocator.allocate(-(-len(ids) // engine.config.page_size))
        seqs.append(ScheduledSeq(req, 0, len(ids), sample=True))
    hidden, _ = engine.runner.forward(ScheduledBatch(seqs))
    logits = engine.loaded.model.compute_logits(hidden)
    out, start = [], 0
    for ids in prompts:
        out.append(logits[start:start + len(ids)])
        start += len(ids)
    for s in seqs:
        engine.scheduler.allocator.release(s.request.pages)
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.mark.parametrize("original_format,hub_style", VARIANTS)
def test_logits_match_transformers(family, original_format, hub_style, tmp_path):
    ref_model = make_reference(family)
    path = save(ref_model, tmp_path / family, original_format, hub_style)
    ref = load_reference(path)
    engine = Engine(str(path), device="cpu", dtype="float32", progress=False)
    ours = prefill_logits(engine, PROMPTS)
    for ids, got in zip(PROMPTS, ours):
        want = reference_logits(ref, ids)
        assert (got - want).abs().max().item() <= 1e-4


def test_greedy_matches_transformers_generate(family, tmp_path):
    path = save(make_reference(family, seed=1), tmp_path / family)
    ref = load_reference(path)
    engine = Engine(str(path), device="cpu", dtype="float32", progress=False, page_size=8)
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    for ids, (req, _) in zip(PROMPTS, results):
        assert req.output_ids == reference_greedy(ref, ids, 32)
        assert req.finish_reason == "length"


def test_rope_scaling_and_sliding_window(tmp_path):
    # yarn (Qwen3 long context) with a small original window so the test positions use it.
    qwen = make_reference("qwen3_moe", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 16})
    mix = make_reference("mixtral", sliding_window=8)
    for name, model in (("qwen_yarn", qwen), ("mixtral_window", mix)):
        path = save(model, tmp_path / name)
        ref = load_reference(path)
        engine = Engine(str(path), device="cpu", dtype="float32", progress=False)
        got = prefill_logits(engine, [PROMPTS[1]])[0]
        assert (got - reference_logits(ref, PROMPTS[1])).abs().max().item() <= 1e-4
        results = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24, ignore_eos=True))
        assert results[0][0].output_ids == reference_greedy(ref, PROMPTS[0], 24)


def test_sharded_checkpoint_with_index(tmp_path):
    """Several safetensors files tied together by model.safetensors.index.json."""
    ref_model = make_reference("mixtral", seed=4)
    ref_model.save_pretrained(tmp_path / "m", max_shard_size="60KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    ref = load_reference(tmp_path / "m")
    engine = Engine(str(tmp_path / "m"), device="cpu", dtype="float32", progress=False)
    got = prefill_logits(engine, [PROMPTS[2]])[0]
    assert (got - reference_logits(ref, PROMPTS[2])).abs().max().item() <= 1e-4
