"""Prefix cache: a radix tree over full KV pages, so a request reuses the longest computed prefix of
any earlier request (a multi-turn conversation re-prefills only its new turn).

Rules:
- A node is one *full* page: the page_size token ids it holds and its page number. A path from the
  root spells a token prefix; its pages hold exactly that prefix's K/V (positions are absolute, so
  a prefix's K/V do not depend on what follows it).
- The tree owns one allocator reference per node. A request that reuses a node retains the page
  for itself; a page is evictable only when the tree's reference is the last one and the node is a
  leaf. Eviction takes the least recently used such leaf first.
- Pages in the tree are never written again: requests append after their matched prefix, and a
  match always stops at a page boundary before the last prompt token.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from tidal.kvcache.page_pool import PageAllocator


@dataclass
class _Node:
    page: int
    key: tuple[int, ...]
    parent: Optional["_Node"]
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator, self.page_size = allocator, page_size
        self.root = _Node(page=-1, key=(), parent=None)
        self._clock = itertools.count(1)
        self.num_pages = 0
        self.hit_tokens = 0      # cumulative tokens served from the cache
        self.query_tokens = 0    # cumulative prompt tokens looked up

    def _blocks(self, ids: list[int], n_pages: int):
        P = self.page_size
        return (tuple(ids[i * P:(i + 1) * P]) for i in range(n_pages))

    def match(self, prompt_ids: list[int]) -> list[int]:
        """Pages holding the longest cached prefix of prompt_ids (retained for the caller).

        At least one prompt token is left uncomputed, so the request still runs a forward to sample
        its first token."""
        now = next(self._clock)
        node, pages = self.root, []
        for block in self._blocks(prompt_ids, (len(prompt_ids) - 1) // self.page_size):
            child = node.children.get(block)
            if child is None:
                break
            child.last_used = now
            pages.append(child.page)
            node = child
        self.allocator.retain(pages)
        self.query_tokens += len(prompt_ids)
        self.hit_tokens += len(pages) * self.page_size
        return pages

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        """Record the full pages of a computed sequence (token_ids[i] lives in pages[i // P])."""
        now = next(self._clock)
        node = self.root
        for block, page in zip(self._blocks(token_ids, len(token_ids) // self.page_size), pages):
            child = node.children.get(block)
            if child is None:
                child = _Node(page=page, key=block, parent=node)
                node.children[block] = child
                self.allocator.retain([page])
                self.num_pages += 1
            child.last_used = now
            node = child

    def evictable(self) -> int:
        """Pages that repeated leaf eviction could free right now: nodes whose whole subtree is
        held by the tree alone."""
        def free_subtree(node: _Node) -> tuple[int, bool]:
            count, all_free = 0, True
            for child in node.children.values():
                c, f = free_subtree(child)
                count, all_free = count + c, all_free and f
            if node is self.root:
                return count, all_free
            if all_free and self.allocator.refcount(node.page) == 1:
                return count + 1, True
            return count, False
        return free_subtree(self.root)[0]

    def evict(self, n: int) -> int:
        """Free up to n pages, least recently used leaves first; returns how many were freed."""
        freed = 0
        while freed < n:
            leaves = [x for x in self._leaves() if self.allocator.refcount(x.page) == 1]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda x: x.last_used):
                del leaf.parent.children[leaf.key]
                self.allocator.release([leaf.page])
                self.num_pages -= 1
                freed += 1
                if freed >= n:
                    break
        return freed

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node
