"""`tidal serve` (as a real process) and `tidal chat --url` (the terminal client)."""
from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import MODEL
from tests.server.fakes import HERMES_TEMPLATE, FakeEngine, demo_tokenizer
from tidal.server.app import create_app
from tidal.server.client_chat import chat_with_server, stream_reply
from tidal.server.serve import add_serve_parser



def parse(argv):
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(dest="command"))
    return p.parse_args(argv)


def test_serve_flags():
    args = parse(["serve"])
    assert (args.host, args.port, args.tool_parser, args.reasoning_parser) == ("127.0.0.1", 8000, "auto", "auto")
    assert args.api_key is None and args.model is None and args.no_prefix_cache is False
    assert parse(["serve", "--no-prefix-cache"]).no_prefix_cache is True
    args = parse(["serve", "--port", "9000", "--tool-parser", "qwen3_coder", "--api-key", "k",
                  "--served-model-name", "m", "--reasoning-parser", "deepseek_r1"])
    assert (args.port, args.tool_parser, args.api_key, args.served_model_name) == (9000, "qwen3_coder", "k", "m")
    with pytest.raises(SystemExit):
        parse(["serve", "--tool-parser", "nonsense"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_with_api_key_from_environment():
    port = _free_port()
    env = {**os.environ, "TIDAL_API_KEY": "env-key", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tidal", "serve", "--device", "cpu", "--dtype", "float32",
                             "--port", str(port), "--served-model-name", "served"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:   # poll /health until the process serves
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "tidal serve did not come up"
            time.sleep(0.05)
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer env-key"}).json()
        assert [m["id"] for m in models["data"]] == ["served"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status reports it.
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in out, out


def test_chat_client_streams_reasoning_and_content(live, monkeypatch, capsys):
    engine = FakeEngine(demo_tokenizer(HERMES_TEMPLATE), "<think>hmm</think>Hello there!", tokens_per_step=2)
    srv = live(create_app(engine, MODEL))
    with httpx.Client() as client:
        out = io.StringIO()
        content, reasoning = stream_reply(client, srv.url + "/v1", {"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}]}, out=out)
    assert (content, reasoning) == ("Hello there!", "hmm")
    assert out.getvalue() == "hmm\nHello there!"

    lines = iter(["hi", "again"])   # then EOF, which quits
    monkeypatch.setattr("builtins.input", lambda prompt="": _next_or_eof(lines))
    args = argparse.Namespace(url=srv.url, system="Be nice.", max_tokens=50, temperature=0.0, top_p=1.0, top_k=0,
                              min_p=0.0, repetition_penalty=1.0, seed=None, stop=[], ignore_eos=False)
    assert chat_with_server(args) == 0
    assert capsys.readouterr().out.count("Hello there!") == 2
    # The second turn carried the first exchange (without its reasoning) and the system prompt.
    assert "Be nice." in engine.prompts[-1] and "Hello there!" in engine.prompts[-1]
    assert "hmm" not in engine.prompts[-1]


def _next_or_eof(it):
    try:
        return next(it)
    except StopIteration:
        raise EOFError from None
