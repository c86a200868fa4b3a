"""The interface between MoE layers and whatever computes their experts."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class ExpertRuntime(ABC):
    """Computes routed experts for every MoE layer of one model.

    Rules:
    - `forward` returns exactly sum_k weights[t, k] * expert_{ids[t, k]}(hidden[t]) for each token t,
      in hidden's dtype and on hidden's device, whatever the residency of those experts.
    - Residency, caching and CPU execution are this object's business; the result never depends on
      them beyond float rounding of the CPU path (fp32 accumulation).
    - It is called once per MoE layer per forward, in layer order, from one thread.
    """

    @abstractmethod
    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; ids [T, K] int64 expert indices; weights [T, K] float32 -> [T, H]."""

    def stats(self) -> dict:
        """Cumulative counters (hits, misses, ...) for reporting; empty when not meaningful."""
        return {}
