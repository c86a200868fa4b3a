"""The memory planner: one budget for everything Tidal allocates on the GPU.

budget = dense weights + KV cache + workspace + expert-cache slots. `--gpu-memory` caps the budget
(so an H200 can behave like an 8-32 GB card); `--expert-cache-gib` / `expert_cache_slots` override the
slot share. The torch allocator is capped to the same budget, so a planning error shows up as an
out-of-memory error in Tidal rather than as memory taken from other programs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from tidal.config import ModelConfig
from tidal.errors import ConfigError

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: Optional[int]   # None: no cap (CPU device)
    dense_bytes: int
    kv_bytes: int
    workspace_bytes: int
    slot_bytes: int
    expert_slots: int
    total_experts: int

    @property
    def all_resident(self) -> bool:
        return self.expert_slots >= self.total_experts

    def describe(self) -> str:
        gb = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        cap = gb(self.budget_bytes) if self.budget_bytes else "uncapped"
        return (f"budget {cap}: dense {gb(self.dense_bytes)}, KV {gb(self.kv_bytes)}, workspace "
                f"{gb(self.workspace_bytes)}, expert cache {self.expert_slots} slots "
                f"({gb(self.expert_slots * self.slot_bytes)}, {100 * min(1, self.expert_slots / self.total_experts):.0f}% "
                f"of {self.total_experts} experts)")


def workspace_bytes(cfg: ModelConfig, max_batch_tokens: int, max_running: int, dtype: torch.dtype) -> int:
    """Activation memory of the largest forward, with headroom for allocator fragmentation."""
    elem = torch.tensor([], dtype=dtype).element_size()
    per_token = (12 * cfg.hidden_size + 3 * cfg.num_heads * cfg.head_dim
                 + 4 * cfg.top_k * cfg.moe_intermediate_size + 2 * cfg.intermediate_size) * elem
    logits = max_running * cfg.vocab_size * 4 * 3
    return int(1.25 * (max_batch_tokens * per_token + logits)) + 256 * (1 << 20)


def plan(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, dense_bytes: int, kv_bytes: int,
         max_batch_tokens: int, max_running: int, gpu_memory_gib: Optional[float] = None,
         expert_cache_gib: Optional[float] = None, expert_cache_slots: Optional[int] = None) -> MemoryPlan:
    slot_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * torch.tensor([], dtype=dtype).element_size()
    total = cfg.num_experts * len(cfg.moe_layers)
    ws = workspace_bytes(cfg, max_batch_tokens, max_running, dtype)
    budget = None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        already = torch.cuda.memory_reserved(device)  # dense weights loaded so far
        budget = int(gpu_memory_gib * GIB) if gpu_memory_gib else int(0.92 * (free + already))
        if gpu_memory_gib and budget > free + already:
            log.warning("--gpu-memory %.1f GiB exceeds the free VRAM (%.1f GiB)", gpu_memory_gib,
                        (free + already) / GIB)
    elif gpu_memory_gib:
        budget = int(gpu_memory_gib * GIB)
    if expert_cache_slots is not None:
        slots = expert_cache_slots
    elif expert_cache_gib is not None:
        slots = int(expert_cache_gib * GIB // slot_bytes)
    elif budget is not None:
        slots = (budget - dense_bytes - kv_bytes - ws) // slot_bytes
    else:
        slots = total   # CPU without a cap: everything is "resident" in host memory
    if slots < 0 or (budget is not None and dense_bytes + kv_bytes + ws + slots * slot_bytes > budget):
        need = (dense_bytes + kv_bytes + ws + max(slots, cfg.top_k) * slot_bytes) / GIB
        raise ConfigError(f"--gpu-memory {budget / GIB:.1f} GiB is too small: dense weights "
                          f"{dense_bytes / GIB:.2f} GiB + KV cache {kv_bytes / GIB:.2f} GiB + workspace "
                          f"{ws / GIB:.2f} GiB + expert slots need about {need:.1f} GiB "
                          f"(lower --max-model-len or --max-running, or raise --gpu-memory)")
    return MemoryPlan(budget, dense_bytes, kv_bytes, ws, slot_bytes, min(int(slots), total), total)


def cap_allocator(device: torch.device, budget_bytes: Optional[int]) -> None:
    """Make the torch allocator refuse to grow past the budget."""
    if device.type != "cuda" or not budget_bytes:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
