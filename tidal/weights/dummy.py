"""`--load-format dummy`: full-size models with deterministic random weights, built in memory.

Naive random weights make every token's hidden state nearly the same (attention averages values,
layer outputs swamp the embedding), so the router sends a whole batch to a few experts and any
offload benchmark flatters itself. The scales below keep the residual stream token-dependent
(embedding std 1, branch outputs well below it) and give router logits a std of ~2, so a batch
spreads over the experts the way a trained model's does; `routing_stats` checks it.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from tidal.experts.host_pool import HostExpertPool

ROUTER_LOGIT_STD = 2.0
BRANCH_GAIN = 0.5     # std of a projection's output relative to its input


def _fill(t: torch.Tensor, g: torch.Generator, std: float) -> torch.Tensor:
    # Generate in float32 then cast, in chunks, so memory stays bounded for multi-GB tensors.
    flat = t.view(-1)
    step = 1 << 24
    for i in range(0, flat.numel(), step):
        n = min(step, flat.numel() - i)
        flat[i:i + n].copy_(torch.randn(n, generator=g) * std)
    return t


def dummy_tensors(model, pool: HostExpertPool, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (canonical name, tensor) for every weight, experts as transformers-5 stacked banks."""
    g = torch.Generator().manual_seed(seed)
    for name, shape in model.expected_dense_tensors().items():
        t = torch.empty(shape, dtype=torch.float32)
        if name.endswith("norm.weight"):
            _fill(t, g, 0.1).add_(1.0)
        elif name.endswith("embed_tokens.weight"):
            _fill(t, g, 1.0)
        elif name.endswith("mlp.gate.weight"):
            _fill(t, g, ROUTER_LOGIT_STD / math.sqrt(shape[1]))
        elif name.endswith("bias"):
            t.zero_()
        else:
            _fill(t, g, BRANCH_GAIN / math.sqrt(shape[-1]))
        yield name, t
    H, I = pool.cfg.hidden_size, pool.cfg.moe_intermediate_size
    for layer in pool.layers:
        # Written straight into the pool's banks: no second multi-GB copy per layer.
        _fill(pool.gate_up[layer], g, BRANCH_GAIN / math.sqrt(H))
        _fill(pool.down[layer], g, BRANCH_GAIN / math.sqrt(I))
        yield f"model.layers.{layer}.mlp.experts.gate_up_proj", pool.gate_up[layer]
        yield f"model.layers.{layer}.mlp.experts.down_proj", pool.down[layer]
