"""Dense SwiGLU MLP, for the layers of a MoE model that are not routed (mlp_only_layers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, device):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
