"""GGUF loading (tidal/weights/gguf.py) against transformers, on GGUFs written here the way llama.cpp's
convert_hf_to_gguf.py writes them: GGUF tensor names, experts stacked [E, I, H], norms and the router
in F32, and for arch `llama` (Mixtral) q/k rows permuted for llama.cpp's RoPE.

Each type is checked twice: tightly (1e-4, float32 rounding only) against transformers running the
same weights rounded through that GGUF type, which isolates the loader (names, layout, permutation,
dequantisation); and loosely against the unrounded model, which bounds what the type itself costs.
"""
from __future__ import annotations

import copy
import logging

import gguf
import numpy as np
import pytest
import torch

from tests.models.test_parity import PROMPTS, prefill_logits
from tests.models.tiny import FAMILIES, make_reference, reference_greedy, reference_logits
from tidal.engine.engine import Engine
from tidal.errors import CheckpointError
from tidal.types import SamplingParams

G = gguf.GGMLQuantizationType
ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
QTYPES = {"F32": G.F32, "F16": G.F16, "BF16": G.BF16, "Q8_0": G.Q8_0}
# Max |logit difference| against the unrounded float32 model (the tiny models' logits have std ~0.16).
# These bound what the type costs, not the loader (the 1e-4 check against the rounded model does that).
# Per-weight rounding is 2^-11 relative for F16 and 2^-8 for BF16; Q8_0 rounds each block of 32 to
# steps of amax/127, an error up to amax/254 (~1% of a Gaussian block's typical weight, ~4x BF16's).
# With the tiny models' deliberately sharp routers (x8), such errors also flip a few expert choices,
# which moves logits in jumps: worst seen over seeds 0-4 x 3 families was 4e-4 (F16), 0.023 (BF16)
# and 0.035 (Q8_0). The bounds below are ~3-5x those.
LOOSE = {"F32": 1e-4, "F16": 2e-3, "BF16": 0.08, "Q8_0": 0.12}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, as llama.cpp applies it to q_proj/k_proj."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(a: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    """(array, raw_dtype) for GGUFWriter.add_tensor."""
    if qtype == G.F32:
        return a.astype(np.float32), None
    if qtype == G.F16:
        return a.astype(np.float16), None
    return gguf.quants.quantize(a.astype(np.float32), qtype), qtype


def roundtrip(a: np.ndarray, qtype) -> np.ndarray:
    data, raw = encode(a, qtype)
    return gguf.quants.dequantize(data, raw or qtype).astype(np.float32).reshape(a.shape)


def _quantised(name: str, ndim: int) -> bool:
    # llama.cpp keeps 1-D tensors and the router (ffn_gate_inp) in F32 whatever the file type.
    return ndim >= 2 and not name.endswith("mlp.gate.weight")


def gguf_tensors(model, arch: str) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (source HF name, float32 array in GGUF's torch-order layout)."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    out = {"token_embd.weight": ("model.embed_tokens.weight", sd["model.embed_tokens.weight"]),
           "output_norm.weight": ("model.norm.weight", sd["model.norm.weight"]),
           "output.weight": ("lm_head.weight", sd["lm_head.weight"])}
    for layer in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{layer}.", f"blk.{layer}."
        plain = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                 "ffn_gate_inp": "mlp.gate", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
        for g, h in plain.items():
            if p + h + ".weight" in sd:
                out[b + g + ".weight"] = (p + h + ".weight", sd[p + h + ".weight"])
        for g, h, heads in (("attn_q", "q_proj", cfg.num_attention_heads), ("attn_k", "k_proj", cfg.num_key_value_heads)):
            w = sd[p + f"self_attn.{h}.weight"]
            out[b + g + ".weight"] = (p + f"self_attn.{h}.weight", llama_cpp_permute(w, heads) if arch == "llama" else w)
        if p + "mlp.experts.gate_up_proj" in sd:
            gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
            inter = gate_up.shape[1] // 2
            out[b + "ffn_gate_exps.weight"] = (p + "mlp.experts.gate_up_proj", np.ascontiguousarray(gate_up[:, :inter]))
            out[b + "ffn_up_exps.weight"] = (p + "mlp.experts.gate_up_proj", np.ascontiguousarray(gate_up[:, inter:]))
            out[b + "ffn_down_exps.weight"] = (p + "mlp.experts.down_proj", down)
    return out


def write_gguf(model, family: str, path, qtype_name: str = "F32", extra=None):
    """Write `model` as llama.cpp would (metadata keys and tensor layout) with 2-D weights in qtype;
    `extra(writer)` may add more metadata."""
    qtype, arch, cfg = QTYPES[qtype_name], ARCH[family], model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if family == "qwen3_moe":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_expert_count(cfg.num_experts)
    elif family == "mixtral":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_expert_count(cfg.num_local_experts)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_count(cfg.num_experts)
        w.add_clamp_kqv(cfg.clip_qkv)
    if extra is not None:
        extra(w)
    for name, (hf_name, a) in gguf_tensors(model, arch).items():
        data, raw = encode(a, qtype if _quantised(hf_name, a.ndim) else G.F32)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rounded_copy(model, qtype_name: str):
    """`model` with every weight llama.cpp would store in qtype rounded through it."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if _quantised(name, p.dim()):
                p.copy_(torch.from_numpy(roundtrip(p.numpy(), QTYPES[qtype_name])))
    return ref


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_match_transformers(family, qtype, tmp_path):
    model = make_reference(family)
    path = write_gguf(model, family, tmp_path / f"{family}-{qtype}.gguf", qtype)
    engine = Engine(str(path), device="cpu", dtype="float32", progress=False)
    rounded = rounded_copy(model, qtype)
    for ids, got in zip(PROMPTS, prefill_logits(engine, PROMPTS)):
        assert (got - reference_logits(rounded, ids)).abs().max().item() <= 1e-4
        assert (got - reference_logits(model, ids)).abs().max().item() <= LOOSE[qtype]


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_greedy_matches_transformers(family, tmp_path):
    model = make_reference(family, seed=1)
    path = write_gguf(model, family, tmp_path / "m.gguf")
    engine = Engine(str(path), device="cpu", dtype="float32", progress=False, page_size=8)
    results = engine.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    for ids, (req, _) in zip(PROMPTS, results):
        assert req.output_ids == reference_greedy(model, ids, 24)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_config_from_metadata(family, tmp_path):
    model = make_reference(family)
    engine = Engine(str(write_gguf(model, family, tmp_path / "m.gguf")), device="cpu", dtype="float32",
                    progress=False)
    cfg, hf = engine.model_config, model.config
    assert cfg.model_type == family
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == \
        (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.vocab_size)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert cfg.top_k == hf.num_experts_per_tok
    assert cfg.norm_topk_prob == (True if family == "mixtral" else hf.norm_topk_prob)
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"]
    assert cfg.moe_layers == ((0, 2) if family == "qwen3_moe" else (0, 1, 2))  # qwen: mlp_only_layers=[1]
    assert cfg.clip_qkv == (3.0 if family == "olmoe" else None)
    assert cfg.eos_token_ids == (95,) and not cfg.tie_word_embeddings
    assert engine.tokenizer is None  # no tokenizer.json beside the file


