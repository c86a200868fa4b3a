#!/usr/bin/env python3
"""Train Tidal's built-in demo model: a small qwen3_moe that writes Python, trained on the stdlib.

Self-contained on purpose (pure torch + tokenizers + safetensors; never transformers or tidal), so
the shipped checkpoint is an independent artefact that Tidal's loader and transformers both read.

    python tools/train_demo_model.py                    # GPU: the shipped model (8 epochs, ~3 min on an H200)
    python tools/train_demo_model.py --tiny --steps 3 --device cpu --max-corpus-mb 1   # smoke test

Pipeline: stdlib *.py files (sorted; 1% of files held out) -> byte-level BPE -> qwen3_moe trained
with AdamW (warmup + cosine), residual dropout and a load-balancing loss -> Hugging Face directory in
bf16 with the original per-expert tensor names -> greedy samples from the re-loaded bf16 checkpoint,
a JSON log and a loss plot.

The corpus is small (~10 M tokens with the test suites, ~3 M without), so the run is capped by
--epochs rather than by compute: past ~8 epochs the held-out loss stops improving, and the weights
with the best held-out loss are the ones exported. Distribution Pythons (Debian/Ubuntu) ship the
stdlib test suites separately; point --stdlib-dir at a full copy for the larger corpus.

Bit-reproducible on CPU given --seed and --steps; on CUDA the data order and the initialisation are
fixed, but atomics in kernels (and a --minutes budget, when it binds) make runs differ slightly.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import random
import sysconfig
import textwrap
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:",
                  "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n"
                  "<|im_start|>assistant\n"]
CHECKPOINT_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja", "generation_config.json"]
TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 6144
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    num_experts: int = 16
    top_k: int = 4
    moe_intermediate_size: int = 96
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    dropout: float = 0.0  # residual-branch dropout, training only (not part of the checkpoint)


TINY = ModelArgs(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 num_experts=8, top_k=2, moe_intermediate_size=32)


# ----------------------------------------------------------------------------------------- corpus

def collect_files(root: Path, max_bytes: int, include_tests: bool) -> list[tuple[str, str]]:
    """(relative path, text) of the *.py files under `root` in sorted order until `max_bytes` is reached."""
    paths = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if not include_tests and TEST_DIRS.intersection(parts[:-1]):
            continue
        paths.append(p.relative_to(root).as_posix())
    files, total = [], 0
    for rel in sorted(paths):
        raw = (root / rel).read_bytes()
        if len(raw) > 1 << 20 or total + len(raw) > max_bytes:
            continue  # keep going: smaller later files may still fit
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # a few test files use legacy encodings on purpose
            continue
        if any(t in text for t in SPECIAL_TOKENS):
            continue
        files.append((rel, text))
        total += len(raw)
    if not files:
        raise SystemExit(f"no stdlib sources found under {root}")
    return files


def split_files(files, seed: int, val_fraction: float = 0.01):
    """Hold out `val_fraction` of files (at least one) chosen by a seeded shuffle."""
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(files) * val_fraction))
    val = set(order[:n_val])
    return ([f for i, f in enumerate(files) if i not in val], [f for i, f in enumerate(files) if i in val])


def chat_examples(files, seed: int, max_bytes: int) -> list[str]:
    """ChatML conversations built from documented stdlib functions: the docstring asks, the code answers.

    They teach the chat format (and to stop with <|im_end|>) so `tidal chat` gets a sensible reply."""
    out = []
    for _, text in files:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith(("_", "test")):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno - node.lineno > 40:
                continue
            src = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))  # def line .. end
            if len(src) > 1500:
                continue
            sig = f"{node.name}({ast.unparse(node.args)})"
            out.append((sig, doc.split("\n\n")[0].strip(), src))
    rng = random.Random(seed)
    rng.shuffle(out)
    asks = ["Write a Python function `{sig}`.\n{doc}", "Implement `{sig}` in Python. {doc}",
            "{doc}\nShow me the code for `{sig}`."]
    convs, total = [], 0
    for sig, doc, src in out:
        system = "<|im_start|>system\nYou are a helpful Python assistant.<|im_end|>\n" if rng.random() < 0.3 else ""
        ask = rng.choice(asks).format(sig=sig, doc=doc)
        conv = (f"{system}<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n"
                f"```python\n{src.rstrip()}\n```<|im_end|>\n")
        if total + len(conv) > max_bytes:
            break
        convs.append(conv)
        total += len(conv)
    return convs


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_docs(tok, docs: list[str]) -> torch.Tensor:
    """One flat token stream: every document followed by <|endoftext|>."""
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


# ------------------------------------------------------------------------------------------ model

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()  # normalise in fp32, scale in the input dtype (as qwen3_moe does)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.nh, self.nkv, self.hd = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x, cos, sin):  # x [B, T, H]; cos, sin [T, D]
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)  # [B, nh, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)  # [B, nkv, T, D]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv  # query head h reads kv head h // rep
        q, k = q.to(v.dtype), k.repeat_interleave(rep, dim=1).to(v.dtype)
        o = F.scaled_dot_product_attention(q, k, v.repeat_interleave(rep, dim=1), is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MoE(nn.Module):
    """Router -> softmax (fp32) -> top-k -> renormalise -> SwiGLU experts, tokens sorted by expert.

    Expert weights are stacked: gate_up [E, 2I, H] (gate rows first, then up) and down [E, H, I], the
    per-expert [out, in] layout of the checkpoint. `impl` "grouped" runs all experts in one
    torch._grouped_mm (CUDA, no host sync); "loop" runs one matmul per expert (anywhere)."""

    impl = "loop"

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.E, self.k, self.H, self.I = a.num_experts, a.top_k, a.hidden_size, a.moe_intermediate_size
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(self.E, 2 * self.I, self.H))
        self.down = nn.Parameter(torch.empty(self.E, self.H, self.I))
        self.aux_loss = None  # set in training mode
        self.counts = None  # [E] token-slots per expert in the last forward (statistics)

    def forward(self, x, compute_dtype=None):  # x [B, T, H]
        shape, cd = x.shape, compute_dtype or x.dtype
        x = x.reshape(-1, self.H)  # [N, H]
        N = x.shape[0]
        with torch.autocast(x.device.type, enabled=False):  # routing decisions in fp32
            probs = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)  # [N, E]
        weights, ids = probs.topk(self.k, dim=-1)  # [N, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = ids.reshape(-1)  # [N*k] slot s belongs to token s // k
        counts = torch.zeros(self.E, device=x.device, dtype=torch.float32).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.float32))
        self.counts = counts.detach()
        if self.training:  # Switch-style balance loss: E * sum_e (slot share of e) * (mean prob of e)
            self.aux_loss = self.E * torch.dot(counts / flat.numel(), probs.mean(0))
        order = flat.argsort(stable=True)  # slots grouped by expert
        xs = x[order // self.k].to(cd)  # [N*k, H]
        w1, w2 = self.gate_up.to(cd), self.down.to(cd)
        if self.impl == "grouped":
            offs = counts.cumsum(0).to(torch.int32)
            g, u = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            ys = torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)  # [N*k, H]
        else:
            outs = []
            for e, xe in enumerate(torch.split(xs, counts.long().tolist())):
                if xe.shape[0]:
                    g, u = F.linear(xe, w1[e]).chunk(2, dim=-1)
                    outs.append(F.linear(F.silu(g) * u, w2[e]))
            ys = torch.cat(outs)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = ys[inverse].float().view(N, self.k, self.H)  # back to (token, k) order
        return (y * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype).view(shape)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MoE(a)
        self.drop = nn.Dropout(a.dropout)

    def forward(self, x, cos, sin, compute_dtype):
        x = x + self.drop(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.drop(self.mlp(self.post_attention_layernorm(x), compute_dtype))


class DemoMoE(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float) / a.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.compute_dtype = None  # bf16 when training on CUDA (experts run in it explicitly)

    def init_weights(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        out_std = 0.02 / math.sqrt(2 * self.args.num_layers)  # residual writers start small
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = out_std if name.endswith(("o_proj.weight", "mlp.down")) else 0.02
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, ids):  # ids [B, T] -> logits [B, T, V]
        T = ids.shape[1]
        freqs = torch.arange(T, device=ids.device, dtype=torch.float)[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, self.compute_dtype)
        return self.lm_head(self.norm(x))

    def aux_loss(self):
        return torch.stack([l.mlp.aux_loss for l in self.layers]).mean()


def set_moe_impl(impl: str):
    MoE.impl = impl


def grouped_mm_works(device) -> bool:
    """torch._grouped_mm is private: use it only if it matches the loop (values and grads) here."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = ModelArgs(hidden_size=64, num_experts=8, top_k=2, moe_intermediate_size=32)
        torch.manual_seed(0)
        moe = MoE(a).to(device)
        nn.init.normal_(moe.gate_up, std=0.1), nn.init.normal_(moe.down, std=0.1)
        with torch.no_grad():
            moe.gate.weight.normal_(std=0.5)
            moe.gate.weight[3] = -1.0  # with positive inputs expert 3 gets no tokens: an empty group
        x = torch.randn(2, 37, 64, device=device).abs()
        res = []
        for impl in ("loop", "grouped"):
            moe.impl = impl
            moe.zero_grad()
            y = moe(x, torch.bfloat16)
            y.float().square().sum().backward()
            res.append((y.float(), moe.gate_up.grad.clone(), moe.down.grad.clone(), moe.gate.weight.grad.clone()))
        errs = [((p - q).norm() / q.norm()).item() for p, q in zip(res[1], res[0])]
        if max(errs) > 2e-2:
            print(f"[moe] torch._grouped_mm disagrees with the loop (relative errors {errs}); using the loop")
        return max(errs) <= 2e-2
    except Exception as e:  # noqa: BLE001 - any failure means "do not use it"
        print(f"[moe] torch._grouped_mm unusable ({type(e).__name__}: {e}); using the expert loop")
        return False


