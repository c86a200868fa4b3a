"""AsyncEngine over the real engine: streaming, aborts, failure isolation, idling without polling."""
from __future__ import annotations

import asyncio
import sys

import pytest

from tests.server.conftest import wait_until
from tidal.engine.async_engine import EngineError
from tidal.errors import RequestError
from tidal.types import SamplingParams

PROMPT = [72, 101, 108, 108, 111]


def run(coro):
    return asyncio.run(coro)


async def collect(engine, n: int, **kw):
    outs = []
    async for o in engine.generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True, **kw)):
        outs.append(o)
    return outs


def test_generate_streams_every_token(demo_async_engine):
    outs = run(collect(demo_async_engine, 5))
    assert sum(len(o.new_token_ids) for o in outs) == 5
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].num_prompt_tokens == len(PROMPT)
    # Same as the synchronous engine would give: greedy is deterministic.
    direct = run(collect(demo_async_engine, 5))
    assert [t for o in outs for t in o.new_token_ids] == [t for o in direct for t in o.new_token_ids]


def test_concurrent_streams_from_two_event_loops(demo_async_engine):
    """Each request's outputs go to the loop that asked for them (two server threads share one engine)."""
    import threading

    results = {}

    def worker(name):
        results[name] = run(collect(demo_async_engine, 4 + len(name)))

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "bb")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(len(o.new_token_ids) for o in results["a"]) == 5
    assert sum(len(o.new_token_ids) for o in results["bb"]) == 6


def test_closing_the_iterator_aborts(demo_async_engine):
    async def main():
        gen = demo_async_engine.generate(PROMPT, SamplingParams(max_tokens=3000, ignore_eos=True))
        async for o in gen:
            if o.num_output_tokens >= 2:
                break
        await gen.aclose()
    run(main())
    wait_until(lambda: not demo_async_engine.engine.has_unfinished(), what="the abort")


def test_cancelling_the_consumer_aborts(demo_async_engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in demo_async_engine.generate(PROMPT, SamplingParams(max_tokens=3000, ignore_eos=True)):
                started.set()
        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(main())
    wait_until(lambda: not demo_async_engine.engine.has_unfinished(), what="the abort")


def test_bad_requests_fail_before_reaching_the_engine(demo_async_engine):
    async def main(ids, **kw):
        async for _ in demo_async_engine.generate(ids, SamplingParams(**kw)):
            pass
    with pytest.raises(RequestError, match="vocabulary"):
        run(main([10 ** 9]))
    with pytest.raises(RequestError, match="empty"):
        run(main([]))
    with pytest.raises(RequestError, match="prompt"):
        run(main([65] * 5000))


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(demo_async_engine, monkeypatch):
    engine = demo_async_engine.engine
    real_step = engine.step
    armed = {"fail": False}

    def step():
        if armed["fail"]:
            armed["fail"] = False
            raise RuntimeError("injected device error")
        return real_step()
    monkeypatch.setattr(engine, "step", step)

    async def main():
        gen = demo_async_engine.generate(PROMPT, SamplingParams(max_tokens=3000, ignore_eos=True))
        got = 0
        with pytest.raises(EngineError, match="injected device error"):
            async for _ in gen:
                got += 1
                if got == 2:
                    armed["fail"] = True
        return got
    assert run(main()) >= 2
    wait_until(lambda: not engine.has_unfinished(), what="the failed request to be dropped")
    assert demo_async_engine.is_alive
    assert sum(len(o.new_token_ids) for o in run(collect(demo_async_engine, 3))) == 3
    assert demo_async_engine.metrics()["step_errors"] >= 1


def test_idle_engine_thread_blocks_instead_of_polling(demo_async_engine):
    run(collect(demo_async_engine, 2))
    thread = demo_async_engine._thread

    def blocked_in_wait() -> bool:
        frame = sys._current_frames().get(thread.ident)
        while frame is not None:
            if frame.f_code.co_name == "wait" and "threading" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False
    wait_until(blocked_in_wait, what="the engine thread to block on its condition")
    steps = demo_async_engine.metrics()["steps"]
    wait_until(blocked_in_wait)
    assert demo_async_engine.metrics()["steps"] == steps