def test_mixtral_permutation_matters(tmp_path):
    """The permutation is not the identity for these shapes, and undoing it is what makes Mixtral right."""
    from tidal.weights.gguf import permute_qk, unpermute_qk

    w = torch.randn(64, 64)
    assert not torch.equal(permute_qk(w, 4), w)
    assert torch.equal(permute_qk(w, 4), torch.from_numpy(llama_cpp_permute(w.numpy(), 4)))
    assert torch.equal(unpermute_qk(permute_qk(w, 4), 4), w)
    assert torch.equal(unpermute_qk(permute_qk(w[:32], 2), 2), w[:32])


def test_q8_0_dequantisation_is_gguf_quants_bit_for_bit():
    from tidal.weights.gguf import dequantize_q8_0

    a = (np.random.default_rng(0).standard_normal((48, 256)) * 0.05).astype(np.float32)
    q = gguf.quants.quantize(a, G.Q8_0)
    want = gguf.quants.dequantize(q, G.Q8_0)
    got = dequantize_q8_0(torch.from_numpy(q.copy()).reshape(-1), a.shape)
    assert torch.equal(got, torch.from_numpy(want))


def test_quantised_types_are_dequantised_with_a_log_line(tmp_path, caplog):
    path = write_gguf(make_reference("olmoe"), "olmoe", tmp_path / "m.gguf", "Q8_0")
    with caplog.at_level(logging.WARNING, logger="tidal.weights.gguf"):
        engine = Engine(str(path), device="cpu", progress=False)
    assert engine.loaded.pool.dtype == torch.bfloat16  # quantised files default to bfloat16
    assert any("Q8_0 are dequantised to bfloat16" in r.getMessage() for r in caplog.records)
    assert any("no tokenizer.json beside the GGUF" in r.getMessage() for r in caplog.records)


