"""GGUF checkpoints (llama.cpp's format), loaded directly or converted to FTW.

Supported: GGUF arch `qwen3moe` (-> qwen3_moe), `olmoe` (-> olmoe) and `llama` with expert tensors
(llama.cpp writes Mixtral that way; -> mixtral); split files (`*-00001-of-00003.gguf`); tensor types
F32, F16 and BF16 (read as they are) and every type `gguf.quants` can dequantise (Q8_0 and the
k-quants), which Tidal has no kernels for: those are dequantised to the model dtype at load, with a
warning, so they take 2 (or 4) bytes per weight in host memory.

Mapping (GGUF -> the canonical names `MoEDecoder.load_weights` takes):
    token_embd.weight            model.embed_tokens.weight
    output_norm.weight           model.norm.weight
    output.weight                lm_head.weight (absent: tied embeddings)
    blk.N.attn_norm / ffn_norm   model.layers.N.input_layernorm / post_attention_layernorm
    blk.N.attn_{q,k,v,output}    model.layers.N.self_attn.{q,k,v,o}_proj
    blk.N.attn_{q,k}_norm        model.layers.N.self_attn.{q,k}_norm
    blk.N.ffn_gate_inp           model.layers.N.mlp.gate (the router)
    blk.N.ffn_{gate,up}_exps     [E, I, H] -> experts' gate_proj / up_proj (one expert at a time)
    blk.N.ffn_down_exps          [E, H, I] -> experts' down_proj
    blk.N.ffn_{gate,up,down}.X   old per-expert Mixtral files: expert X
    blk.N.ffn_{gate,up,down}     dense MLP layers (a layer without ffn_gate_inp)
GGUF lists dimensions fastest-first (ne[0] = row length); `shape` here is torch order (reversed).

llama.cpp's convert_hf_to_gguf.py permutes the rows of q_proj and k_proj for arch `llama` (its RoPE
rotates adjacent pairs, Hugging Face's rotates halves): per head, rows (2, D/2) become (D/2, 2).
`unpermute_qk` undoes it. qwen3moe and olmoe use llama.cpp's NeoX RoPE and are stored unpermuted.

Reads go through os.pread at the offsets GGUFReader reports, not through its memory map, so a
conversion's resident memory stays one expert (or one row block) at a time.

Tokenizer: a tokenizer.json beside the .gguf is used as is. Without one, byte-level BPE vocabularies
(tokenizer.ggml.model 'gpt2' with pre-tokenizer 'qwen2', 'gpt-2' or 'olmo': Qwen3, OLMoE) are rebuilt
from tokenizer.ggml.tokens/merges/token_type into $TIDAL_CACHE/gguf-tokenizers/ with the chat
template and bos/eos from the metadata. Anything else (Mixtral's SentencePiece 'llama' vocabulary)
gets a warning: the model then takes token-id prompts only.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from tidal.errors import CheckpointError

log = logging.getLogger(__name__)

_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "olmoe": "olmoe", "llama": "mixtral"}
# Router normalisation llama.cpp hard-codes per arch when the file has no expert_weights_norm key.
_NORM_TOPK = {"qwen3_moe": True, "olmoe": False, "mixtral": True}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_STACKED = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down"}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")
_OLD_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")
_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")
_ROW_BLOCK_BYTES = 64 << 20     # dense tensors are dequantised this many source bytes at a time
# tokenizer.ggml.pre -> (split regex, NFC), as the Hugging Face tokenizer.json of that family has them;
# None: ByteLevel's own (GPT-2) regex.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = {"qwen2": (_QWEN2_SPLIT, True), "gpt-2": (None, False), "olmo": (None, True)}  # olmo: GPT-NeoX-derived


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's LlamaModel.permute on a q/k weight [n_head*D, H] (or bias [n_head*D])."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise CheckpointError(f"cannot un-permute a q/k tensor of {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's permutation itself (tests write Mixtral GGUFs the way llama.cpp does)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_q8_0(raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Q8_0 blocks (an fp16 scale + 32 int8) -> float32 `shape`; the same numbers as
    gguf.quants.dequantize (the tests check it bit for bit), several times faster."""
    blocks = raw.view(-1, 34)                                     # [n_blocks, 34] bytes
    scale = blocks[:, :2].contiguous().view(torch.float16).float()   # [n_blocks, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8).float()          # [n_blocks, 32]
    return (q * scale).reshape(shape)


