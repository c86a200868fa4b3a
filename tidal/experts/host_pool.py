"""The host pool: every routed expert of every MoE layer, in host memory, as banks.

A bank is one contiguous tensor per (layer, role) holding that role for all experts of the layer:
`gate_up[layer]` is [E, 2I, H] (gate rows then up rows, as transformers 5 stacks them) and
`down[layer]` is [E, H, I]. Contiguous banks let the CPU kernel index any expert by offset and let
copies to the GPU move one expert as two contiguous regions. Host memory is the source of truth
(DESIGN.md invariant 1): nothing else ever owns an expert's only copy.
"""
from __future__ import annotations

import logging

import torch

from tidal.config import ModelConfig
from tidal.errors import CheckpointError

log = logging.getLogger(__name__)

ROLES = ("gate", "up", "down")


class HostExpertPool:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.cfg, self.dtype = cfg, dtype
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.layers = tuple(cfg.moe_layers)
        self.gate_up = {l: torch.empty(E, 2 * I, H, dtype=dtype, device=device) for l in self.layers}
        self.down = {l: torch.empty(E, H, I, dtype=dtype, device=device) for l in self.layers}
        # (layer, expert, role) not yet written; loading must empty it.
        self._missing = {(l, e, r) for l in self.layers for e in range(E) for r in ROLES}
        self.pinned = False

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down) in the pool's dtype."""
        l = self.layers[0]
        return (self.gate_up[l][0].numel() + self.down[l][0].numel()) * self.gate_up[l].element_size()

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.cfg.num_experts * len(self.layers)

    def _target(self, layer: int, expert: int, role: str) -> torch.Tensor:
        I = self.cfg.moe_intermediate_size
        if role == "gate":
            return self.gate_up[layer][expert, :I]
        if role == "up":
            return self.gate_up[layer][expert, I:]
        return self.down[layer][expert]

    def set_expert(self, name: str, layer: int, expert: int, role: str, tensor: torch.Tensor) -> None:
        """Write one expert's `role` ([I, H] for gate/up, [H, I] for down) from checkpoint tensor `name`."""
        if layer not in self.gate_up:
            raise CheckpointError(f"tensor {name!r}: layer {layer} has no routed experts in this config")
        if not 0 <= expert < self.cfg.num_experts:
            raise CheckpointError(f"tensor {name!r}: expert {expert} out of range (num_experts="
                                  f"{self.cfg.num_experts})")
        dst = self._target(layer, expert, role)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise CheckpointError(f"tensor {name!r}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        self._missing.discard((layer, expert, role))

    def set_stacked(self, name: str, layer: int, kind: str, tensor: torch.Tensor) -> None:
        """Write a transformers-5 stacked tensor: kind 'gate_up' [E, 2I, H] or 'down' [E, H, I]."""
        if layer not in self.gate_up:
            raise CheckpointError(f"tensor {name!r}: layer {layer} has no routed experts in this config")
        dst = self.gate_up[layer] if kind == "gate_up" else self.down[layer]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise CheckpointError(f"tensor {name!r}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        roles = ("gate", "up") if kind == "gate_up" else ("down",)
        for e in range(self.cfg.num_experts):
            for r in roles:
                self._missing.discard((layer, e, r))

    def check_complete(self) -> None:
        if self._missing:
            l, e, r = min(self._missing)
            raise CheckpointError(f"checkpoint is missing expert weights: layer {l} expert {e} {r}_proj "
                                  f"({len(self._missing)} expert tensors missing in all)")

    def pin(self) -> None:
        """Page-lock the banks (after they are filled) so host->GPU copies run at full PCIe speed."""
        if self.pinned or not torch.cuda.is_available():
            return
        try:
            for banks in (self.gate_up, self.down):
                for l in list(banks):
                    banks[l] = banks[l].pin_memory()
            self.pinned = True
        except RuntimeError as e:
            log.warning("could not pin the host expert pool (%s); copies to the GPU will be slower", e)
