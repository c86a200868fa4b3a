"""Rotary position embeddings (NeoX rotate-half layout) with the scaling variants MoE models use.

Frequencies follow transformers' definitions for `default`, `linear`, `dynamic` (NTK), `yarn` and
`llama3`, so positions map to the same angles as the reference implementation.
"""
from __future__ import annotations

import math

import torch

from tidal.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int, max_pos: int, seq_len: int | None = None
                    ) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2] float32, attention scaling applied to cos and sin)."""
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    inv = 1.0 / (base ** exponents)
    kind = rope.rope_type
    if kind == "default":
        return inv, 1.0
    factor = rope.get("factor")
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "dynamic":
        original = rope.get("original_max_position_embeddings") or max_pos
        if seq_len is None or seq_len <= original:
            return inv, 1.0
        scaled = base * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (scaled ** exponents), 1.0
    if kind == "llama3":
        original = rope.get("original_max_position_embeddings") or max_pos
        low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, base, max_pos)
    raise ValueError(f"unsupported rope type {kind}")


def _yarn(rope: RopeConfig, dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    original = rope.get("original_max_position_embeddings")
    factor = rope.get("factor") or max_pos / original

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)


class RotaryEmbedding:
    """Computes cos/sin for a batch of positions; shared by every attention layer of a model."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int, device):
        self.rope, self.head_dim, self.max_pos = rope, head_dim, max_pos
        inv, self.scaling = inv_frequencies(rope, head_dim, max_pos)
        self.inv_freq = inv.to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv, scaling = self.inv_freq, self.scaling
        if self.rope.rope_type == "dynamic":
            inv, scaling = inv_frequencies(self.rope, self.head_dim, self.max_pos, int(positions.max()) + 1)
            inv = inv.to(positions.device)
        freqs = positions[:, None].float() * inv[None, :]            # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                      # [T, D]
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] (rotate-half layout)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out
