"""The built-in demo model: the default `--model` of every command.

The trained demo checkpoint ships inside the package (tidal/demo_model/, made by
tools/train_demo_model.py: a small qwen3_moe trained on Python's standard library). If a build
leaves it out, a tiny qwen3_moe with deterministic random weights and a byte-level tokenizer is
generated into the user's cache instead, so every command still works offline; tests also use that
recipe to make small complete checkpoints.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

PACKAGED = Path(__file__).resolve().parent.parent / "demo_model"
_FORMAT_VERSION = 1

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def demo_model_path() -> Path:
    if (PACKAGED / "config.json").exists():
        return PACKAGED
    cache = Path(os.environ.get("TIDAL_CACHE", Path.home() / ".cache" / "tidal"))
    target = cache / f"demo-random-v{_FORMAT_VERSION}"
    if not (target / "model.safetensors").exists():
        write_random_demo_model(target)
    return target


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def write_random_demo_model(target: Path, seed: int = 0) -> Path:
    """Write a deterministic tiny qwen3_moe checkpoint (random weights) to `target` atomically."""
    from safetensors.torch import save_file

    tok = _byte_level_tokenizer()
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32",
        "eos_token_id": eos, "bos_token_id": None,
    }
    g = torch.Generator().manual_seed(seed)
    H, I, E, L, D = 64, 32, 8, 2, 16

    def rnd(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    tensors = {"model.embed_tokens.weight": rnd(vocab, H, scale=0.5), "model.norm.weight": 1 + rnd(H),
               "lm_head.weight": rnd(vocab, H, scale=0.3)}
    for l in range(L):
        p = f"model.layers.{l}."
        tensors |= {p + "input_layernorm.weight": 1 + rnd(H), p + "post_attention_layernorm.weight": 1 + rnd(H),
                    p + "self_attn.q_proj.weight": rnd(4 * D, H), p + "self_attn.k_proj.weight": rnd(2 * D, H),
                    p + "self_attn.v_proj.weight": rnd(2 * D, H), p + "self_attn.o_proj.weight": rnd(H, 4 * D),
                    p + "self_attn.q_norm.weight": 1 + rnd(D), p + "self_attn.k_norm.weight": 1 + rnd(D),
                    p + "mlp.gate.weight": rnd(E, H, scale=0.5)}
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            tensors |= {q + "gate_proj.weight": rnd(I, H), q + "up_proj.weight": rnd(I, H),
                        q + "down_proj.weight": rnd(H, I)}
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHATML_TEMPLATE, "model_max_length": 4096}, indent=2))
    if target.exists():
        import shutil
        shutil.rmtree(target)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    print(demo_model_path())
