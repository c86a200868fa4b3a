"""Per-forward metadata, set by the runner with a context manager and read by the layers.

Keeping it out of module globals and out of every forward() signature lets the model code stay the
shape of the reference implementation while attention reads the paged-KV layout it needs.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch


@dataclass
class SeqSlice:
    """One sequence's part of a flattened batch."""

    q_start: int              # first row of this sequence in the batch's [T, ...] tensors
    q_len: int                # new tokens this step
    ctx_len: int              # tokens in the KV cache after this step (prefix + new)
    kv_slots: torch.Tensor    # [ctx_len] int64 rows of the flattened KV cache holding its tokens
    state_slot: Optional[int] = None   # its slot in the recurrent-state pool (hybrid models only)

    @property
    def start(self) -> int:
        """Position of the first new token; 0 means the sequence starts here (fresh state)."""
        return self.ctx_len - self.q_len


@dataclass
class ForwardContext:
    seqs: list[SeqSlice]
    slot_mapping: torch.Tensor        # [T] int64: cache row each new token's K/V is written to
    kv_cache: "object"                # tidal.kvcache.KVPool: .k[layer], .v[layer] as [rows, Hkv, D]
    is_decode: bool = False           # every sequence has q_len == 1
    state_cache: "object" = None      # tidal.kvcache.StatePool for linear-attention layers, or None
    extras: dict = field(default_factory=dict)  # statistics and hooks for lower layers


_current: contextvars.ContextVar[Optional[ForwardContext]] = contextvars.ContextVar("tidal_forward", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("model forward called outside tidal.layers.context.forward_context")
    return ctx