# ------------------------------------------------------------------------------------- checkpoint

def hf_config(a: ModelArgs, eos_id: int, max_positions: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "intermediate_size": a.moe_intermediate_size,
        "moe_intermediate_size": a.moe_intermediate_size, "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim,
        "num_experts": a.num_experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": True,
        "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta, "max_position_embeddings": max_positions,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
        "attention_dropout": 0.0, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
        "sliding_window": None, "bos_token_id": None, "eos_token_id": eos_id, "hidden_act": "silu",
        "initializer_range": 0.02, "use_cache": True,
    }


def args_from_hf(cfg: dict) -> ModelArgs:
    return ModelArgs(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                     num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                     num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                     num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                     moe_intermediate_size=cfg["moe_intermediate_size"], rms_norm_eps=cfg["rms_norm_eps"],
                     rope_theta=cfg["rope_theta"])


def to_hf_tensors(model: DemoMoE, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The transformers original-format names (per-expert tensors), nothing else."""
    sd = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd.pop("embed_tokens.weight"), "model.norm.weight": sd.pop("norm.weight"),
           "lm_head.weight": sd.pop("lm_head.weight")}
    I = model.args.moe_intermediate_size
    for i in range(model.args.num_layers):
        p = f"layers.{i}."
        gate_up, down = sd.pop(p + "mlp.gate_up"), sd.pop(p + "mlp.down")
        for e in range(model.args.num_experts):
            q = f"model.{p}mlp.experts.{e}."
            out[q + "gate_proj.weight"] = gate_up[e, :I]
            out[q + "up_proj.weight"] = gate_up[e, I:]
            out[q + "down_proj.weight"] = down[e]
    out.update({"model." + k: v for k, v in sd.items()})  # norms, attention, router: same names
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_tensors(model: DemoMoE, tensors: dict[str, torch.Tensor]) -> DemoMoE:
    t = dict(tensors)
    sd = {"embed_tokens.weight": t.pop("model.embed_tokens.weight"), "norm.weight": t.pop("model.norm.weight"),
          "lm_head.weight": t.pop("lm_head.weight")}
    for i in range(model.args.num_layers):
        q = f"model.layers.{i}.mlp.experts."
        E = range(model.args.num_experts)
        sd[f"layers.{i}.mlp.gate_up"] = torch.stack(
            [torch.cat([t.pop(f"{q}{e}.gate_proj.weight"), t.pop(f"{q}{e}.up_proj.weight")]) for e in E])
        sd[f"layers.{i}.mlp.down"] = torch.stack([t.pop(f"{q}{e}.down_proj.weight") for e in E])
    sd.update({k.removeprefix("model."): t.pop(k) for k in list(t) if k.startswith("model.layers.")})
    if t:
        raise ValueError(f"unused checkpoint tensors: {sorted(t)[:5]}")
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model


def write_checkpoint(out: Path, model: DemoMoE, tok, max_positions: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    save_file(to_hf_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; the file ships as package data
    (out / "config.json").write_text(json.dumps(hf_config(model.args, eot, max_positions), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"), pretty=False)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "model_max_length": max_positions, "add_bos_token": False,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHATML_TEMPLATE + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}, indent=2) + "\n")
    extra = sorted(p.name for p in out.iterdir() if p.name not in CHECKPOINT_FILES)
    if extra:
        print(f"[export] warning: {out} also holds {extra} (shipped with the package; counted in the size)")


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_size(nbytes: int, max_mb: float, what: str) -> None:
    if nbytes > max_mb * 1e6:
        raise SystemExit(f"ERROR: {what} is {nbytes / 1e6:.2f} MB, over the {max_mb} MB limit; "
                         "shrink --vocab-size/--experts/--moe-intermediate/--layers")


def load_training_model(path: Path, device="cpu") -> DemoMoE:
    """Rebuild the training-mode model (float32) from an exported checkpoint directory."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "config.json").read_text())
    model = DemoMoE(args_from_hf(cfg))
    return from_hf_tensors(model, load_file(str(Path(path) / "model.safetensors"))).to(device).eval()


# ---------------------------------------------------------------------------------------- training

def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def windows(stream: torch.Tensor, ctx: int, limit: int) -> torch.Tensor:
    """Up to `limit` non-overlapping (ctx + 1)-token windows from the start of `stream`."""
    n = min(limit, (stream.numel() - 1) // ctx)
    if n == 0:  # tiny corpora: one short window
        return stream[None, :].long()
    return torch.stack([stream[i * ctx: i * ctx + ctx + 1] for i in range(n)]).long()


@torch.no_grad()
def evaluate(model, wins: torch.Tensor, batch: int, device, autocast: bool):
    model.eval()
    tot, n, usage = 0.0, 0, None
    for i in range(0, wins.shape[0], batch):
        w = wins[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(w[:, :-1])
        tot += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        n += w[:, 1:].numel()
        c = torch.stack([l.mlp.counts for l in model.layers])  # [L, E]
        usage = c if usage is None else usage + c
    model.train()
    return tot / n, (usage / usage.sum(-1, keepdim=True)).cpu()


@torch.no_grad()
def greedy(model, tok, prompt: str, n: int, device) -> tuple[list[int], list[int]]:
    stop = {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    ids = tok.encode(prompt, add_special_tokens=False).ids
    out: list[int] = []
    for _ in range(n):
        nxt = int(model(torch.tensor([ids + out], device=device))[0, -1].float().argmax())
        out.append(nxt)
        if nxt in stop:
            break
    return ids, out


def plot_curve(log: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[plot] warning: matplotlib is not installed; skipping the loss-curve PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    c, e = log["curve"], log["evals"]
    ax.plot([r["tokens"] / 1e6 for r in c], [r["loss"] for r in c], lw=1, alpha=0.6,
            label="train batches (running mean, dropout on)")
    ax.plot([r["tokens"] / 1e6 for r in e], [r["train_loss"] for r in e], "s--", ms=2, label="train windows (eval)")
    ax.plot([r["tokens"] / 1e6 for r in e], [r["val_loss"] for r in e], "o-", ms=3, label="validation (held-out files)")
    chosen = next(r for r in e if r["step"] == log["exported_step"])
    ax.axvline(chosen["tokens"] / 1e6, color="gray", lw=0.8, ls=":", label=f"exported (step {chosen['step']})")
    ax.set_xlabel("training tokens (M)"), ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"Tidal demo MoE on the Python stdlib ({log['device']}, {log['train_time_s'] / 60:.1f} min)")
    ax.grid(alpha=0.3), ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(), fig.savefig(path), plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = ModelArgs()
    p.add_argument("--out", type=Path, default=REPO / "tidal" / "demo_model")
    p.add_argument("--log-out", type=Path, default=REPO / "docs" / "demo_model" / "training_log.json")
    p.add_argument("--plot-out", type=Path, default=REPO / "docs" / "demo_model" / "loss_curve.png")
    p.add_argument("--samples-out", type=Path, default=REPO / "docs" / "demo_model" / "samples.md")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="test-sized model and batch")
    p.add_argument("--minutes", type=float, default=12.0, help="training-loop wall-clock budget")
    p.add_argument("--steps", type=int, default=None, help="exact step count (overrides --minutes)")
    p.add_argument("--stdlib-dir", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                   help="corpus root: this interpreter's stdlib, or a copy of another one's *.py files "
                        "(distribution Pythons such as Debian's ship the test suites separately)")
    p.add_argument("--max-corpus-mb", type=float, default=60.0)
    p.add_argument("--no-tests", action="store_true", help="leave the stdlib test suites out of the corpus")
    p.add_argument("--chat-fraction", type=float, default=0.15, help="ChatML examples, as a share of corpus bytes")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--hidden", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--heads", type=int, default=d.num_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--experts", type=int, default=d.num_experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--moe-intermediate", type=int, default=d.moe_intermediate_size)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=2048, help="max_position_embeddings written to config.json")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 64 CUDA, 8 CPU)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.1, help="residual dropout (the corpus is small)")
    p.add_argument("--epochs", type=float, default=8.0,
                   help="cap on passes over the training tokens; the run ends at this or --minutes, first")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--moe-impl", choices=["auto", "grouped", "loop"], default="auto")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward (CUDA)")
    p.add_argument("--sample-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default; --tiny: 1)")
    p.add_argument("--max-mb", type=float, default=25.0, help="hard limit for the checkpoint directory")
    args = p.parse_args(argv)
    if args.tiny:
        t = TINY
        defaults = {"vocab_size": t.vocab_size, "hidden": t.hidden_size, "layers": t.num_layers, "heads": t.num_heads,
                    "kv_heads": t.num_kv_heads, "head_dim": t.head_dim, "experts": t.num_experts, "top_k": t.top_k,
                    "moe_intermediate": t.moe_intermediate_size, "context": 64, "batch_size": 4, "warmup": 2,
                    "eval_windows": 4, "sample_tokens": 8, "log_every": 1, "threads": 1}
        for k, v in defaults.items():  # only where the user kept the full-size default
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    if args.batch_size is None:
        args.batch_size = 64 if args.device.startswith("cuda") else 8
    return args


