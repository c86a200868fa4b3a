"""OpenAI endpoints against the real engine (demo model), through the official `openai` client.

The demo model's text is random, so these check protocol properties: shapes, token counts against an
independent tokenization of the prompt, greedy determinism, stop-string semantics, seeds, logprobs.
"""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.server.conftest import MODEL, pick_stop
from tidal.tokenizer.tokenizer import Tokenizer
from tidal.weights.demo import demo_model_path

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(demo_model_path())


def prompt_len(tokenizer, messages) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def test_models(openai_client):
    models = openai_client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_non_streaming(openai_client, tokenizer):
    r = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, **GREEDY)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_len(tokenizer, MESSAGES)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens


def test_chat_streaming_matches_non_streaming(openai_client):
    whole = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, **GREEDY)
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, stream=True,
                                                        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content           # greedy: same tokens either way
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 6
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_stream_without_usage_has_no_usage_chunk(openai_client):
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
                                                        **GREEDY))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_stop_string(openai_client):
    base = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    text = base.choices[0].message.content
    stop = pick_stop(text)
    r = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, stop=stop, stream=True, **GREEDY) if c.choices)
    assert streamed == text[:text.index(stop)]


def test_seed_reproducibility(openai_client):
    def sample(seed):
        return openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0,
                                                     seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content
    a, b, c = sample(1234), sample(1234), sample(999)
    assert a == b
    assert a != c


def test_chat_logprobs(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                              top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.token, str) and isinstance(entry.bytes, list)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])      # greedy picks the most likely token
    streamed = [lp for c in openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2, stream=True, **GREEDY)
        if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(streamed) == 5 and all(len(e.top_logprobs) == 2 for e in streamed)


def test_completions(openai_client, tokenizer):
    prompt = "def fibonacci(n):"
    r = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, **GREEDY)
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens == 5
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    stream = list(openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, stream=True,
                                                   stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text
    assert stream[-1].usage.completion_tokens == 5
    ids = openai_client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt), max_tokens=5, **GREEDY)
    assert ids.choices[0].text == choice.text                 # token-id prompts mean the same
    echo = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, **GREEDY)
    assert echo.choices[0].text == prompt + choice.text


def test_json_mode_instructs_the_model(openai_client, tokenizer):
    r = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                              response_format={"type": "json_object"}, **GREEDY)
    # The instruction went into the system prompt, so the prompt is longer than the plain one.
    assert r.usage.prompt_tokens > prompt_len(tokenizer, MESSAGES)


def test_concurrent_requests(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def one(i):
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=4 + i % 3, **GREEDY)

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r.usage.completion_tokens for r in results] == [4 + i % 3 for i in range(6)]
    assert len({r.id for r in results}) == 6


@pytest.mark.parametrize("change,field", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"temperature": 7}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"messages": []}, "messages"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image"),
    ({"n": 2}, "n"),
])
def test_bad_requests_are_400_naming_the_field(openai_client, change, field):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **change}
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(**body)
    assert e.value.status_code == 400
    err = e.value.body
    assert field in err["message"] and err["type"] == "invalid_request_error"
    # ... and the server keeps serving.
    ok = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **GREEDY)
    assert ok.usage.completion_tokens == 1


def test_prompt_too_long_is_400(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=MODEL, prompt=[65] * 5000, max_tokens=1)
    assert "prompt" in e.value.body["message"]


def test_extra_fields_are_ignored(server):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0, "some_future_field": {"x": 1},
        "metadata": {"a": "b"}, "store": False})
    assert r.status_code == 200, r.text
    bad = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]


def test_responses_api(openai_client):
    r = openai_client.responses.create(model=MODEL, input="Say something.", instructions="Be terse.",
                                       max_output_tokens=5, temperature=0)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.usage.total_tokens == r.usage.input_tokens + 5
    message = [o for o in r.output if o.type == "message"][0]
    events = list(openai_client.responses.create(model=MODEL, input="Say something.", instructions="Be terse.",
                                                 max_output_tokens=5, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == message.content[0].text == r.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text


def test_responses_rejects_previous_response_id(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in e.value.body["message"]


def test_json_error_shape_for_unknown_route(server):
    import httpx

    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    body = json.loads(httpx.post(server.url + "/v1/messages", json={}).text)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


def test_model_listing_serves_both_sdks(server, openai_client):
    import anthropic

    assert openai_client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("other-model")
    listed = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).models.list()
    assert [m.id for m in listed.data] == [MODEL]


def test_content_parts_and_developer_role_render_like_plain_messages(openai_client):
    plain = openai_client.chat.completions.create(model=MODEL, max_tokens=3, **GREEDY, messages=[
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say\nsomething."}])
    parts = openai_client.chat.completions.create(model=MODEL, max_tokens=3, **GREEDY, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}]}])
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content
