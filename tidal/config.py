"""Frozen configuration dataclasses.

`ModelConfig.from_hf` normalises the two config.json styles found in the wild into one shape:
- Hub style (transformers 4): top-level `rope_theta`, `rope_scaling`, `torch_dtype`, `num_experts`;
- transformers-5 style: `rope_parameters`, `dtype`, `num_local_experts`.
Every field a model file reads comes from here, so a missing or contradictory field fails once, at
load, naming the field and the file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from tidal.errors import CheckpointError, ConfigError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None, what: str = "dtype") -> Optional[torch.dtype]:
    """'bfloat16' | 'torch.bfloat16' | torch.bfloat16 -> torch.bfloat16; None/'auto' -> None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key == "auto":
        return None
    if key not in _DTYPES:
        raise ConfigError(f"unknown {what} {name!r}: use float32, bfloat16, float16 or auto")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters in transformers-5 terms (`rope_parameters`)."""

    rope_type: str = "default"      # default | linear | dynamic | yarn | llama3
    theta: float = 10000.0
    params: tuple = ()              # remaining keys (factor, original_max_position_embeddings, ...) as items

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of one MoE decoder, normalised across config styles."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int       # per routed expert
    intermediate_size: int           # dense MLP layers (when some layers are dense)
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]      # indices of layers whose MLP is a routed MoE
    hidden_act: str = "silu"
    clip_qkv: Optional[float] = None
    sliding_window: Optional[int] = None
    dtype: torch.dtype = torch.bfloat16   # the checkpoint's dtype
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid families (Qwen3-Next): per-layer token mixer, "full_attention" or "linear_attention"
    # (gated DeltaNet). Empty means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    shared_expert_intermediate_size: int = 0   # 0: no shared expert next to the routed ones
    raw: dict = field(default_factory=dict, compare=False, repr=False)  # the config.json as read

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate, up, down) in the checkpoint dtype."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 3 * self.hidden_size * self.moe_intermediate_size * elem

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear_attention(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_linear_attention(i))

    @property
    def has_recurrent_layers(self) -> bool:
        """Layers whose per-sequence state is a recurrent state (not reconstructible from KV pages)."""
        return bool(self.linear_attention_layers)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: config.json not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def need(*keys: str) -> Any:
            for k in keys:
                if raw.get(k) is not None:
                    return raw[k]
            raise CheckpointError(f"{source}: missing field {' / '.join(repr(k) for k in keys)}")

        model_type = raw.get("model_type")
        if model_type is None:
            raise CheckpointError(f"{source}: missing field 'model_type'")
        if isinstance(raw.get("text_config"), dict):
            # A vision-language checkpoint (Qwen3.5-MoE): serve its text model. Fields of the text
            # config win, except the composite's model_type and tie_word_embeddings.
            outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
            raw = {**outer, **raw["text_config"], "model_type": model_type}
            if "tie_word_embeddings" in outer:
                raw["tie_word_embeddings"] = outer["tie_word_embeddings"]
        from tidal.models.registry import supported_model_types

        if model_type not in supported_model_types():
            raise CheckpointError(
                f"{source}: unsupported model_type {model_type!r}; Tidal supports "
                + ", ".join(sorted(supported_model_types()))
            )

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        head_dim = raw.get("head_dim") or hidden // heads
        num_experts = int(need("num_experts", "num_local_experts"))
        moe_inter = int(raw.get("moe_intermediate_size") or need("intermediate_size"))
        sparse_step = int(raw.get("decoder_sparse_step") or 1)
        mlp_only = set(raw.get("mlp_only_layers") or [])
        moe_layers = tuple(
            i for i in range(layers) if i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0
        )
        # Mixtral and Qwen3.5-MoE have no norm_topk_prob field but always renormalise the top-k weights.
        norm_topk = bool(raw.get("norm_topk_prob", model_type in ("mixtral", "qwen3_5_moe", "qwen3_5_moe_text")))
        dtype = parse_dtype(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16", f"{source} dtype")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        layer_types = _layer_types(raw, layers, source)
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(raw, source),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            num_experts=num_experts,
            top_k=int(need("num_experts_per_tok")),
            moe_intermediate_size=moe_inter,
            intermediate_size=int(raw.get("intermediate_size") or moe_inter),
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            hidden_act=str(raw.get("hidden_act", "silu")),
            clip_qkv=raw.get("clip_qkv"),
            sliding_window=int(window) if window else None,
            dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_types=layer_types,
            linear_num_key_heads=int(raw.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(raw.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(raw.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(raw.get("linear_value_head_dim") or 0),
            linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim") or 4),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            raw=raw,
        )


def _layer_types(raw: dict, layers: int, source: str) -> tuple[str, ...]:
    """`layer_types`, or (older hybrid configs) every `full_attention_interval`-th layer full attention."""
    types = raw.get("layer_types")
    if types is None and raw.get("full_attention_interval"):
        interval = int(raw["full_attention_interval"])
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if not types or "linear_attention" not in types:
        return ()  # other families list full / sliding attention here; those need no per-layer switch
    if len(types) != layers or not set(types) <= {"full_attention", "linear_attention"}:
        raise CheckpointError(f"{source}: layer_types must list 'full_attention' / 'linear_attention' for each "
                              f"of the {layers} layers")
    return tuple(types)


def _rope_from_hf(raw: dict, source: str) -> RopeConfig:
    """Read rope settings from either `rope_parameters` (v5) or `rope_theta` + `rope_scaling` (Hub)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if scaling:
        params = {**scaling, **params}
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    if raw.get("partial_rotary_factor") is not None and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = raw["partial_rotary_factor"]  # Hub style keeps it top-level
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ("default", "linear", "dynamic", "yarn", "llama3"):
        raise CheckpointError(f"{source}: unsupported rope type {rope_type!r}")
    if rope_type != "default" and params.get("factor") is None and rope_type != "yarn":
        raise CheckpointError(f"{source}: rope type {rope_type!r} needs a 'factor'")
    return RopeConfig(rope_type=rope_type, theta=float(theta), params=tuple(sorted(params.items())))


@dataclass(frozen=True)
class EngineConfig:
    """Run-time options resolved once at start (every 'auto' is replaced by a concrete value)."""

    device: str = "cpu"                       # "cpu" or "cuda[:n]"
    dtype: torch.dtype = torch.float32        # compute / storage dtype of dense weights
    max_model_len: int = 4096                 # longest prompt + output per request
    max_running: int = 4                      # decode batch limit
    page_size: int = 16                       # tokens per KV page
    kv_cache_tokens: int = 0                  # 0 -> max_model_len * max_running
    max_batch_tokens: int = 8192              # token budget of one forward (chunked prefill)
    load_format: str = "auto"                 # auto | safetensors | ftw | gguf | dummy
    seed: int = 0                             # for dummy weights
