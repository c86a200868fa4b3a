"""Continuous-batching scheduler over a paged KV cache.

Each step: every running request that is decoding gets one token; prefills fill the rest of the
token budget in chunks; waiting requests are admitted while there are seats and pages. When pages
run out, the most recently admitted request is preempted (its pages freed, its tokens recomputed
later) rather than failing anything. The scheduler never touches tensors.

Models with recurrent (linear-attention) layers also need one state slot per running request: it is
taken at admission and given back when the request finishes or is preempted. Their prefix cache is
off: a recurrent state cannot be rebuilt from KV pages (recurrent-state anchors will lift this).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Optional

from tidal.kvcache.page_pool import PageAllocator
from tidal.kvcache.state_pool import StateSlotAllocator
from tidal.scheduler.prefix_cache import PrefixCache
from tidal.types import Request, RequestStatus, ScheduledBatch, ScheduledSeq

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_running: int, max_batch_tokens: int,
                 prefill_chunk: Optional[int] = None, prefix_cache: bool = True,
                 state_slots: Optional[StateSlotAllocator] = None):
        self.allocator, self.page_size = allocator, page_size
        self.state_slots = state_slots
        if state_slots is not None and prefix_cache:
            log.info("prefix cache disabled: the model has recurrent layers")
            prefix_cache = False
        self.prefix_cache = PrefixCache(allocator, page_size) if prefix_cache else None
        self.max_running, self.max_batch_tokens = max_running, max_batch_tokens
        self.prefill_chunk = prefill_chunk or max_batch_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._seqs: list[ScheduledSeq] = []

    # -- queue management --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, request_id: str) -> Optional[Request]:
        for req in list(self.waiting) + self.running:
            if req.request_id == request_id:
                self.finish(req, "abort")
                return req
        return None

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = RequestStatus.FINISHED, req.finish_reason or reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.prefix_cache is not None and req.pages:
            # Everything computed is reusable by later requests (the next turn of a conversation).
            self.prefix_cache.insert(req.all_ids[:req.num_computed], req.pages)
        self._free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_batch_tokens
        seqs: list[ScheduledSeq] = []
        self._seqs = seqs  # so a preemption can withdraw a request already placed in this batch
        # Decoding requests first: they are what users see streaming.
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.num_tokens - req.num_computed != 1:
                continue
            if not self._ensure_pages(req, req.num_tokens):
                continue  # req itself was preempted
            seqs.append(ScheduledSeq(req, req.num_computed, 1, sample=True))
            budget -= 1
        # Prefills in progress, then new admissions, in arrival order.
        for req in list(self.running):
            if budget <= 0:
                break
            remaining = req.num_tokens - req.num_computed
            if remaining > 1 and req.status is RequestStatus.RUNNING and not any(s.request is req for s in seqs):
                budget -= self._schedule_chunk(req, remaining, budget, seqs)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.num_computed == 0 and not req.pages and self.prefix_cache is not None:
                req.pages = self.prefix_cache.match(req.all_ids)
                req.num_computed = len(req.pages) * self.page_size
                if not req.output_ids:  # a preempted request recomputes; only count first admission
                    req.num_cached_prefix = req.num_computed
            remaining = req.num_tokens - req.num_computed
            needed = self._pages_for(min(req.num_computed + min(remaining, budget, self.prefill_chunk),
                                         req.num_tokens))
            if not self._can_get(needed - len(req.pages)):
                break  # wait for pages to free up
            if self.state_slots is not None:
                if self.state_slots.num_free == 0:
                    break
                req.state_slot = self.state_slots.allocate()
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= self._schedule_chunk(req, remaining, budget, seqs)
        return ScheduledBatch(seqs)

    def _schedule_chunk(self, req: Request, remaining: int, budget: int, seqs: list[ScheduledSeq]) -> int:
        n = min(remaining, budget, self.prefill_chunk)
        if not self._ensure_pages(req, req.num_computed + n):
            return 0
        seqs.append(ScheduledSeq(req, req.num_computed, n, sample=req.num_computed + n == req.num_tokens))
        return n

    def update(self, batch: ScheduledBatch) -> None:
        """Advance each scheduled sequence past the tokens just computed."""
        for s in batch.seqs:
            s.request.num_computed = s.start + s.num_tokens

    # -- pages -------------------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _ensure_pages(self, req: Request, num_tokens: int) -> bool:
        """Give req pages for num_tokens tokens, preempting later requests if needed. False if req
        itself had to be preempted."""
        need = self._pages_for(num_tokens) - len(req.pages)
        if need > self.allocator.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.allocator.num_free)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.pages.extend(self.allocator.allocate(need))
        return True

    def _can_get(self, n: int) -> bool:
        """Whether n pages can be had without preempting anyone (evicting cached prefixes is fine)."""
        free = self.allocator.num_free
        return n <= free or (self.prefix_cache is not None and n <= free + self.prefix_cache.evictable())

    def _preempt(self, req: Request) -> None:
        log.info("preempting request %s: KV cache full (it will be recomputed)", req.request_id)
        self.num_preemptions += 1
        self.running.remove(req)
        self._free(req)
        self._seqs[:] = [s for s in self._seqs if s.request is not req]
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _free(self, req: Request) -> None:
        if req.state_slot is not None and self.state_slots is not None:
            self.state_slots.release(req.state_slot)
            req.state_slot = None
        if req.pages:
            self.allocator.release(req.pages)
            req.pages = []
