"""Routed experts of a [T, K] routing, through the shared torch formulation."""
from __future__ import annotations

import torch

from tidal.kernels.torch_experts import grouped_swiglu


def swiglu_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor | None = None,
                   slot_of: dict[int, int] | None = None) -> torch.Tensor:
    """out[t] += sum_k weights[t,k] * expert_{ids[t,k]}(x[t]); returns out (zeros when None).

    x [T, H]; ids [T, K] expert ids; weights [T, K]; gate_up [E, 2I, H]; down [E, H, I]. With
    `slot_of`, expert e's weights are read from row slot_of[e] of the banks and experts absent from
    it are skipped (see tidal.kernels.torch_experts.grouped_swiglu).
    """
    if out is None:
        out = torch.zeros_like(x)
    T, K = ids.shape
    tokens = torch.arange(T, device=ids.device).repeat_interleave(K)        # [T*K]
    grouped_swiglu(x, tokens, ids.reshape(-1), weights.reshape(-1), gate_up, down, out, slot_of=slot_of)
    return out