def test_gguf_to_ftw_loads_the_same_weights(tmp_path):
    from tidal.weights.ftw import convert

    model = make_reference("mixtral")
    path = write_gguf(model, "mixtral", tmp_path / "m.gguf", "Q8_0")
    out = convert(path, tmp_path / "ftw", dtype=torch.float32, progress=False)
    a = Engine(str(path), device="cpu", dtype="float32", progress=False)
    b = Engine(str(out), device="cpu", dtype="float32", progress=False)
    for layer in a.loaded.pool.layers:
        assert torch.equal(a.loaded.pool.gate_up[layer], b.loaded.pool.gate_up[layer])
        assert torch.equal(a.loaded.pool.down[layer], b.loaded.pool.down[layer])
    pa, pb = dict(a.loaded.model.named_parameters()), dict(b.loaded.model.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert b.model_config.model_type == "mixtral"


def test_truncated_gguf_names_the_tensor(tmp_path):
    path = write_gguf(make_reference("qwen3_moe"), "qwen3_moe", tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 5000])
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor '.*' lies outside the file \(truncated"):
        Engine(str(path), device="cpu", progress=False)
    path.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        Engine(str(path), device="cpu", progress=False)


def test_unsupported_gguf_arch(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "dense.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="without experts"):
        Engine(str(tmp_path / "dense.gguf"), device="cpu", progress=False)



def _tokenizer_metadata(tokenizer_json: dict, pre: str):
    """A write_gguf `extra` adding tokenizer.ggml.* as llama.cpp writes a byte-level BPE (gpt2) vocabulary."""
    vocab = tokenizer_json["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tokenizer_json["added_tokens"] if a["special"]}

    def extra(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer_json["model"]["merges"]])
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    return extra


def test_tokenizer_rebuilt_from_gguf_metadata(tmp_path, monkeypatch, caplog):
    """No tokenizer.json beside the GGUF: Tidal rebuilds the byte-level BPE from tokenizer.ggml.* and
    it tokenizes exactly as the original tokenizer.json (here the demo model's, GPT-2 style)."""
    import json

    from tidal.tokenizer.tokenizer import Tokenizer
    from tidal.weights.demo import demo_model_path

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    demo = demo_model_path()
    original = Tokenizer.from_dir(demo)
    extra = _tokenizer_metadata(json.loads((demo / "tokenizer.json").read_text()), "gpt-2")
    path = write_gguf(make_reference("olmoe"), "olmoe", tmp_path / "m.gguf", extra=extra)
    with caplog.at_level(logging.INFO, logger="tidal.weights.gguf"):
        engine = Engine(str(path), device="cpu", dtype="float32", progress=False)
    assert any("built a tokenizer from the GGUF metadata" in r.getMessage() for r in caplog.records)
    built = engine.tokenizer
    assert built is not None and engine.loaded.model_dir.is_relative_to(tmp_path / "cache")
    texts = ["Hello, world!", "def f(x):\n    return x  # ok\n\n", "  leading spaces and 12345 numbers",
             "<|im_start|>user\nhi<|im_end|>", "ünïcödé — and emoji 🎉"]
    for text in texts:
        assert built.encode(text) == original.encode(text), text
        ids = original.encode(text)
        assert built.decode(ids) == original.decode(ids)
    assert built.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>hi<|im_end|>"
    assert 95 in engine.eos_token_ids  # the GGUF's tokenizer.ggml.eos_token_id
    caplog.clear()
    Engine(str(path), device="cpu", dtype="float32", progress=False)  # second load: from the cache
    assert not any("built a tokenizer" in r.getMessage() for r in caplog.records)