@dataclass
class Data:
    tok: object
    train_ids: torch.Tensor  # [N] int32 token stream of training files + chat examples
    val_ids: torch.Tensor  # [M] int32 token stream of held-out files
    stats: dict


def prepare_data(args) -> Data:
    files = collect_files(args.stdlib_dir, int(args.max_corpus_mb * 1e6), include_tests=not args.no_tests)
    train_files, val_files = split_files(files, args.seed)
    code_bytes = sum(len(t.encode()) for _, t in train_files)
    chats = chat_examples(train_files, args.seed, int(args.chat_fraction * code_bytes))
    print(f"[corpus] {len(files)} stdlib files ({sum(len(t) for _, t in files) / 1e6:.1f} M chars) from "
          f"{args.stdlib_dir}; {len(val_files)} held out; {len(chats)} chat examples")
    tok = train_tokenizer([t for _, t in train_files], args.vocab_size)
    train_ids = encode_docs(tok, [t for _, t in train_files] + chats)
    val_ids = encode_docs(tok, [t for _, t in val_files])
    code_tokens = sum(len(e.ids) for e in tok.encode_batch([t for _, t in val_files], add_special_tokens=False))
    bpt = sum(len(t.encode()) for _, t in val_files) / max(1, code_tokens)
    stats = {"stdlib": _show_path(args.stdlib_dir), "python": platform.python_version(), "files": len(files),
             "val_files": len(val_files), "train_code_bytes": code_bytes, "chat_examples": len(chats),
             "train_tokens": train_ids.numel(), "val_tokens": val_ids.numel(), "val_bytes_per_token": round(bpt, 3)}
    print(f"[tokens] vocab {tok.get_vocab_size()}; train {train_ids.numel() / 1e6:.2f} M tokens, val "
          f"{val_ids.numel()} tokens; {bpt:.2f} bytes/token on held-out code")
    return Data(tok, train_ids, val_ids, stats)


