"""`--load-format dummy`: full-size models with deterministic random weights, built in memory.

Naive random weights make every token's hidden state nearly the same (attention averages values,
layer outputs swamp the embedding), so the router sends a whole batch to a few experts and any
offload benchmark flatters itself. The scales below keep the residual stream token-dependent
(embedding std 1, branch outputs well below it) and give router logits a std of ~2, so a batch
spreads over the experts the way a trained model's does; `tidal bench decode` prints the check.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from tidal.experts.host_pool import HostExpertPool

ROUTER_LOGIT_STD = 2.0
BRANCH_GAIN = 0.5     # std of a projection's output relative to its input
# Attention averages values over the context, so its output is much the same for every token; at
# full gain that common part piles up in the residual stream and, by layer 48 of Qwen3-30B-A3B, sends
# 6x the uniform share of a batch to one expert. A small gain keeps the busiest expert under 2x at
# every depth (measured on a 48-layer, 128-expert model of reduced width).
ATTN_OUT_GAIN = 0.1


_TABLE = 1 << 24   # normal samples drawn once per generator; chunks copy them from random offsets


class _Noise:
    """N(0, 1) values, deterministic for a seed.

    Drawing 60 GB of fresh normals takes minutes; copying windows of one table at random offsets
    runs at memory speed and is just as useless to the router as a fresh draw.
    """

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(2 * _TABLE, generator=self.g)

    def fill(self, t: torch.Tensor, std: float) -> torch.Tensor:
        flat = t.view(-1)
        for i in range(0, flat.numel(), _TABLE):
            n = min(_TABLE, flat.numel() - i)
            off = int(torch.randint(_TABLE, (1,), generator=self.g))
            flat[i:i + n].copy_(self.table[off:off + n]).mul_(std)
        return t


def dummy_tensors(model, pool: HostExpertPool, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (canonical name, tensor) for every weight, experts as transformers-5 stacked banks."""
    noise = _Noise(seed)
    for name, shape in model.expected_dense_tensors().items():
        t = torch.empty(shape, dtype=torch.float32)
        if name.endswith("norm.weight"):
            noise.fill(t, 0.1).add_(1.0)
        elif name.endswith("embed_tokens.weight"):
            noise.fill(t, 1.0)
        elif name.endswith("mlp.gate.weight"):
            noise.fill(t, ROUTER_LOGIT_STD / math.sqrt(shape[1]))
        elif name.endswith("bias"):
            t.zero_()
        elif name.endswith("o_proj.weight"):
            noise.fill(t, ATTN_OUT_GAIN / math.sqrt(shape[-1]))
        else:
            noise.fill(t, BRANCH_GAIN / math.sqrt(shape[-1]))
        yield name, t
    H, I = pool.cfg.hidden_size, pool.cfg.moe_intermediate_size
    for layer in pool.layers:
        # Written straight into the pool's banks: no second multi-GB copy per layer.
        noise.fill(pool.gate_up[layer], BRANCH_GAIN / math.sqrt(H))
        noise.fill(pool.down[layer], BRANCH_GAIN / math.sqrt(I))
        yield f"model.layers.{layer}.mlp.experts.gate_up_proj", pool.gate_up[layer]
        yield f"model.layers.{layer}.mlp.experts.down_proj", pool.down[layer]
