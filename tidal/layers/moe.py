"""Routed MoE layer: router top-k with the family's normalisation, then the expert runtime.

The layer does not know where experts live (GPU cache, host pool, CPU executor): it hands
(hidden, ids, weights) to `experts.forward(layer, ...)` and gets the combined output back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ModelConfig


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device):
        super().__init__()
        self.top_k, self.renormalize = cfg.top_k, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)                                   # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)                       # routing always in fp32
        weights, ids = torch.topk(probs, self.top_k, dim=-1)                # [T, K]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, experts, dtype, device):
        super().__init__()
        self.layer = layer
        self.gate = Router(cfg, dtype, device)
        self.experts = experts       # an ExpertRuntime, shared by all MoE layers (not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                     # [T, hidden]
        ids, weights = self.gate(x)
        return self.experts.forward(self.layer, x, ids, weights)
