"""Bad input gets the right 4xx in each API's error shape, and the server keeps serving.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
After every bad request a normal one must succeed and no KV page may be left held by a request.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, assert_kv_pages_released
from tests.server.fakes import demo_tokenizer

MESSAGES = [{"role": "user", "content": "Say something."}]
OPENAI_CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
ANTHROPIC_MSG = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}


@pytest.fixture
def still_serving(openai_client, anthropic_client, demo_async_engine):
    """Call after a bad request: both APIs answer a normal request, and no request holds KV pages."""
    def check() -> None:
        r = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                                  extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
        m = anthropic_client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                             extra_body={"temperature": 0})
        assert m.usage.output_tokens == 1
        assert_kv_pages_released(demo_async_engine)
    return check


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def anthropic_error(r: httpx.Response, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind
    return body["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                  "/v1/messages/count_tokens"])
@pytest.mark.parametrize("raw", [b'{"model": "x", "messages": [', b"not json at all", b""])
def test_malformed_json(server, still_serving, path, raw):
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
    if path.startswith("/v1/messages"):
        err = anthropic_error(r, 400, "invalid_request_error")
    else:
        err = openai_error(r, 400)
        assert err["type"] == "invalid_request_error"
    assert "JSON" in err["message"], err
    still_serving()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize("headers", [{}, {"content-type": "application/x-www-form-urlencoded"},
                                     {"content-type": "text/plain"}])
def test_json_without_a_json_content_type_is_400_saying_so(server, still_serving, path, headers):
    body = OPENAI_CHAT if path == "/v1/chat/completions" else ANTHROPIC_MSG
    r = httpx.post(server.url + path, content=json.dumps(body).encode(), headers=headers)
    err = anthropic_error(r, 400, "invalid_request_error") if path == "/v1/messages" else openai_error(r, 400)
    assert "Content-Type: application/json" in err["message"], err
    still_serving()


@pytest.mark.parametrize("change,field", [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": 7}, "stop"),
    ({"stream": "maybe"}, "stream"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"model": 3}, "model"),
])
def test_openai_wrong_types_are_400_naming_the_field(server, still_serving, change, field):
    r = httpx.post(server.url + "/v1/chat/completions", json={**OPENAI_CHAT, **change})
    err = openai_error(r, 400)
    assert err["type"] == "invalid_request_error" and field in err["message"], err
    still_serving()


@pytest.mark.parametrize("change,field", [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": {"role": "user"}}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"system": 5}, "system"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream": "maybe"}, "stream"),
])
def test_anthropic_wrong_types_are_400_naming_the_field(server, still_serving, change, field):
    r = httpx.post(server.url + "/v1/messages", json={**ANTHROPIC_MSG, **change})
    err = anthropic_error(r, 400, "invalid_request_error")
    assert field in err["message"], err
    still_serving()


def test_a_json_body_that_is_not_an_object(server, still_serving):
    err = openai_error(httpx.post(server.url + "/v1/chat/completions", json=[1, 2]), 400)
    assert err["type"] == "invalid_request_error"
    anthropic_error(httpx.post(server.url + "/v1/messages", json="hi"), 400, "invalid_request_error")
    still_serving()


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404_naming_it(server, openai_client, anthropic_client, still_serving, stream):
    other = "gpt-nonexistent-1"
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.chat.completions.create(model=other, messages=MESSAGES, max_tokens=2, stream=stream)
    err = e.value.body
    assert e.value.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert other in err["message"] and MODEL in err["message"]
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.completions.create(model=other, prompt="hi", max_tokens=2, stream=stream)
    assert e.value.body["code"] == "model_not_found" and other in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.responses.create(model=other, input="hi", max_output_tokens=2, stream=stream)
    assert e.value.body["code"] == "model_not_found" and other in e.value.body["message"]

    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic_client.messages.create(model=other, messages=MESSAGES, max_tokens=2, stream=stream)
    assert e.value.status_code == 404
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert other in e.value.body["error"]["message"] and MODEL in e.value.body["error"]["message"]
    if not stream:
        with pytest.raises(anthropic.NotFoundError) as e:
            anthropic_client.messages.count_tokens(model=other, messages=MESSAGES)
        assert e.value.body["error"]["type"] == "not_found_error"
    still_serving()


@pytest.fixture(scope="module")
def too_long(demo_async_engine):
    """A user message whose prompt is longer than the context, and the context length."""
    limit = demo_async_engine.max_model_len
    content = " ".join(f"word{i}" for i in range(limit))
    n = len(demo_tokenizer().apply_chat_template([{"role": "user", "content": content}],
                                                 add_generation_prompt=True, tokenize=True))
    assert n > limit
    return content, limit


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context_is_400_naming_the_limit(openai_client, anthropic_client, still_serving,
                                                                 too_long, stream):
    content, limit = too_long
    messages = [{"role": "user", "content": content}]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=stream)
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["code"] == "context_length_exceeded"
    assert str(limit) in e.value.body["message"] and "prompt" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=MODEL, prompt=content, max_tokens=2, stream=stream)
    assert str(limit) in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=MODEL, messages=messages, max_tokens=2, stream=stream)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert str(limit) in e.value.body["error"]["message"]
    still_serving()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
                                     {"Authorization": "Basic " + API_KEY}])
def test_bad_api_key_is_401_in_each_shape(auth_server, still_serving, headers):
    url = auth_server.url
    err = openai_error(httpx.post(url + "/v1/chat/completions", json={**OPENAI_CHAT, "stream": True},
                                  headers=headers), 401)
    assert err["type"] == "authentication_error"
    anthropic_error(httpx.post(url + "/v1/messages", json={**ANTHROPIC_MSG, "stream": True}, headers=headers),
                    401, "authentication_error")
    good = httpx.post(url + "/v1/chat/completions", json=OPENAI_CHAT, headers={"x-api-key": API_KEY})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    still_serving()
