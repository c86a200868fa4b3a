"""Qwen3-Next (Qwen3-Next-80B-A3B): hybrid layers of gated DeltaNet (linear attention, recurrent
state) and gated full attention, zero-centred RMSNorms, partial RoPE, MoE with a gated shared expert.

Which layers are which comes from config `layer_types` (or `full_attention_interval`). The shared
expert and its gate are dense weights of the MoE layer; routed experts go to the host pool as usual.
"""
from __future__ import annotations

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.errors import CheckpointError
from tidal.layers.attention import Attention
from tidal.layers.linear_attention import GatedDeltaNet
from tidal.layers.mlp import DenseMLP
from tidal.layers.moe import MoELayer
from tidal.layers.norm import ZeroCentredRMSNorm
from tidal.models.base import MoEDecoder


class HybridDecoderLayer(nn.Module):
    delta_net_cls = GatedDeltaNet

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm, experts, dtype, device):
        super().__init__()
        if cfg.is_linear_attention(layer):
            self.linear_attn = self.delta_net_cls(cfg, layer, dtype, device)
        else:
            self.self_attn = Attention(cfg, layer, qk_norm, dtype, device, gated=True, norm_cls=ZeroCentredRMSNorm)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if cfg.is_moe_layer(layer):
            self.mlp = MoELayer(cfg, layer, experts, dtype, device)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        h = h + mixer(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(MoEDecoder):
    qk_norm = "head"
    layer_cls = HybridDecoderLayer
    norm_cls = ZeroCentredRMSNorm
    skipped = (r"mtp\..*",)   # the multi-token-prediction head: not used for decoding

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        if cfg.has_recurrent_layers and not (cfg.linear_num_key_heads and cfg.linear_num_value_heads
                                             and cfg.linear_key_head_dim and cfg.linear_value_head_dim):
            raise CheckpointError("config.json: linear-attention layers need linear_num_key_heads, "
                                  "linear_num_value_heads, linear_key_head_dim and linear_value_head_dim")
        super().__init__(cfg, dtype, device)
