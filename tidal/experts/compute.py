"""Grouped SwiGLU expert computation in torch: one pass per distinct expert of the batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def group_pairs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the batch's (token, k) pairs by expert.

    ids [T, K] -> (experts [U] distinct ids ascending, counts [U], token_of_pair [T*K] sorted,
    pair_index [T*K] flat index into ids/weights, sorted the same way).
    """
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return experts, counts, order // ids.shape[1], order


def swiglu_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor | None = None,
                   slot_of: dict[int, int] | None = None) -> torch.Tensor:
    """out[t] += sum_k weights[t,k] * down[e] @ (silu(g) * u), [g; u] = gate_up[e] @ x[t], e = ids[t,k].

    x [T, H]; ids [T, K] expert ids; weights [T, K]; gate_up [E, 2I, H]; down [E, H, I];
    out [T, H] (allocated as zeros when None). With `slot_of`, expert e's weights are read from
    row slot_of[e] of the banks and experts absent from it are skipped. Experts are always visited
    in ascending id order, so the result is bit-identical whichever rows hold them.
    """
    if out is None:
        out = torch.zeros_like(x)
    if ids.numel() == 0:
        return out
    experts, counts, tokens, pairs = group_pairs(ids)
    w_flat = weights.reshape(-1)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        if slot_of is not None and e not in slot_of:
            start += n
            continue
        row = e if slot_of is None else slot_of[e]
        tok = tokens[start:start + n]
        gu = F.linear(x[tok], gate_up[row].to(x.dtype))                 # [n, 2I]
        g, u = gu.chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[row].to(x.dtype))              # [n, H]
        y = y * w_flat[pairs[start:start + n], None].to(y.dtype)
        out.index_add_(0, tok, y.to(out.dtype))
        start += n
    return out
