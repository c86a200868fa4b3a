"""Qwen3-Next (hybrid gated DeltaNet + gated attention, shared expert) vs transformers, float32 on CPU."""
from __future__ import annotations

import pytest
import torch

from tests.models.test_parity import load_reference
from tests.models.tiny import reference_greedy, reference_logits
from tidal.engine.engine import Engine
from tidal.layers.linear_attention import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tidal.types import Request, RequestStatus, SamplingParams, ScheduledBatch, ScheduledSeq

# Lengths straddle the DeltaNet chunk (64) and the conv width (4).
PROMPTS = [[5, 17, 33, 2, 60, 7], list(range(3, 40)) + list(range(10, 50)), [11, 12, 13], [9]]


def make_qwen3_next(seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen3NextConfig(**{**dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=True, mlp_only_layers=[2], max_position_embeddings=512, rms_norm_eps=1e-6,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        tie_word_embeddings=False, eos_token_id=95, bos_token_id=1, pad_token_id=0), **overrides})
    model = tf.Qwen3NextForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):       # plain (1-centred) gated norm
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "norm" in name:                                 # zero-centred: weight is the offset
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):              # sharper routers
                p.normal_(0, 0.5)
            elif name.endswith("shared_expert_gate.weight"):
                p.normal_(0, 0.3)
            elif "dt_bias" in name or "A_log" in name:           # varied decays across heads
                p.copy_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next")
    make_qwen3_next(seed=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


def prefill_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in one forward through the runner (each with pages and a state slot)."""
    seqs = []
    for i, ids in enumerate(prompts):
        req = Request(f"p{i}", ids, SamplingParams(), status=RequestStatus.RUNNING)
        req.pages = engine.scheduler.allocator.allocate(-(-len(ids) // engine.config.page_size))
        req.state_slot = engine.scheduler.state_slots.allocate()
        seqs.append(ScheduledSeq(req, 0, len(ids), sample=True))
    hidden, _ = engine.runner.forward(ScheduledBatch(seqs))
    logits = engine.loaded.model.compute_logits(hidden)
    for s in seqs:
        engine.scheduler.allocator.release(s.request.pages)
        engine.scheduler.state_slots.release(s.request.state_slot)
    return list(logits.split([len(ids) for ids in prompts]))


def test_delta_rule_chunked_equals_recurrent():
    torch.manual_seed(0)
    H, T, Dk, Dv = 3, 150, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(H, T, Dk), dim=-1) for _ in range(2))
    v, beta, g = torch.randn(H, T, Dv), torch.rand(H, T), -torch.rand(H, T)
    s0 = torch.randn(H, Dk, Dv)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=16)
    state, steps = s0[None], []
    for t in range(T):
        o, state = recurrent_gated_delta_rule(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t],
                                              beta[None, :, t], state)
        steps.append(o[0])
    assert torch.allclose(out, torch.stack(steps, dim=1), atol=1e-4)
    assert torch.allclose(s, state[0], atol=1e-4)


def test_logits_match_transformers(checkpoint, reference):
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", progress=False)
    assert engine.scheduler.prefix_cache is None and engine.state_pool is not None
    for ids, got in zip(PROMPTS, prefill_logits(engine, PROMPTS)):
        assert (got - reference_logits(reference, ids)).abs().max().item() <= 1e-4


def test_chunked_prefill_and_greedy_match_generate(checkpoint, reference):
    prompts = PROMPTS[:3]
    want = [reference_greedy(reference, ids, 24) for ids in prompts]
    for max_batch_tokens in (8192, 8):   # 8: prompts are prefilled in chunks carrying the state over
        engine = Engine(str(checkpoint), device="cpu", dtype="float32", progress=False, page_size=8,
                        max_batch_tokens=max_batch_tokens)
        results = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        assert [r.output_ids for r, _ in results] == want
        assert engine.scheduler.state_slots.num_free == engine.config.max_running   # all given back


def test_two_concurrent_requests_share_a_batch(checkpoint, reference):
    """Two requests decode in the same forwards (batched recurrent step over two state slots)."""
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", progress=False, max_running=2)
    decode_batches = []
    execute = engine.runner.execute

    def spy(batch):
        decode_batches.append(sum(s.num_tokens == 1 and s.start > 0 for s in batch.seqs))
        return execute(batch)

    engine.runner.execute = spy
    prompts = [PROMPTS[0], PROMPTS[2]]
    results = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert max(decode_batches) == 2
    for ids, (req, _) in zip(prompts, results):
        assert req.output_ids == reference_greedy(reference, ids, 12)


def test_preemption_recomputes_state(checkpoint, reference):
    # KV room for about one request: the second is preempted and recomputed from position 0.
    engine = Engine(str(checkpoint), device="cpu", dtype="float32", progress=False, page_size=4,
                    max_model_len=64, kv_cache_tokens=64, max_running=2)
    prompts = [list(range(3, 33)), list(range(40, 70))]
    results = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for ids, (req, _) in zip(prompts, results):
        assert req.output_ids == reference_greedy(reference, ids, 16)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.state_slots.num_free == 2


def test_hub_style_config_and_stacked_experts(tmp_path):
    """Hub config.json of Qwen3-Next: top-level rope_theta / partial_rotary_factor, layers given by
    full_attention_interval instead of layer_types; experts saved stacked (transformers-5 layout)."""
    import json

    model = make_qwen3_next(seed=2, layer_types=None, full_attention_interval=2, mlp_only_layers=[])
    model.save_pretrained(tmp_path, save_original_format=False)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
               full_attention_interval=2, torch_dtype=cfg.pop("dtype"))
    del cfg["layer_types"]
    path.write_text(json.dumps(cfg))
    engine = Engine(str(tmp_path), device="cpu", dtype="float32", progress=False)
    assert engine.model_config.layer_types == ("linear_attention", "full_attention") * 2
    for ids, got in zip(PROMPTS[:2], prefill_logits(engine, PROMPTS[:2])):
        assert (got - reference_logits(model, ids)).abs().max().item() <= 1e-4
