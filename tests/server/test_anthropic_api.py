"""Anthropic endpoints against the real engine (demo model), through the official `anthropic` client."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server.conftest import MODEL, pick_stop
from tidal.tokenizer.tokenizer import Tokenizer
from tidal.weights.demo import demo_model_path

SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "Say something."}]
# This SDK version has no sampling arguments; older clients send them and the server still honours them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def prompt_tokens():
    tok = Tokenizer.from_dir(demo_model_path())
    return len(tok.apply_chat_template([{"role": "system", "content": SYSTEM}, *MESSAGES], tokenize=True))


def test_message_non_streaming(anthropic_client, prompt_tokens):
    m = anthropic_client.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=6, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    # The demo model may end early by sampling its eos; either way the reason must match the length.
    assert (m.stop_reason, m.usage.output_tokens == 6) in (("max_tokens", True), ("end_turn", False))
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt_tokens
    assert m.usage.cache_creation_input_tokens == 0


def test_system_as_blocks_equals_system_as_string(anthropic_client):
    a = anthropic_client.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=5, **GREEDY)
    b = anthropic_client.messages.create(model=MODEL, system=[{"type": "text", "text": SYSTEM}],
                                         messages=MESSAGES, max_tokens=5, **GREEDY)
    assert a.content[0].text == b.content[0].text
    assert a.usage.input_tokens + a.usage.cache_read_input_tokens == \
        b.usage.input_tokens + b.usage.cache_read_input_tokens


def test_stream_event_sequence(server):
    """The documented order: message_start, content_block_start, ping, content_block_delta...,
    content_block_stop, message_delta, message_stop."""
    body = {"model": MODEL, "system": SYSTEM, "messages": MESSAGES, "max_tokens": 8, "stream": True, "temperature": 0}
    names, data = [], []
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                import json
                data.append(json.loads(line[6:]))
    assert [d["type"] for d in data] == names        # each event's name matches its payload type
    k = names.count("content_block_delta")
    assert k >= 1
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * k,
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(d["delta"]["type"] == "text_delta" for d in data if d["type"] == "content_block_delta")
    delta = data[-2]
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn") and delta["usage"]["output_tokens"] >= 1


def test_stream_matches_non_streaming(anthropic_client):
    whole = anthropic_client.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=8, **GREEDY)
    with anthropic_client.messages.stream(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=8,
                                          **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # How the prompt splits into cached and new tokens depends on what earlier requests left in the cache.
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_stop_sequences(anthropic_client):
    base = anthropic_client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    text = base.content[0].text
    stop = pick_stop(text)
    m = anthropic_client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=24, stop_sequences=["\x00\x01", stop],
                                         **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_count_tokens(anthropic_client, prompt_tokens):
    r = anthropic_client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MESSAGES)
    assert r.input_tokens == prompt_tokens


def test_multi_turn_with_thinking_and_tool_blocks(anthropic_client):
    """Assistant thinking/tool_use blocks and user tool_result blocks are accepted (the demo template
    ignores tools, so this checks the translation does not fail)."""
    m = anthropic_client.messages.create(model=MODEL, max_tokens=2, **GREEDY, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "P"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "thanks"}]},
    ], tools=[{"name": "w", "input_schema": {"type": "object", "properties": {"c": {"type": "string"}}}}])
    assert m.usage.output_tokens >= 1


@pytest.mark.parametrize("change,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                              "data": "AAAA"}}]}]}, "image"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_bad_requests(anthropic_client, change, field):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **change}
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert field in e.value.body["error"]["message"]
    ok = anthropic_client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=1, **GREEDY)
    assert ok.usage.output_tokens == 1
