"""Asyncio front end of the synchronous Engine.

One background thread owns the Engine: only it calls `add_request`, `step` and `abort`, so the engine
needs no locks. Event-loop code hands it work through two lists guarded by a condition variable
(requests to add, requests to abort); the thread applies them between steps, steps while anything
is unfinished, and sleeps on the condition when there is nothing to do (no polling). Each request's
outputs travel back through its own asyncio.Queue, filled with `loop.call_soon_threadsafe` once per
step for all the requests of that loop.

Failure isolation: an exception inside `step()` fails the requests that were running in that step
(they get the error on their stream and are aborted in the engine) and the thread keeps serving the
rest. Cancellation: a consumer that stops listening (client disconnect, task cancelled) aborts its
request, so the engine never computes tokens nobody reads.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from tidal.errors import RequestError
from tidal.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while computing a request (a bug or a device error, not the request's fault)."""


# -- metrics -----------------------------------------------------------------------------------------
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RATE_WINDOW_S = 10.0


@dataclass
class Histogram:
    """Cumulative histogram in Prometheus' shape: counts[i] observations <= buckets[i] (last: +Inf)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[int]:
        out, acc = [], 0
        for c in self.counts:
            acc += c
            out.append(acc)
        return out


@dataclass
class EngineStats:
    """Counters the engine thread updates; `AsyncEngine.metrics()` returns a consistent copy."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0     # prompt tokens served from the prefix cache
    generation_tokens: int = 0
    requests_finished: dict = field(default_factory=dict)   # finish reason -> count
    request_errors: int = 0
    step_errors: int = 0
    steps: int = 0
    step_seconds: float = 0.0


