"""Paged KV cache: fixed-size pages of `page_size` token rows per attention layer.

The K and V tensors of a layer are [num_pages * page_size, Hkv, D]; a sequence owns a list of pages
and its token at position p lives in row pages[p // page_size] * page_size + p % page_size. The
allocator only hands out page numbers; it never touches tensors (the scheduler uses it).
"""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        rows = num_pages * page_size
        self.num_pages, self.page_size = num_pages, page_size
        self.k = [torch.empty(rows, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(rows, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class PageAllocator:
    """Free-list of page numbers. Pages are reference-counted so a prefix can be shared."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache out of pages: need {n}, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
            elif self._refs[p] < 0:
                raise RuntimeError(f"page {p} released more often than allocated")
