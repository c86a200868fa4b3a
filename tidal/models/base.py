"""The decoder shared by the supported MoE families: pre-norm blocks of attention + (MoE | MLP).

A family file subclasses `MoEDecoder` and sets its attention variant and checkpoint renames. Weight
loading maps every checkpoint tensor to exactly one destination (a parameter here, or an expert in
the host pool) and fails naming the tensor when one is missing, unused or the wrong shape.
"""
from __future__ import annotations

import re
from typing import ClassVar, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ModelConfig
from tidal.errors import CheckpointError
from tidal.experts.host_pool import HostExpertPool
from tidal.layers.attention import Attention
from tidal.layers.mlp import DenseMLP
from tidal.layers.moe import MoELayer
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import RotaryEmbedding

_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj")
# Buffers some older checkpoints carry; they hold nothing we need.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, qk_norm, experts, dtype, device):
        super().__init__()
        self.self_attn = Attention(cfg, layer, qk_norm, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if cfg.is_moe_layer(layer):
            self.mlp = MoELayer(cfg, layer, experts, dtype, device)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class MoEDecoder(nn.Module):
    qk_norm: ClassVar[Optional[str]] = None          # None | "head" | "full"
    # (pattern, replacement) applied in order to checkpoint names before matching.
    renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    layer_cls: ClassVar[type] = DecoderLayer        # (cfg, layer, qk_norm, experts, dtype, device)
    norm_cls: ClassVar[type] = RMSNorm              # the final norm
    skipped: ClassVar[tuple[str, ...]] = ()         # checkpoint-name patterns deliberately not loaded

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        if cfg.hidden_act != "silu":
            raise CheckpointError(f"config.json: hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        # Build on the meta device: parameters get storage (uninitialised) only once, on the target.
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(
                self.layer_cls(cfg, i, self.qk_norm, None, dtype, None) for i in range(cfg.num_layers))
            self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
                cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device=self.device)
        self.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, self.device)

    def set_expert_runtime(self, runtime) -> None:
        """Attach the ExpertRuntime every MoE layer hands its routed experts to."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoELayer):
                layer.mlp.experts = runtime

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]. Needs a ForwardContext."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, V] float32
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    # -- loading ------------------------------------------------------------------------------------
    def canonical_name(self, name: str) -> str:
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        return name

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], pool: HostExpertPool) -> None:
        params = {("" if n.startswith("lm_head.") else "model.") + n: p for n, p in self.named_parameters()}
        loaded: set[str] = set()
        for name, tensor in tensors:
            canon = self.canonical_name(name)
            if m := _PER_EXPERT.fullmatch(canon):
                pool.set_expert(name, int(m[1]), int(m[2]), m[3], tensor)
            elif m := _STACKED.fullmatch(canon):
                pool.set_stacked(name, int(m[1]), m[2], tensor)
            elif canon in params:
                dst = params[canon]
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise CheckpointError(
                        f"tensor {name!r}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)} from config.json")
                dst.copy_(tensor)
                loaded.add(canon)
            elif canon == "lm_head.weight" and self.lm_head is None or _IGNORED.fullmatch(canon):
                continue
            elif any(re.fullmatch(p, canon) for p in self.skipped):
                continue  # tied to the embedding: the checkpoint's copy is redundant
            else:
                raise CheckpointError(f"checkpoint tensor {name!r} is not used by the {self.cfg.model_type} "
                                      f"model built from config.json (wrong model_type or layer count?)")
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        pool.check_complete()

    def expected_dense_tensors(self) -> dict[str, tuple[int, ...]]:
        """Canonical names and shapes of the non-expert tensors (used by dummy weights)."""
        return {("" if n.startswith("lm_head.") else "model.") + n: tuple(p.shape) for n, p in self.named_parameters()}
