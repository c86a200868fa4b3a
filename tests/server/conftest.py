"""Live servers for the black-box tests: uvicorn on 127.0.0.1 on a free port, in a thread, ready once
/health answers, shut down at the end of the fixture's scope."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tidal.server.app import create_app

MODEL = "tidal-test-model"
API_KEY = "test-key-123"


class LiveServer:
    def __init__(self, app, startup_timeout: float = 60.0):
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))   # bound before uvicorn starts: no race for the port
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout
        while True:   # poll /health until the server answers
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not come up")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="session")
def demo_async_engine():
    import torch

    from tidal.engine.async_engine import AsyncEngine
    from tidal.engine.engine import Engine
    from tidal.weights.demo import demo_model_path

    # The tiny demo model gains nothing from intra-op threads, and on a small shared CI machine their
    # spin-waiting next to the server's own threads makes each step ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = AsyncEngine(Engine(str(demo_model_path()), device="cpu", dtype="float32", progress=False,
                                max_running=8))
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def cold_async_engine(demo_async_engine):
    """The same model without the prefix cache, built the way `tidal serve --no-prefix-cache` builds it:
    what every request computes from scratch is the reference for what cached requests must return."""
    from tidal.cli import build_parser, engine_from_args
    from tidal.engine.async_engine import AsyncEngine

    args = build_parser().parse_args(["--quiet", "serve", "--device", "cpu", "--dtype", "float32",
                                      "--max-running", "8", "--no-prefix-cache"])
    engine = AsyncEngine(engine_from_args(args), name="tidal-cold-engine")
    assert engine.engine.scheduler.prefix_cache is None
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server(demo_async_engine):
    s = LiveServer(create_app(demo_async_engine, MODEL))
    yield s
    s.close()


@pytest.fixture(scope="session")
def cold_server(cold_async_engine):
    s = LiveServer(create_app(cold_async_engine, MODEL))
    yield s
    s.close()


@pytest.fixture(scope="session")
def auth_server(demo_async_engine):
    s = LiveServer(create_app(demo_async_engine, MODEL, api_key=API_KEY))
    yield s
    s.close()


@pytest.fixture
def live():
    """Start servers around fake engines: `live(app)`; all are closed after the test."""
    servers = []

    def start(app) -> LiveServer:
        servers.append(LiveServer(app))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def anthropic_client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` until it is true (used for engine state that changes on another thread)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def kv_pages_leaked(engine) -> str:
    """Why the engine's KV pages are not all accounted for, or "" when they are: no request is queued
    or running, and every page in use is held by exactly one reference, the prefix cache's (one per
    cached page). Read from another thread, so poll it (`wait_until(lambda: not kv_pages_leaked(e))`)."""
    sched = engine.scheduler
    if sched.waiting or sched.running:
        return f"{len(sched.waiting)} waiting and {len(sched.running)} running requests"
    alloc = sched.allocator
    refs = [alloc.refcount(p) for p in range(alloc.num_pages)]
    cached = sched.prefix_cache.num_pages if sched.prefix_cache is not None else 0
    used = alloc.num_pages - alloc.num_free
    if any(r > 1 for r in refs) or sum(refs) != cached or used != cached:
        return (f"{used} pages in use, {sum(refs)} references, max refcount {max(refs)}, "
                f"but the prefix cache holds only {cached} pages")
    return ""


def assert_kv_pages_released(async_engine) -> None:
    """Wait until every request has left the engine and its pages are free or held only by the cache."""
    deadline = time.monotonic() + 30
    while (why := kv_pages_leaked(async_engine.engine)):
        assert time.monotonic() < deadline, f"KV pages not released: {why}"
        time.sleep(0.02)
    assert async_engine.num_requests() == (0, 0)


def pick_stop(text: str) -> str:
    """A stop string that occurs in `text`: printable ASCII (the demo model's random output is mostly
    broken UTF-8), two characters if possible, preferring the middle so some text precedes it."""
    for width in (2, 1):
        for i in range(len(text) // 3, len(text) - width + 1):
            s = text[i:i + width]
            if all(32 < ord(ch) < 127 for ch in s):
                return s
    pytest.skip("the greedy output has no printable character to stop on")