class _Tensor:
    """Where one GGUF tensor lives and how to read it."""

    __slots__ = ("name", "file", "fd", "qtype", "shape", "offset", "nbytes")

    def __init__(self, name: str, file: Path, fd: int, qtype, shape: tuple[int, ...], offset: int, nbytes: int):
        self.name, self.file, self.fd, self.qtype = name, file, fd, qtype
        self.shape, self.offset, self.nbytes = shape, offset, nbytes


class GGUFCheckpoint:
    """A GGUF model (one file or a split set), its config as a config.json dict, and its tensors
    under canonical names. Usable as an FTW conversion source (see ftw.convert)."""

    origin = "gguf"

    def __init__(self, path: str | os.PathLike):
        import gguf

        self._gguf = gguf
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: GGUF file not found")
        self.files = _split_files(self.path)
        self._fds: list[int] = []
        self.tensors: dict[str, _Tensor] = {}
        self._fields: dict[str, Any] = {}
        for file in self.files:
            try:
                reader = _reader_class()(file, "r")
            except CheckpointError:
                raise
            except Exception as e:  # GGUFReader raises ValueError/IndexError/... on bad bytes
                raise CheckpointError(f"{file}: not a readable GGUF file ({type(e).__name__}: {e}); "
                                      "truncated or corrupted download?") from None
            if not self._fields:
                self._fields = dict(reader.fields)
            size = file.stat().st_size
            fd = os.open(file, os.O_RDONLY)
            self._fds.append(fd)
            for t in reader.tensors:
                if t.data_offset + t.n_bytes > size:
                    raise CheckpointError(f"{file}: tensor {t.name!r} lies outside the file (truncated file?)")
                if t.name in self.tensors:
                    raise CheckpointError(f"{file}: tensor {t.name!r} also appears in {self.tensors[t.name].file}")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self.tensors[t.name] = _Tensor(t.name, file, fd, t.tensor_type, shape, int(t.data_offset),
                                               int(t.n_bytes))
            # tensor bytes are read through the fds (os.pread), never through the reader's memory map
        self.arch = str(self._meta("general.architecture"))
        self._map_names()
        self.config = self._build_config()
        self.generation_config = {k: self.config[k] for k in ("bos_token_id", "eos_token_id")
                                  if self.config.get(k) is not None}
        self._warned: set[str] = set()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- metadata ------------------------------------------------------------------------------------
    _MISSING = object()

    def _meta(self, key: str, default: Any = _MISSING) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is self._MISSING:
                raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        return value

    def _arch_meta(self, key: str, default: Any = _MISSING) -> Any:
        value = self._meta(f"{self.arch}.{key}", default)
        if isinstance(value, list) and value and not isinstance(value[0], str):
            if len(set(value)) != 1:  # per-layer values: Tidal's families use one value for all layers
                raise CheckpointError(f"{self.path}: {self.arch}.{key} varies per layer ({value}); not supported")
            value = value[0]
        return value

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    def _map_names(self) -> None:
        """GGUF tensor -> canonical dense name, or expert source; unknown tensors fail by name."""
        self.dense: dict[str, _Tensor] = {}
        self._stacked: dict[tuple[int, str], _Tensor] = {}
        self._single: dict[tuple[int, int, str], _Tensor] = {}
        self._layers_with_router: set[int] = set()
        for name, t in self.tensors.items():
            if name in _GLOBAL:
                self.dense[_GLOBAL[name]] = t
                continue
            m = _BLK.fullmatch(name)
            if m is None:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not understood by Tidal's GGUF loader "
                                      f"(arch {self.arch})")
            layer, rest = int(m[1]), m[2]
            if rest in _STACKED:
                self._stacked[(layer, _STACKED[rest])] = t
            elif em := _OLD_EXPERT.fullmatch(rest):
                self._single[(layer, int(em[2]), em[1])] = t
            elif rest in _BLOCK:
                self.dense[f"model.layers.{layer}.{_BLOCK[rest]}"] = t
                if rest == "ffn_gate_inp.weight":
                    self._layers_with_router.add(layer)
            else:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not understood by Tidal's GGUF loader "
                                      f"(arch {self.arch})")

    def _build_config(self) -> dict:
        """A Hugging Face style config.json dict from GGUF metadata (cross-checked with tensor shapes)."""
        if self.arch not in _MODEL_TYPES:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; Tidal loads "
                                  f"GGUF files of arch {', '.join(sorted(_MODEL_TYPES))} (llama: Mixtral only)")
        num_experts = int(self._arch_meta("expert_count", 0))
        if num_experts <= 0:
            raise CheckpointError(f"{self.path}: arch {self.arch!r} without experts (a dense model); "
                                  "Tidal serves MoE models only")
        model_type = _MODEL_TYPES[self.arch]
        layers = int(self._arch_meta("block_count"))
        hidden = int(self._arch_meta("embedding_length"))
        heads = int(self._arch_meta("attention.head_count"))
        kv_heads = int(self._arch_meta("attention.head_count_kv", heads))
        head_dim = int(self._arch_meta("attention.key_length", 0) or self._arch_meta("rope.dimension_count", 0)
                       or hidden // heads)
        ffn = self._arch_meta("feed_forward_length", None)
        moe_ffn = self._arch_meta("expert_feed_forward_length", None) or ffn
        probe = self._stacked.get((min(self._layers_with_router, default=0), "gate"))
        if probe is not None:  # the tensors are the ground truth for the expert size
            moe_ffn = probe.shape[1]
        if moe_ffn is None:
            raise CheckpointError(f"{self.path}: cannot tell the expert size ({self.arch}.expert_feed_forward_length "
                                  "is missing)")
        embd = self.dense.get("model.embed_tokens.weight")
        if embd is None:
            raise CheckpointError(f"{self.path}: tensor 'token_embd.weight' is missing")
        vocab = int(self._arch_meta("vocab_size", 0) or embd.shape[0])
        moe_layers = sorted(self._layers_with_router)
        cfg: dict[str, Any] = {
            "model_type": model_type,
            "architectures": [{"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                               "mixtral": "MixtralForCausalLM"}[model_type]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(self._arch_meta("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_meta("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_meta("context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in self.dense,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self.dense,
            "num_experts_per_tok": int(self._arch_meta("expert_used_count")),
            "intermediate_size": int(ffn or moe_ffn),
            "moe_intermediate_size": int(moe_ffn),
            "norm_topk_prob": bool(self._arch_meta("expert_weights_norm", _NORM_TOPK[model_type])),
            "mlp_only_layers": [i for i in range(layers) if i not in self._layers_with_router],
            "hidden_act": "silu",
            "torch_dtype": self._natural_dtype(),
        }
        cfg["num_local_experts" if model_type == "mixtral" else "num_experts"] = num_experts
        if model_type == "mixtral":
            cfg["intermediate_size"] = int(moe_ffn)
        if not moe_layers:
            raise CheckpointError(f"{self.path}: no layer has a router tensor (ffn_gate_inp)")
        clamp = self._arch_meta("attention.clamp_kqv", None)
        if clamp:
            cfg["clip_qkv"] = float(clamp)
        window = self._arch_meta("attention.sliding_window", None)
        if window:
            cfg["sliding_window"] = int(window)
        scaling = self._arch_meta("rope.scaling.type", None)
        if scaling and scaling != "none":
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(self._arch_meta("rope.scaling.factor", 1.0))}
            orig = self._arch_meta("rope.scaling.original_context_length", None)
            if orig:
                cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
        for key, gkey in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            value = self._meta(gkey, None)
            if value is not None:
                cfg[key] = int(value)
        return cfg

    def _natural_dtype(self) -> str:
        """The dtype the weights are stored in; quantised files load as bfloat16 unless asked otherwise."""
        G = self._gguf.GGMLQuantizationType
        types = {t.qtype for t in self.tensors.values() if len(t.shape) >= 2}
        if types <= {G.F32}:
            return "float32"
        if types <= {G.F32, G.F16}:
            return "float16"
        if types <= {G.F32, G.BF16}:
            return "bfloat16"
        return "bfloat16"

    # -- reading -------------------------------------------------------------------------------------
    def _torch_dtype(self, qtype) -> Optional[torch.dtype]:
        G = self._gguf.GGMLQuantizationType
        return {G.F32: torch.float32, G.F16: torch.float16, G.BF16: torch.bfloat16}.get(qtype)

    def _note_dequant(self, t: _Tensor, dtype: torch.dtype) -> None:
        name = t.qtype.name
        if name not in self._warned:
            self._warned.add(name)
            log.warning("%s: tensors of type %s are dequantised to %s at load (Tidal has no %s kernel): "
                        "they take %d bytes per weight in memory", self.path.name, name,
                        str(dtype).removeprefix("torch."), name, torch.tensor([], dtype=dtype).element_size())

    def _read_rows(self, t: _Tensor, first: int, count: int, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
        """Rows [first, first+count) along dim 0 of `t`, as a tensor [count, *t.shape[1:]]: in the
        file's dtype for float types (cast to out_dtype if given), dequantised otherwise."""
        from tidal.weights.ftw import bytes_view, pread_into

        if first == 0 and count == t.shape[0]:
            offset, nbytes = t.offset, t.nbytes
        else:  # experts and row blocks are whole rows, so whole quantisation blocks
            row_bytes = t.nbytes // t.shape[0]
            offset, nbytes = t.offset + first * row_bytes, count * row_bytes
        shape = (count, *t.shape[1:])
        what = f"{t.file}: tensor {t.name!r}"
        native = self._torch_dtype(t.qtype)
        if native is not None:
            out = torch.empty(shape, dtype=native)
            pread_into(t.fd, bytes_view(out), offset, what)
            return out if out_dtype is None else out.to(out_dtype)
        raw = torch.empty(nbytes, dtype=torch.uint8)
        pread_into(t.fd, bytes_view(raw), offset, what)
        self._note_dequant(t, out_dtype or torch.float32)
        if t.qtype == self._gguf.GGMLQuantizationType.Q8_0:
            out = dequantize_q8_0(raw, shape)
        else:
            try:
                byte_shape = self._gguf.quants.quant_shape_to_byte_shape(shape, t.qtype)
                out = torch.from_numpy(self._gguf.quants.dequantize(raw.numpy().reshape(byte_shape), t.qtype))
            except (NotImplementedError, ValueError) as e:
                raise CheckpointError(f"{what}: cannot dequantise GGUF type {t.qtype.name} ({e})") from None
            out = out.reshape(shape)
        return out if out_dtype is None else out.to(out_dtype)

    def _permuted_heads(self, canon: str) -> Optional[int]:
        """The head count llama.cpp permuted `canon`'s rows over (arch llama q/k), else None."""
        if self.arch != "llama":
            return None
        if canon.endswith(("q_proj.weight", "q_proj.bias")):
            return self.config["num_attention_heads"]
        if canon.endswith(("k_proj.weight", "k_proj.bias")):
            return self.config["num_key_value_heads"]
        return None

    def _fix(self, canon: str, w: torch.Tensor) -> torch.Tensor:
        heads = self._permuted_heads(canon)
        return w if heads is None else unpermute_qk(w, heads)

    def dense_names(self) -> list[str]:
        return list(self.dense)

    def dense_dtype(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.dtype:
        native = self._torch_dtype(self.dense[name].qtype)
        return dtype or native or _dtype(self.config["torch_dtype"])

    def dense_shape(self, name: str) -> tuple[int, ...]:
        return self.dense[name].shape

    def read_dense(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """One whole dense tensor under its canonical name, in `dtype` (default: its natural dtype),
        dequantised a row block at a time so a big quantised embedding never exists in float32."""
        t = self.dense[name]
        dtype = self.dense_dtype(name, dtype)
        if len(t.shape) < 2 or t.nbytes <= _ROW_BLOCK_BYTES:
            return self._fix(name, self._read_rows(t, 0, t.shape[0], dtype))
        out = torch.empty(t.shape, dtype=dtype)
        step = max(1, _ROW_BLOCK_BYTES // (t.nbytes // t.shape[0]))
        for a in range(0, t.shape[0], step):
            n = min(step, t.shape[0] - a)
            out[a:a + n] = self._read_rows(t, a, n, dtype)
        return self._fix(name, out)

    def dense_pieces(self, name: str, dtype: Optional[torch.dtype] = None) -> Iterator[torch.Tensor]:
        """The tensor as consecutive flat pieces (row blocks where no q/k un-permutation is needed)."""
        t = self.dense[name]
        if len(t.shape) < 2 or t.nbytes <= _ROW_BLOCK_BYTES or self._permuted_heads(name):
            yield self.read_dense(name, dtype).reshape(-1)
            return
        dtype = self.dense_dtype(name, dtype)
        step = max(1, _ROW_BLOCK_BYTES // (t.nbytes // t.shape[0]))
        for a in range(0, t.shape[0], step):
            yield self._read_rows(t, a, min(step, t.shape[0] - a), dtype).reshape(-1)

    def expert_layers(self) -> list[int]:
        return sorted(self._layers_with_router)

    def expert_dtype(self, layer: int, dtype: Optional[torch.dtype] = None) -> torch.dtype:
        t = self._stacked.get((layer, "gate")) or self._single.get((layer, 0, "gate"))
        if t is None:
            raise CheckpointError(f"{self.path}: layer {layer} has a router but no expert tensors "
                                  f"(blk.{layer}.ffn_gate_exps.weight)")
        return dtype or self._torch_dtype(t.qtype) or _dtype(self.config["torch_dtype"])

    def read_expert(self, layer: int, expert: int, role: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Expert `expert` of `layer`: gate/up [I, H] or down [H, I], in `dtype` (default: natural)."""
        out_dtype = self.expert_dtype(layer, dtype)
        t = self._stacked.get((layer, role))
        if t is not None:
            if expert >= t.shape[0]:
                raise CheckpointError(f"{t.file}: tensor {t.name!r} has {t.shape[0]} experts, expected "
                                      f"more than {expert}")
            return self._read_rows(t, expert, 1, out_dtype)[0]
        t = self._single.get((layer, expert, role))
        if t is None:
            raise CheckpointError(f"{self.path}: missing tensor blk.{layer}.ffn_{role}_exps.weight "
                                  f"(expert {expert} {role}_proj)")
        return self._read_rows(t, 0, t.shape[0], out_dtype)

    @property
    def num_tensors(self) -> int:
        E = self.config.get("num_experts") or self.config.get("num_local_experts")
        return len(self.dense) + 3 * E * len(self._layers_with_router)

    def iter_tensors(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(canonical name, tensor) for MoEDecoder.load_weights: dense tensors whole, experts one by one."""
        E = self.config.get("num_experts") or self.config.get("num_local_experts")
        for name in self.dense:
            yield name, self.read_dense(name, dtype)
        for layer in self.expert_layers():
            for e in range(E):
                for role in ("gate", "up", "down"):
                    yield f"model.layers.{layer}.mlp.experts.{e}.{role}_proj.weight", \
                        self.read_expert(layer, e, role, dtype)

    # -- side files ----------------------------------------------------------------------------------
    def side_files(self) -> list[Path]:
        """Tokenizer files to copy into an FTW conversion: those beside the GGUF, else the ones rebuilt
        from its metadata (see tokenizer_dir)."""
        from tidal.weights.ftw import TOKENIZER_FILES

        d = self.tokenizer_dir()
        if not (d / "tokenizer.json").is_file():
            return []
        return [d / f for f in TOKENIZER_FILES if (d / f).is_file()]

    def tokenizer_dir(self) -> Path:
        """The directory whose tokenizer.json the engine loads: the GGUF's own directory when it holds
        one, else a tokenizer built from the GGUF's byte-level BPE metadata (cached under
        $TIDAL_CACHE/gguf-tokenizers), else the GGUF's directory (no tokenizer: token-id prompts only)."""
        if (self.path.parent / "tokenizer.json").is_file():
            return self.path.parent
        built = self.build_tokenizer()
        if built is not None:
            return built
        return self.path.parent

    def build_tokenizer(self) -> Optional[Path]:
        """Write tokenizer.json + tokenizer_config.json rebuilt from `tokenizer.ggml.*` for byte-level
        BPE vocabularies (tokenizer.ggml.model 'gpt2' with a pre-tokenizer Tidal knows); None otherwise."""
        import hashlib
        import json

        kind, pre = self._meta("tokenizer.ggml.model", None), self._meta("tokenizer.ggml.pre", "default")
        if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
            what = "no tokenizer metadata" if kind is None else f"tokenizer.ggml.model {kind!r}, pre {pre!r}"
            log.warning("%s: no tokenizer.json beside the GGUF file and Tidal cannot rebuild this one from the GGUF "
                        "(%s; it rebuilds byte-level BPE vocabularies of pre-tokenizer %s), so it cannot tokenize "
                        "text for this model (prompts of token ids still work); put the original model's "
                        "tokenizer.json (and tokenizer_config.json) next to the .gguf to enable text",
                        self.path, what, ", ".join(sorted(_PRE_TOKENIZERS)))
            return None
        st = self.path.stat()
        key = hashlib.sha1(f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cache = Path(os.environ.get("TIDAL_CACHE", Path.home() / ".cache" / "tidal")) / "gguf-tokenizers" / key
        if (cache / "tokenizer.json").is_file():
            return cache
        tokenizer, config = self._bpe_tokenizer(pre)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        try:
            os.replace(tmp, cache)
        except OSError:  # another process built it first
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("%s: built a tokenizer from the GGUF metadata (byte-level BPE, pre-tokenizer %r) in %s",
                 self.path.name, pre, cache)
        return cache

    def _bpe_tokenizer(self, pre: str):
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

        tokens = self._meta("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self._meta("tokenizer.ggml.merges", [])]
        types = self._meta("tokenizer.ggml.token_type", None) or [1] * len(tokens)
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
        regex, nfc = _PRE_TOKENIZERS[pre]
        if regex is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if nfc:
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
        # llama.cpp token types: 3 control (special), 4 user-defined (added, not special)
        tok.add_tokens([AddedToken(t, special=ty == 3, normalized=False)
                        for t, ty in zip(tokens, types) if ty in (3, 4)])
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        for name, key in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                          ("pad_token", "tokenizer.ggml.padding_token_id"), ("unk_token", "tokenizer.ggml.unknown_token_id")):
            i = self._meta(key, None)
            if i is not None and 0 <= int(i) < len(tokens):
                config[name] = tokens[int(i)]
        add_bos = bool(self._meta("tokenizer.ggml.add_bos_token", False)) and "bos_token" in config
        config["add_bos_token"] = add_bos
        if add_bos:
            bos = (config["bos_token"], tokens.index(config["bos_token"]))
            tok.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B",
                                                               special_tokens=[bos])
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        template = self._meta("tokenizer.chat_template", None)
        if template:
            config["chat_template"] = template
        return tok, config

    def model_config(self):
        from tidal.config import ModelConfig

        return ModelConfig.from_hf(self.config, source=str(self.path))


def _reader_class():
    """GGUFReader that checks each tensor lies inside the file before mapping it, so a truncated
    file fails naming the first tensor it cuts (plain GGUFReader fails with a numpy reshape error)."""
    import gguf

    class _Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                try:
                    _, name_data, _, dims, raw_dtype, offset = field.parts
                    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                    n_bytes = int(np.prod(dims)) * type_size // block
                    end = int(start_offs + offset[0]) + n_bytes
                    name = bytes(name_data).decode("utf-8", "replace")
                except Exception:  # a layout this check does not know: leave it to GGUFReader
                    continue
                if end > size:
                    raise CheckpointError(f"{self.path}: tensor {name!r} lies outside the file (truncated file?)")
            return super()._build_tensors(start_offs, fields)

        def __init__(self, path, mode="r"):
            self.path = path
            super().__init__(path, mode)

    return _Reader


def _dtype(name: str) -> torch.dtype:
    from tidal.config import parse_dtype

    return parse_dtype(name) or torch.bfloat16


def _split_files(path: Path) -> list[Path]:
    """All parts of a llama.cpp split GGUF (`name-00001-of-00003.gguf`), or just `path`."""
    m = _SPLIT.fullmatch(path.name)
    if m is None:
        return [path]
    count = int(m[3])
    files = [path.with_name(f"{m[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{missing[0]}: part of the split GGUF {path.name} is missing")
    return files
