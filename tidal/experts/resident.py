"""All-resident expert runtime: every expert's weights sit on the compute device.

This is the reference behaviour the offload runtime must reproduce (exactly on the GPU, up to fp32
rounding on the CPU). On a CPU-only machine the host pool *is* the device copy.
"""
from __future__ import annotations

import torch

from tidal.experts.base import ExpertRuntime
from tidal.experts.compute import swiglu_experts
from tidal.experts.host_pool import HostExpertPool


class ResidentExperts(ExpertRuntime):
    def __init__(self, pool: HostExpertPool, device: torch.device, cpu_kernel=None):
        self.pool = pool
        # On the CPU the C++ kernel is the fast path; float32 models keep torch so that they match
        # the reference to the last bit that float32 allows.
        self.cpu_kernel = cpu_kernel if torch.device(device).type == "cpu" and pool.dtype != torch.float32 else None
        if pool.gate_up and next(iter(pool.gate_up.values())).device == torch.device(device):
            self.gate_up, self.down = pool.gate_up, pool.down
        else:
            self.gate_up = {l: t.to(device) for l, t in pool.gate_up.items()}
            self.down = {l: t.to(device) for l, t in pool.down.items()}

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel is not None:
            T, K = ids.shape
            out = torch.zeros(T, hidden.shape[1], dtype=torch.float32)
            tok = torch.arange(T, dtype=torch.int32).repeat_interleave(K)
            self.cpu_kernel.run(hidden.float().contiguous(), tok, ids.reshape(-1).to(torch.int32),
                                weights.reshape(-1).float().contiguous(), self.gate_up[layer], self.down[layer], out)
            return out.to(hidden.dtype)
        return swiglu_experts(hidden, ids, weights, self.gate_up[layer], self.down[layer])
