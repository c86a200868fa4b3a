"""tools/train_demo_model.py: a tiny CPU run must export a checkpoint that transformers' qwen3_moe reads
and computes exactly like the training model (names, layouts, config and tokenizer all right)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train_demo_model.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tdm():
    return _load_script()


@pytest.fixture(scope="module")
def trained(tdm, tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    res = tdm.main(["--tiny", "--steps", "3", "--device", "cpu", "--max-corpus-mb", "1", "--seed", "0",
                    "--out", str(root / "ckpt"), "--log-out", str(root / "docs" / "training_log.json"),
                    "--plot-out", str(root / "docs" / "loss.png"), "--samples-out", str(root / "docs" / "samples.md")])
    return root, res


def test_files_and_formats(tdm, trained):
    root, res = trained
    ckpt = root / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(tdm.CHECKPOINT_FILES)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert cfg["norm_topk_prob"] is True and cfg["tie_word_embeddings"] is False and cfg["bos_token_id"] is None
    assert cfg["torch_dtype"] == "bfloat16" and cfg["mlp_only_layers"] == [] and cfg["decoder_sparse_step"] == 1

    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in names}
        gate = f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight")
        down = f.get_tensor("model.layers.0.mlp.experts.0.down_proj.weight")
        router = f.get_tensor("model.layers.0.mlp.gate.weight")
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    assert dtypes == {torch.bfloat16}
    assert gate.shape == (I, H) and down.shape == (H, I) and router.shape == (E, H)
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight")}
        expected |= {f"{p}self_attn.{n}_proj.weight" for n in "qkvo"}
        expected |= {f"{p}mlp.experts.{e}.{n}_proj.weight" for e in range(E) for n in ("gate", "up", "down")}
    assert names == expected

    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == tok_cfg["pad_token"] == "<|endoftext|>" and tok_cfg["bos_token"] is None
    assert tok_cfg["add_bos_token"] is False
    gen = json.loads((ckpt / "generation_config.json").read_text())
    tok = res["tokenizer"]
    assert gen["eos_token_id"] == [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]
    assert cfg["eos_token_id"] == tok.token_to_id("<|endoftext|>")

    log = json.loads((root / "docs" / "training_log.json").read_text())
    assert log["steps"] == 3 and log["tokens_seen"] == 3 * 4 * 64 and len(log["curve"]) == 3
    assert log["evals"][-1]["val_loss"] > 0 and len(log["samples"]) >= 3
    assert "def fibonacci(n):" in (root / "docs" / "samples.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:  # optional: the PNG is skipped without it
        assert (root / "docs" / "loss.png").stat().st_size > 1000


def test_chat_template_renders_chatml(trained):
    jinja2 = pytest.importorskip("jinja2")
    root, _ = trained
    tpl = jinja2.Environment().from_string((root / "ckpt" / "chat_template.jinja").read_text())
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert tpl.render(messages=msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tpl.render(messages=msgs, add_generation_prompt=False).endswith("hi<|im_end|>\n")


def test_size_limit(tdm, trained, tmp_path):
    root, _ = trained
    size = tdm.dir_size(root / "ckpt")
    assert 0 < size < 25e6
    tdm.check_size(size, 25.0, "ok")
    with pytest.raises(SystemExit, match="over the"):
        tdm.check_size(size, size / 2e6, "checkpoint")
    # the planned size is checked before any training step runs
    with pytest.raises(SystemExit, match="planned checkpoint"):
        tdm.main(["--tiny", "--steps", "1", "--device", "cpu", "--max-corpus-mb", "0.2", "--max-mb", "0.01",
                  "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


def test_transformers_matches_training_model(tdm, trained):
    transformers = pytest.importorskip("transformers")
    root, res = trained
    ckpt = root / "ckpt"
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager",
                                                           dtype=torch.float32).eval()
    ours = tdm.load_training_model(ckpt)
    tok = res["tokenizer"]
    seqs = [tok.encode("def add(a, b):\n    return a + b\n").ids,
            tok.encode("import os\nprint(os.path.join('a', 'b'))").ids,
            list(range(3, 40, 2)) + [tok.token_to_id("<|im_end|>")]]
    for ids in seqs:
        x = torch.tensor([ids])
        with torch.no_grad():
            want = ours(x)[0].float()
            got = hf(x).logits[0].float()
        assert got.shape == want.shape == (len(ids), hf.config.vocab_size)
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    # the in-memory model differs from the export only by bf16 rounding
    trained_model = res["model"].eval()
    with torch.no_grad():
        diff = (trained_model(torch.tensor([seqs[0]])) - ours(torch.tensor([seqs[0]]))).abs().max()
    assert diff < 0.1


def test_tokenizer_round_trip(trained):
    from tokenizers import Tokenizer

    root, _ = trained
    tok = Tokenizer.from_file(str(root / "ckpt" / "tokenizer.json"))
    src = "class Stack:\n    def push(self, x):\n        self.items.append(x)  # O(1) ✓\n\tpass\n"
    enc = tok.encode(src)
    assert tok.decode(enc.ids) == src
    special = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert special[0] == tok.token_to_id("<|im_start|>") and special[-1] == tok.token_to_id("<|im_end|>")


def test_deterministic_given_seed(tdm):
    """Same seed -> same init and same batches; the MoE forward matches a dense per-token reference."""
    a = tdm.TINY
    m1, m2 = tdm.DemoMoE(a), tdm.DemoMoE(a)
    m1.init_weights(7), m2.init_weights(7)
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    moe = m1.layers[0].mlp
    x = torch.randn(2, 5, a.hidden_size)
    y = moe(x)
    probs = torch.softmax(x.reshape(-1, a.hidden_size) @ moe.gate.weight.T, -1)
    w, ids = probs.topk(a.top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros(10, a.hidden_size)
    for t in range(10):
        for j in range(a.top_k):
            e = ids[t, j]
            g, u = (moe.gate_up[e] @ x.reshape(-1, a.hidden_size)[t]).chunk(2)
            ref[t] += w[t, j] * (moe.down[e] @ (torch.nn.functional.silu(g) * u))
    assert torch.allclose(y.reshape(10, -1), ref, atol=1e-5)
