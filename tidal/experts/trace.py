"""Routing traces: which experts each MoE layer used at each forward, for cache-policy studies."""
from __future__ import annotations

import json
from typing import IO

import torch

from tidal.experts.base import ExpertRuntime


class RecordingExperts(ExpertRuntime):
    """Wraps another runtime and writes one JSON line per forward:
    {"step": n, "phase": "prefill"|"decode", "tokens": T, "layers": {"<layer>": [[e, ...] per token]}}.
    Results are the wrapped runtime's, unchanged."""

    def __init__(self, inner: ExpertRuntime, out: IO[str]):
        self.inner, self.out = inner, out
        self.step = 0
        self._current: dict[int, list] = {}
        self._tokens = 0

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if layer in self._current:      # a new forward started: the previous one is complete
            self.flush()
        self._current[layer] = ids.tolist()
        self._tokens = ids.shape[0]
        return self.inner.forward(layer, hidden, ids, weights)

    def flush(self) -> None:
        if not self._current:
            return
        phase = "decode" if all(len(v) <= 1 for v in self._current.values()) else "prefill"
        self.out.write(json.dumps({"step": self.step, "phase": phase, "tokens": self._tokens,
                                   "layers": {str(k): v for k, v in self._current.items()}}) + "\n")
        self.step += 1
        self._current = {}

    def stats(self) -> dict:
        return self.inner.stats()
