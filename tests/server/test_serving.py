"""Serving behaviour: disconnects abort requests, auth, health, metrics, keep-alives."""
from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, assert_kv_pages_released, wait_until
from tests.server.fakes import FakeEngine, demo_tokenizer
from tidal.server.app import create_app

LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def aborted(engine) -> int:
    return engine.metrics()["requests_finished"].get("abort", 0)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}], "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "go on"}], "stream": True}),
    ("/v1/responses", {"input": "go on", "stream": True, "max_output_tokens": 3000}),
])
def test_client_disconnect_mid_stream_aborts(server, demo_async_engine, openai_client, path, body):
    assert_kv_pages_released(demo_async_engine)
    before = aborted(demo_async_engine)
    with httpx.stream("POST", server.url + path, json={"model": MODEL, **LONG, **body}, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen >= 4:
                break   # leave mid-stream: closing the response drops the connection
    wait_until(lambda: aborted(demo_async_engine) > before and not demo_async_engine.engine.has_unfinished(),
               what="the request to be aborted")
    # Its pages are free again, or held only by the prefix cache (what it computed is reusable).
    assert_kv_pages_released(demo_async_engine)
    ok = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_client_disconnect_before_non_streaming_reply_aborts(server, demo_async_engine):
    before = aborted(demo_async_engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", timeout=httpx.Timeout(10.0, read=0.5),
                   json={"model": MODEL, "messages": [{"role": "user", "content": "go on"}], **LONG})
    wait_until(lambda: aborted(demo_async_engine) > before and not demo_async_engine.engine.has_unfinished(),
               what="the request to be aborted")
    assert_kv_pages_released(demo_async_engine)


def test_openai_client_closing_stream_aborts(server, demo_async_engine, openai_client):
    before = aborted(demo_async_engine)
    stream = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                   stream=True, max_tokens=3000, temperature=0,
                                                   extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_until(lambda: aborted(demo_async_engine) > before and not demo_async_engine.engine.has_unfinished(),
               what="the request to be aborted")
    assert_kv_pages_released(demo_async_engine)


def test_auth(auth_server):
    url = auth_server.url
    assert httpx.get(url + "/health").status_code == 200             # open for health checks
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                        max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": e.value.body["error"]["message"]}}
    for client in (anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0),          # x-api-key
                   anthropic.Anthropic(base_url=url, auth_token=API_KEY, max_retries=0)):     # Bearer
        assert client.messages.create(model=MODEL, max_tokens=1,
                                      messages=[{"role": "user", "content": "x"}]).usage.output_tokens == 1
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + r"\{[^}]*" + re.escape(labels) + r"[^}]*\} (\S+)"
    m = re.search(pattern, text)
    assert m, f"{name} missing"
    return float(m.group(1))


def test_metrics(server, openai_client):
    before = httpx.get(server.url + "/metrics").text
    openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=7,
                                          temperature=0, extra_body={"ignore_eos": True})
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = r.text
    assert _metric(after, "tidal_generation_tokens_total") - _metric(before, "tidal_generation_tokens_total") == 7
    assert _metric(after, "tidal_time_to_first_token_seconds_count") == \
        _metric(before, "tidal_time_to_first_token_seconds_count") + 1
    assert _metric(after, "tidal_inter_token_latency_seconds_count") >= \
        _metric(before, "tidal_inter_token_latency_seconds_count") + 6
    assert _metric(after, "tidal_time_to_first_token_seconds_bucket", 'le="+Inf"') == \
        _metric(after, "tidal_time_to_first_token_seconds_count")
    assert _metric(after, "tidal_requests_running") == 0
    for name in ("tidal_requests_waiting", "tidal_prefix_cache_hit_tokens_total", "tidal_generation_tokens_per_second",
                 "tidal_prompt_tokens_total"):
        assert _metric(after, name) >= 0
    for line in after.splitlines():   # every sample line is `name{labels} number`
        assert line.startswith("#") or re.fullmatch(r"[a-z_]+\{[^}]*\} [-+0-9.eInf]+", line), line


def test_keepalive_during_slow_first_token(live):
    engine = FakeEngine(demo_tokenizer(), "hello", first_token_delay=1.0)
    srv = live(create_app(engine, MODEL, keepalive_s=0.15))
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    first_content = next(i for i, line in enumerate(lines) if '"content":"h' in line)
    assert ": keep-alive" in lines[:first_content]
    with httpx.stream("POST", srv.url + "/v1/messages", timeout=30, json={
            "model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    first_block = events.index("content_block_start")
    assert events[0] == "message_start" and events[1:first_block].count("ping") >= 2
    assert events[-1] == "message_stop"


def test_engine_error_mid_stream_is_reported_in_each_api_shape(live):
    script = "hello world, this fails after a few tokens"
    engine = FakeEngine(demo_tokenizer(), script, fail_after=2)
    assert len(engine.tokenizer.encode(script, add_special_tokens=False)) > 3   # it fails before the end
    srv = live(create_app(engine, MODEL))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True))
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.APIError):
        with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0).messages.stream(
                model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "x"}]) as s:
            s.get_final_message()
    engine.fail_after = None
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert ok.choices[0].message.content == script
