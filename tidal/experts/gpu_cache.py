"""The expert cache: slots on the compute device shared by all MoE layers, with a global LRU.

A slot holds every tensor of one expert (gate_up [2I, H] and down [H, I]), so residency is keyed
by the logical id (layer, expert), never by tensor shards. The cache is only a cache: dropping any
entry changes speed, never results (DESIGN.md invariant 1).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional

import torch

Key = tuple[int, int]  # (layer, expert)


class LRUResidency:
    """Which (layer, expert) occupies which slot, and in what order they were last used.

    Rules: a hit refreshes recency; `admit` takes a free slot or evicts the least recently used
    entry that is not protected (entries used by the step in progress are protected, so a fill can
    never evict an expert the same step still needs).
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: "OrderedDict[Key, int]" = OrderedDict()   # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self.protected: set[Key] = set()

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: Key) -> bool:
        return key in self._slot_of

    def slot(self, key: Key) -> Optional[int]:
        return self._slot_of.get(key)

    def touch(self, key: Key) -> int:
        self._slot_of.move_to_end(key)
        return self._slot_of[key]

    def victim(self) -> Optional[Key]:
        """The entry `admit` would evict next (None when a slot is free or nothing is evictable)."""
        if self._free:
            return None
        return next((k for k in self._slot_of if k not in self.protected), None)

    def admit(self, key: Key) -> tuple[int, Optional[Key]]:
        """Give `key` a slot; returns (slot, evicted key or None). Raises if every slot is protected."""
        if key in self._slot_of:
            return self.touch(key), None
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self.victim()
            if evicted is None:
                raise RuntimeError("expert cache: every slot is in use by the current step")
            slot = self._slot_of.pop(evicted)
        self._slot_of[key] = slot
        return slot, evicted

    def keys(self) -> Iterable[Key]:
        return list(self._slot_of)

    def resize(self, num_slots: int) -> list[Key]:
        """Shrink or grow to num_slots; returns the evicted keys (LRU first). Slots above the new
        size are vacated, so the caller may free their memory."""
        evicted: list[Key] = []
        if num_slots < self.num_slots:
            for key, slot in list(self._slot_of.items()):
                if slot >= num_slots:
                    del self._slot_of[key]
                    evicted.append(key)
            self._free = [s for s in self._free if s < num_slots]
            # Keep the most recent entries: evict LRU ones until everything fits.
            while len(self._slot_of) > num_slots:
                key, _ = self._slot_of.popitem(last=False)
                evicted.append(key)
        else:
            self._free = list(range(num_slots - 1, self.num_slots - 1, -1)) + self._free
        self.num_slots = num_slots
        return evicted


class ExpertSlots:
    """The slot tensors: gate_up [S, 2I, H] and down [S, H, I] on the cache device."""

    def __init__(self, num_slots: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device):
        self.gate_up = torch.empty(num_slots, 2 * inter, hidden, dtype=dtype, device=device)
        self.down = torch.empty(num_slots, hidden, inter, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_slot(hidden: int, inter: int, dtype: torch.dtype) -> int:
        return 3 * hidden * inter * torch.tensor([], dtype=dtype).element_size()
