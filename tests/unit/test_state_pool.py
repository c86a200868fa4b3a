"""Recurrent-state slots: one per running request, taken at admission, returned on finish, abort or
preemption; the prefix cache is off for models that need them."""
import pytest

from tidal.kvcache.page_pool import PageAllocator
from tidal.kvcache.state_pool import StateSlotAllocator
from tidal.scheduler.scheduler import Scheduler
from tidal.types import Request, SamplingParams


def make(num_pages=32, max_running=2):
    slots = StateSlotAllocator(max_running)
    sched = Scheduler(PageAllocator(num_pages), 4, max_running, 64, state_slots=slots)
    return sched, slots


def test_slots_follow_request_lifetime():
    sched, slots = make()
    assert sched.prefix_cache is None
    reqs = [Request(f"r{i}", list(range(3, 13)), SamplingParams()) for i in range(3)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [s.request for s in batch.seqs] == reqs[:2]          # max_running seats, one slot each
    assert {r.state_slot for r in reqs[:2]} == {0, 1} and reqs[2].state_slot is None
    assert slots.num_free == 0
    sched.update(batch)
    sched.finish(reqs[0], "length")
    assert reqs[0].state_slot is None and slots.num_free == 1
    sched.schedule()
    assert reqs[2].state_slot is not None and slots.num_free == 0
    sched.abort("r1")
    sched.abort("r2")
    assert slots.num_free == 2


def test_preemption_returns_the_slot():
    sched, slots = make(num_pages=6)      # 24 tokens of KV: two 10-token prompts fit, not more
    a, b = (Request(f"r{i}", list(range(3, 13)), SamplingParams()) for i in range(2))
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule())
    assert slots.num_free == 0
    a.output_ids.extend([1] * 6)          # a grows past its pages: b (admitted last) is preempted
    sched.update(sched.schedule())
    assert sched.num_preemptions == 1 and b.state_slot is None and slots.num_free == 1
    assert a.state_slot is not None


def test_double_release_is_an_error():
    slots = StateSlotAllocator(1)
    s = slots.allocate()
    slots.release(s)
    with pytest.raises(RuntimeError):
        slots.release(s)
