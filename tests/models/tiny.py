"""Tiny random MoE checkpoints built with transformers' own classes (the independent reference)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


def make_reference(family: str, seed: int = 0, **overrides):
    """Build a transformers model of `family` with non-trivial norm weights, in float32."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  eos_token_id=95, bos_token_id=1, pad_token_id=0)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
                                head_dim=16, mlp_only_layers=[1], **{**common, **overrides})
        cls = tf.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=6, **{**common, **overrides})
        cls = tf.MixtralForCausalLM
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(num_experts=8, norm_topk_prob=False, clip_qkv=3.0, **{**common, **overrides})
        cls = tf.OlmoeForCausalLM
    else:
        raise ValueError(family)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # transformers initialises norms to 1, which hides norm bugs
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "gate.weight" in name:  # sharper routers so routing differs across tokens
                p.mul_(8)
    return model


def save(model, directory: Path, original_format: bool = True, hub_style: bool = False) -> Path:
    model.save_pretrained(directory, save_original_format=original_format)
    if hub_style:
        to_hub_style(directory / "config.json")
    return directory


def to_hub_style(path: Path) -> None:
    """Rewrite a transformers-5 config.json the way Hub checkpoints written by transformers 4 look."""
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        rope["type"] = rope.pop("rope_type")
        cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    if cfg["model_type"] != "mixtral" and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    path.write_text(json.dumps(cfg, indent=2))


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [T, V]


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()