class RequestStream:
    """Async iterator over one request's RequestOutputs; `cancel()` aborts it (idempotent, sync)."""

    def __init__(self, owner: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._owner = owner
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    @property
    def finished(self) -> bool:
        return self._done

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._owner.abort(self.request_id)


@dataclass
class _Live:
    """Engine-thread bookkeeping for one request."""

    stream: RequestStream
    arrival: float
    last_token: Optional[float] = None
    counted_prompt: bool = False


class AsyncEngine:
    """Serve an Engine to asyncio code. Construct it in any thread; use it from event loops."""

    def __init__(self, engine, *, name: str = "tidal-engine"):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.config.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self._cond = threading.Condition()
        self._adds: list[tuple[list[int], SamplingParams, RequestStream, float]] = []
        self._aborts: list[str] = []
        self._ids: set[str] = set()            # submitted and not yet finished (guarded by _cond)
        self._live: dict[str, _Live] = {}      # engine thread only
        self._stopping = False
        self._stats = EngineStats()
        self._stats_lock = threading.Lock()
        self._rate: deque[tuple[float, int]] = deque()   # (time, tokens) of recent steps
        self._experts: dict = {}
        self._experts_at = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- event-loop side ------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError now for what the engine would reject, so an HTTP handler can answer 400
        before it starts streaming (the engine thread may be busy with a long step)."""
        params.validate()
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:   # builtins: fast on long prompts
            bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
            raise RequestError(f"prompt token id {bad} is outside the vocabulary (size {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this server takes at most "
                               f"{self.max_model_len - 1} prompt tokens (--max-model-len {self.max_model_len})")

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               request_id: Optional[str] = None) -> RequestStream:
        """Queue a request; must be called from a running event loop. Raises RequestError at once for a
        request the engine would reject; errors found later arrive through the stream."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, params)
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(self, rid, asyncio.get_running_loop())
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise EngineError("the engine is not running (shut down, or its thread crashed: see the log)")
            if rid in self._ids:
                raise RequestError(f"duplicate request id {rid!r}")
            self._ids.add(rid)
            self._adds.append((prompt_ids, params, stream, time.monotonic()))
            self._cond.notify()
        return stream

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Per-step outputs of one request; closing or cancelling the iteration aborts the request."""
        stream = self.submit(prompt_ids, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.cancel()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine thread applies it between steps."""
        with self._cond:
            if request_id in self._ids:
                self._aborts.append(request_id)
                self._cond.notify()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) right now; requests queued for the engine thread count as waiting."""
        sched = getattr(self.engine, "scheduler", None)
        running = len(getattr(sched, "running", ()))
        waiting = len(getattr(sched, "waiting", ())) + len(self._adds)
        return running, waiting

    def metrics(self) -> dict:
        """A snapshot for /metrics: EngineStats fields, running/waiting, tokens/s, expert stats."""
        now = time.monotonic()
        with self._stats_lock:
            s = self._stats
            snap = {"ttft": Histogram(s.ttft.buckets, list(s.ttft.counts), s.ttft.total, s.ttft.count),
                    "itl": Histogram(s.itl.buckets, list(s.itl.counts), s.itl.total, s.itl.count),
                    "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
                    "generation_tokens": s.generation_tokens, "requests_finished": dict(s.requests_finished),
                    "request_errors": s.request_errors, "step_errors": s.step_errors, "steps": s.steps,
                    "step_seconds": s.step_seconds, "experts": dict(self._experts)}
            recent = sum(n for t, n in self._rate if t >= now - _RATE_WINDOW_S)
        snap["tokens_per_second"] = recent / _RATE_WINDOW_S
        snap["running"], snap["waiting"] = self.num_requests()
        return snap

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step; open streams get an EngineError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        device = getattr(eng, "device", None)
        if getattr(device, "type", None) == "cuda" and device.index is not None:
            import torch

            # The current CUDA device is per thread and starts at 0 in a new one; streams and graphs
            # the engine creates must land on its own device.
            torch.cuda.set_device(device)
        try:
            while True:
                with self._cond:
                    while not (self._adds or self._aborts or self._stopping or eng.has_unfinished()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                # Adds before aborts: an abort can only follow its own add, maybe in the same batch.
                for prompt_ids, params, stream, arrival in adds:
                    self._add(prompt_ids, params, stream, arrival)
                for rid in aborts:
                    self._abort(rid)
                if eng.has_unfinished():
                    self._step()
        except BaseException:   # a bug in this loop: fail everyone rather than hang them
            log.exception("the engine thread crashed")
            raise
        finally:
            err = EngineError("the engine stopped")
            for rid in list(self._live):
                self._fail(rid, err)
            with self._cond:
                pending, self._adds = self._adds, []
            self._deliver([(s, err) for _, _, s, _ in pending])

    def _add(self, prompt_ids: list[int], params: SamplingParams, stream: RequestStream, arrival: float) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=stream.request_id)
        except Exception as e:   # RequestError for a bad request; anything else is a bug, reported as such
            if not isinstance(e, RequestError):
                log.exception("add_request failed")
                e = EngineError(f"could not add the request: {e}")
            self._release(stream.request_id)
            with self._stats_lock:
                self._stats.request_errors += 1
            self._deliver([(stream, e)])
            return
        self._live[stream.request_id] = _Live(stream, arrival)

    def _abort(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("abort of %s failed", rid)
        self._release(rid)
        self._count_finish("abort")
        self._deliver([(live.stream, RequestOutput(rid, [], "", True, "abort"))])

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the requests it was computing")
            with self._stats_lock:
                self._stats.step_errors += 1
            sched = getattr(self.engine, "scheduler", None)
            victims = [r.request_id for r in getattr(sched, "running", ())]
            if not victims:   # the failure came before admission: do not retry it forever
                victims = [r.request_id for r in getattr(sched, "waiting", ())] or list(self._live)
            err = EngineError(f"the engine failed while computing this request: {type(e).__name__}: {e}")
            for rid in victims:
                self._fail(rid, err)
            return
        now = time.monotonic()
        deliveries = []
        new_tokens = 0
        with self._stats_lock:
            st = self._stats
            st.steps += 1
            st.step_seconds += now - t0
            for out in outputs:
                live = self._live.get(out.request_id)
                if live is None:
                    continue
                n = len(out.new_token_ids)
                new_tokens += n
                if not live.counted_prompt:
                    live.counted_prompt = True
                    st.prompt_tokens += out.num_prompt_tokens
                    st.cached_prompt_tokens += out.num_cached_tokens
                if n:
                    if live.last_token is None:
                        st.ttft.observe(now - live.arrival)
                    else:
                        st.itl.observe((now - live.last_token) / n)
                    live.last_token = now
                st.generation_tokens += n
                deliveries.append((live.stream, out))
                if out.finished:
                    del self._live[out.request_id]
                    st.requests_finished[out.finish_reason] = st.requests_finished.get(out.finish_reason, 0) + 1
            self._rate.append((now, new_tokens))
            while self._rate and self._rate[0][0] < now - _RATE_WINDOW_S:
                self._rate.popleft()
        for stream, out in deliveries:
            if out.finished:
                self._release(stream.request_id)
        self._deliver(deliveries)
        if now - self._experts_at >= 1.0 or not self.engine.has_unfinished():
            self._refresh_expert_stats(now)

    def _refresh_expert_stats(self, now: float) -> None:
        experts = getattr(getattr(self.engine, "loaded", None), "experts", None)
        try:
            stats = dict(experts.stats()) if experts is not None else {}
        except Exception:
            log.exception("expert stats failed")
            stats = {}
        with self._stats_lock:
            self._experts, self._experts_at = stats, now

    def _fail(self, rid: str, err: BaseException) -> None:
        live = self._live.pop(rid, None)
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("abort of failed request %s failed", rid)
        self._release(rid)
        if live is not None:
            with self._stats_lock:
                self._stats.request_errors += 1
            self._deliver([(live.stream, err)])

    def _count_finish(self, reason: str) -> None:
        with self._stats_lock:
            self._stats.requests_finished[reason] = self._stats.requests_finished.get(reason, 0) + 1

    def _release(self, rid: str) -> None:
        with self._cond:
            self._ids.discard(rid)

    @staticmethod
    def _deliver(items: list) -> None:
        """Hand (stream, output-or-exception) pairs to their event loops, one callback per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:   # the loop is closed: nobody is listening any more
                pass


def _put_all(batch: list) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
