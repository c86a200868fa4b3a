"""Recurrent state for linear-attention (gated DeltaNet) layers: one fixed slot per running request.

Unlike attention KV, a recurrent layer's per-sequence state has a fixed size however long the
sequence is: a causal-conv window (the last K-1 conv inputs) and the DeltaNet state matrix per head.
Both are kept in float32 (they accumulate over the whole sequence). `StatePool` holds the tensors,
`StateSlotAllocator` only hands out slot numbers (the scheduler uses it; it never touches tensors).

Rules: a request owns one slot from admission until it finishes or is preempted. The layer resets
the slot when a sequence starts at position 0 and carries it over between prefill chunks, so a
freed slot needs no clearing.
"""
from __future__ import annotations

from typing import Optional

import torch

from tidal.config import ModelConfig


class StatePool:
    def __init__(self, layers: tuple[int, ...], num_slots: int, conv_dim: int, conv_width: int,
                 num_v_heads: int, k_head_dim: int, v_head_dim: int, device: torch.device):
        self.layers, self.num_slots = layers, num_slots
        f32 = dict(dtype=torch.float32, device=device)
        # conv[layer]: [slots, conv_dim, K-1]; ssm[layer]: [slots, Hv, Dk, Dv]
        self.conv = {l: torch.zeros(num_slots, conv_dim, conv_width - 1, **f32) for l in layers}
        self.ssm = {l: torch.zeros(num_slots, num_v_heads, k_head_dim, v_head_dim, **f32) for l in layers}

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_slots: int, device: torch.device) -> Optional["StatePool"]:
        """The pool for cfg's linear-attention layers, or None when the model has none."""
        layers = cfg.linear_attention_layers
        if not layers:
            return None
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return cls(layers, num_slots, conv_dim, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads,
                   cfg.linear_key_head_dim, cfg.linear_value_head_dim, device)

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig) -> int:
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        per_layer = conv_dim * (cfg.linear_conv_kernel_dim - 1) \
            + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        return 4 * per_layer * len(cfg.linear_attention_layers)


class StateSlotAllocator:
    """Free list of state slots (no tensors)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError(f"recurrent state pool exhausted ({self.num_slots} slots)")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"state slot {slot} released twice or out of range")
        self._free.append(slot)
