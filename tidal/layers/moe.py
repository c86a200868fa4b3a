"""Routed MoE layer: router top-k with the family's normalisation, then the expert runtime.

The layer does not know where experts live (GPU cache, host pool, CPU executor): it hands
(hidden, ids, weights) to `experts.forward(layer, ...)` and gets the combined output back.

Benchmarks (only) may install a routing override (`set_routing_override` / `routing_override`): the
router still runs at full cost, then its expert ids are replaced by a RoutingSource's ids (see
tidal/experts/routing.py) to measure caches under skewed or recorded routing. Serving never installs
one, so the model's routing is exact there (DESIGN.md invariant 2).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tidal.config import ModelConfig
from tidal.experts.routing import RoutingSource
from tidal.layers.mlp import DenseMLP


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
        self.routing_override: Optional[RoutingSource] = None   # benchmarks only; see the module doc
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            # Qwen3-Next: a dense expert every token uses, scaled by a per-token sigmoid gate. It is
            # a dense weight (lives with the model, not in the host pool).
            self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, device)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)
            self.shared_expert_gate.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                     # [T, hidden]
        ids, weights = self.gate(x)
        if self.routing_override is not None:
            # The k-th strongest router weight goes to the source's k-th expert: the weights keep the
            # model's distribution (already normalised as the family does), only the ids change.
            ids = self.routing_override.ids(self.layer, ids.shape[0], ids.shape[1],
                                            self.gate.weight.shape[0], ids.device)  # [T, K]
        out = self.experts.forward(self.layer, x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)   # [T, hidden]
        return out


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return sorted((m for m in model.modules() if isinstance(m, MoELayer)), key=lambda m: m.layer)


def set_routing_override(model: nn.Module, source: Optional[RoutingSource]) -> None:
    """Install `source` on every MoE layer of `model` (None removes it). Benchmarks only.

    The source is bound to the model's shapes first (raises ConfigError when it cannot serve them)
    and reset, so the first forward after installing starts every layer's stream."""
    layers = moe_layers(model)
    if source is not None:
        if not layers:
            from tidal.errors import ConfigError
            raise ConfigError("--routing needs a model with MoE layers")
        gate = layers[0].gate
        source.bind([m.layer for m in layers], gate.weight.shape[0], gate.top_k)
        source.reset()
    for m in layers:
        m.routing_override = source


@contextlib.contextmanager
def routing_override(model: nn.Module, source: Optional[RoutingSource]) -> Iterator[Optional[RoutingSource]]:
    """`with routing_override(model, source):` installs the source for the block, then removes it."""
    set_routing_override(model, source)
    try:
        yield source
    finally:
        set_routing_override(model, None)
