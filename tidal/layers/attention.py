"""Grouped-query attention over a paged KV cache.

New tokens' K/V are written to their cache rows first; each sequence then attends over its rows
(prefix + new) gathered through its slot list. Variants per family: per-head or full-width q/k
RMSNorm (Qwen3 / OLMoE), q/k/v clipping (OLMoE), sliding window (Mistral-style), output gate
(Qwen3-Next: q_proj also yields a per-head gate; the attention output is multiplied by its sigmoid).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ModelConfig
from tidal.layers.context import get_forward_context
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: Optional[str], dtype, device,
                 gated: bool = False, norm_cls=RMSNorm):
        super().__init__()
        self.gated = gated
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.clip_qkv = cfg.clip_qkv
        self.sliding_window = cfg.sliding_window
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        mk = dict(bias=cfg.attention_bias, dtype=dtype, device=device)
        self.q_proj = nn.Linear(cfg.hidden_size, q_out * (2 if gated else 1), **mk)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, **mk)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, **mk)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype, device=device)
        self.qk_norm = qk_norm
        if qk_norm == "head":        # Qwen3: normalise each head's vector
            self.q_norm = norm_cls(self.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = norm_cls(self.head_dim, cfg.rms_norm_eps, dtype, device)
        elif qk_norm == "full":      # OLMoE: normalise the whole projection
            self.q_norm = RMSNorm(q_out, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(kv_out, cfg.rms_norm_eps, dtype, device)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]                                                    # x: [T, hidden]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.gated:  # per head: D query features then D gate features
            q, gate = q.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)   # [T, Hq, D] each
            q, gate = q.reshape(T, -1), gate.reshape(T, -1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)                      # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)                   # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_cache.k[self.layer], ctx.kv_cache.v[self.layer]   # [rows, Hkv, D]
        k_cache.index_copy_(0, ctx.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, ctx.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        for s in ctx.seqs:
            qs = q[s.q_start:s.q_start + s.q_len]
            if s.ctx_len == s.q_len:          # nothing cached before: attend over the fresh K/V
                ks, vs = k[s.q_start:s.q_start + s.q_len], v[s.q_start:s.q_start + s.q_len]
            else:
                ks, vs = k_cache.index_select(0, s.kv_slots), v_cache.index_select(0, s.kv_slots)
            out[s.q_start:s.q_start + s.q_len] = self._attend(qs, ks.to(q.dtype), vs.to(q.dtype), s.ctx_len)
        out = out.reshape(T, -1)                                          # [T, Hq * D]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int) -> torch.Tensor:
        """q [n, Hq, D] for the last n positions of a sequence; k/v [ctx_len, Hkv, D]."""
        n = q.shape[0]
        mask = None
        causal = n > 1 and n == ctx_len and self.sliding_window is None
        if not causal and (n > 1 or self.sliding_window is not None):
            q_pos = torch.arange(ctx_len - n, ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(ctx_len, device=q.device)[None, :]
            mask = k_pos <= q_pos                                           # [n, ctx]
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),       # [H, n, D], [Hkv, ctx, D]
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.transpose(0, 1)                                            # [n, Hq, D]
