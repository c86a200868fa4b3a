"""Qwen3.5-MoE (text model of the vision-language checkpoint) vs transformers, float32 on CPU."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.models.test_qwen3_next import PROMPTS, prefill_logits
from tests.models.tiny import reference_greedy, reference_logits
from tidal.engine.engine import Engine
from tidal.types import SamplingParams


def make_qwen3_5_moe(seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    text = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=512,
                rms_norm_eps=1e-6, eos_token_id=95, bos_token_id=1, pad_token_id=0,
                layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    model = tf.Qwen3_5MoeForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("shared_expert_gate.weight"):
                p.normal_(0, 0.3)
            elif "dt_bias" in name or "A_log" in name:
                p.copy_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def reference_and_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    model = make_qwen3_5_moe(seed=3)
    model.save_pretrained(path)
    return model, path


def test_logits_and_greedy_match_transformers(reference_and_path, caplog):
    ref, path = reference_and_path
    with caplog.at_level(logging.INFO, logger="tidal.models.qwen3_5_moe"):
        engine = Engine(str(path), device="cpu", dtype="float32", progress=False, max_batch_tokens=16)
    assert any("vision-tower tensors" in r.getMessage() for r in caplog.records)
    assert engine.model_config.model_type == "qwen3_5_moe" and engine.model_config.has_recurrent_layers
    for ids, got in zip(PROMPTS, prefill_logits(engine, PROMPTS)):
        assert (got - reference_logits(ref, ids)).abs().max().item() <= 1e-4
    prompts = PROMPTS[:3]
    results = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for ids, (req, _) in zip(prompts, results):
        assert req.output_ids == reference_greedy(ref, ids, 24)