def train(model: DemoMoE, data: Data, args, device) -> dict:
    """AdamW + warmup + cosine; with --minutes the step count is fixed from the measured step time."""
    cuda = device.type == "cuda"
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            eps=1e-8, **({"fused": True} if cuda else {}))
    fwd = torch.compile(model) if args.compile else model
    B, ctx = args.batch_size, args.context
    n_train = data.train_ids.numel()
    if n_train <= ctx + 1:
        raise SystemExit("corpus too small for one training window")
    train_dev = data.train_ids.to(device)
    gen = torch.Generator().manual_seed(args.seed + 1)  # batch order depends on the seed only
    offsets = torch.arange(ctx + 1, device=device)
    val_wins = windows(data.val_ids, ctx, args.eval_windows)
    train_wins = windows(data.train_ids, ctx, val_wins.shape[0])  # same count: the train/val gap at equal cost

    total = args.steps
    epoch_cap = max(1, math.ceil(args.epochs * n_train / (B * ctx)))  # steps in --epochs passes
    # with --steps the warmup shrinks to fit short runs; with --minutes it outlasts the calibration
    warmup = min(args.warmup, max(1, total // 10)) if total else max(args.warmup, 24)
    calib_end, budget = min(23, warmup - 1), args.minutes * 60
    curve, evals, best = [], [], {"val_loss": float("inf")}
    run_loss, run_aux = torch.zeros((), device=device), torch.zeros((), device=device)
    run_n, step, t0, calib_t = 0, 0, time.time(), time.time()
    limit = f"{total} steps" if total else f"{args.minutes:g} min or {args.epochs:g} epochs ({epoch_cap} steps)"
    print(f"[train] batch {B} x {ctx} tokens, peak lr {args.lr}, warmup {warmup}, dropout {args.dropout}, {limit}")

    def do_eval():
        vl, usage = evaluate(model, val_wins, B, device, cuda)
        tl, _ = evaluate(model, train_wins, B, device, cuda)
        evals.append({"step": step, "tokens": step * B * ctx, "time_s": round(time.time() - t0, 2),
                      "val_loss": vl, "train_loss": tl})
        print(f"[eval] step {step}: val {vl:.4f}  train {tl:.4f}  expert share (all layers) "
              f"min {usage.min():.3f} max {usage.max():.3f} (uniform {1 / usage.shape[1]:.3f})")
        if vl < best["val_loss"]:  # keep the weights with the best held-out loss (early stopping)
            best.update(val_loss=vl, train_loss=tl, step=step, usage=usage,
                        state={k: v.detach().clone() for k, v in model.state_dict().items()})

    while total is None or step < total:
        elapsed = time.time() - t0
        if args.steps is None:
            if step == 3:
                calib_t = time.time()
            elif step == calib_end and total is None:
                per_step = (time.time() - calib_t) / (step - 3)
                fit = max(step + 1, int(step + (budget - elapsed) / per_step * 0.97))
                total = min(fit, epoch_cap)
                print(f"[train] {per_step * 1e3:.0f} ms/step: {fit} steps fit the budget, {epoch_cap} make "
                      f"{args.epochs:g} epochs -> {total} steps (~{total * per_step / 60:.1f} min)")
            if total is None and step >= epoch_cap:
                total = step
                break
            if elapsed > budget * 1.05 and step > 0:
                print(f"[train] over the time budget at step {step}; stopping early")
                break
        lr = lr_at(step, total or 10 ** 9, warmup, args.lr, args.lr * args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_train - ctx - 1, (B,), generator=gen).to(device)
        batch = train_dev[starts[:, None] + offsets].long()  # [B, ctx + 1]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = fwd(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            aux = model.aux_loss()
        (loss + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run_loss += loss.detach()
        run_aux += aux.detach()
        run_n, step = run_n + 1, step + 1
        if step % args.log_every == 0 or step == total:
            row = {"step": step, "tokens": step * B * ctx, "time_s": round(time.time() - t0, 2), "lr": lr,
                   "loss": (run_loss / run_n).item(), "aux": (run_aux / run_n).item()}
            curve.append(row)
            run_loss.zero_(), run_aux.zero_()
            run_n = 0
            print(f"step {step:6d}  loss {row['loss']:.4f}  aux {row['aux']:.3f}  lr {lr:.2e}  "
                  f"{row['time_s']:.0f}s  {row['tokens'] / max(row['time_s'], 1e-9) / 1e3:.0f} k tok/s")
        if step % args.eval_every == 0 or step == total:
            do_eval()
    train_time = time.time() - t0
    if not evals or evals[-1]["step"] != step:
        do_eval()
    if best["step"] != step:
        print(f"[train] exporting the weights of step {best['step']} (best val {best['val_loss']:.4f})")
        model.load_state_dict(best["state"])
    return {"steps": step, "tokens_seen": step * B * ctx, "epochs": round(step * B * ctx / n_train, 2),
            "train_time_s": round(train_time, 1), "tokens_per_s": round(step * B * ctx / train_time),
            "exported_step": best["step"], "final_val_loss": best["val_loss"], "final_train_loss": best["train_loss"],
            "expert_share_val": [[round(x, 4) for x in r] for r in best["usage"].tolist()],
            "curve": curve, "evals": evals}


def _show_path(p: Path) -> str:
    try:
        return p.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(p)


def write_samples(path: Path, samples: list[dict], log: dict) -> None:
    md = [f"# Tidal demo model: greedy samples\n\nGreedy decoding from the exported bf16 checkpoint (fp32 compute) "
          f"after {log['steps']} steps ({log['tokens_seen'] / 1e6:.0f} M tokens, {log['train_time_s'] / 60:.1f} min "
          f"on {log['device']}); validation loss {log['final_val_loss']:.3f} nats/token. Prompt and completion "
          f"token ids are in training_log.json.\n"]
    for s in samples:
        title = "chat" if "<|im_start|>" in s["prompt"] else s["prompt"].splitlines()[0]
        md.append(f"## `{title}`\n\n~~~~\n{s['prompt']}{s['completion']}\n~~~~\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(md))


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args) -> dict:
    t_start = time.time()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    data = prepare_data(args)
    tok = data.tok
    a = ModelArgs(vocab_size=tok.get_vocab_size(), hidden_size=args.hidden, num_layers=args.layers,
                  num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                  num_experts=args.experts, top_k=args.top_k, moe_intermediate_size=args.moe_intermediate,
                  dropout=args.dropout)
    model = DemoMoE(a)
    model.init_weights(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_active = n_params - a.num_layers * (a.num_experts - a.top_k) * 3 * a.hidden_size * a.moe_intermediate_size
    check_size(2 * n_params + len(tok.to_str()) + 20_000, args.max_mb, "the planned checkpoint")  # fail early
    model.to(device)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        model.compute_dtype = torch.bfloat16
    impl = args.moe_impl if args.moe_impl != "auto" else ("grouped" if grouped_mm_works(device) else "loop")
    set_moe_impl(impl)
    print(f"[model] {n_params / 1e6:.2f} M params ({n_active / 1e6:.2f} M active/token), {a}; experts via {impl}; "
          f"prep took {time.time() - t_start:.0f}s")
    result = train(model, data, args, device)

    # export, check, and sample from what was exported (bf16 weights, fp32 compute)
    write_checkpoint(args.out, model, tok, args.max_positions)
    size = dir_size(args.out)
    check_size(size, args.max_mb, f"checkpoint {args.out}")
    shipped = load_training_model(args.out, device)
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids, out = greedy(shipped, tok, prompt, args.sample_tokens, device)
        samples.append({"prompt": prompt, "prompt_ids": ids, "completion_ids": out,
                        "completion": tok.decode(out, skip_special_tokens=False)})
        print(f"\n--- sample: {prompt!r}\n{prompt}{samples[-1]['completion']}")
    log = {
        "model_config": hf_config(a, tok.token_to_id("<|endoftext|>"), args.max_positions),
        "args": {k: _show_path(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "moe_impl": impl, "params": n_params, "active_params_per_token": n_active,
        "checkpoint_bytes": size, "corpus": data.stats, **result,
        "wall_time_s": round(time.time() - t_start, 1), "samples": samples,
    }
    args.log_out.parent.mkdir(parents=True, exist_ok=True)
    args.log_out.write_text(json.dumps(log, indent=1) + "\n")
    plot_curve(log, args.plot_out)
    write_samples(args.samples_out, samples, log)
    print(f"\n[done] {args.out} ({size / 1e6:.2f} MB); val loss {log['final_val_loss']:.4f}; {log['steps']} steps "
          f"in {log['train_time_s']:.0f}s; total {log['wall_time_s']:.0f}s; log {args.log_out}")
    return {"out": args.out, "log": log, "model": model, "tokenizer": tok}


if __name__ == "__main__":
    main()
