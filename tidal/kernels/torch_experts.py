"""Grouped SwiGLU experts in torch: one pass per distinct expert of a list of (token, expert) pairs.

The one torch formulation shared by the GPU branch, the all-resident runtime, the C++ kernel's
fallback and the benchmarks. Experts are visited in ascending id order, so two callers that read
the same weights from different rows (a bank, or cache slots) get the same bits.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def grouped_swiglu(x: torch.Tensor, token_idx: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor, *,
                   compute_dtype: Optional[torch.dtype] = None, slot_of: Optional[dict[int, int]] = None) -> None:
    """out[t] += w * down[e] @ (silu(g) * u), [g; u] = gate_up[e] @ x[t], for each pair (t, e, w).

    x [T, H]; token_idx, expert_ids, weights [N]; gate_up [E, 2I, H]; down [E, H, I]; out [T, H].
    Computes in `compute_dtype` (default x's). With `slot_of`, expert e's weights are read from
    row slot_of[e] and experts absent from it are skipped.
    """
    if expert_ids.numel() == 0:
        return
    dtype = compute_dtype or x.dtype
    xs = x.to(dtype)
    tok = token_idx.long()
    order = torch.argsort(expert_ids, stable=True)
    experts, counts = torch.unique_consecutive(expert_ids[order], return_counts=True)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        sel = order[start:start + n]
        start += n
        if slot_of is not None and e not in slot_of:
            continue
        row = e if slot_of is None else slot_of[e]
        t = tok[sel]
        g, u = F.linear(xs.index_select(0, t), gate_up[row].to(dtype)).chunk(2, dim=-1)   # [n, I] each
        y = F.linear(F.silu(g) * u, down[row].to(dtype))                                   # [n, H]
        y = y * weights[sel, None].to(y.dtype)
        out.index_add_(0, t, y.to(out.dtype))
