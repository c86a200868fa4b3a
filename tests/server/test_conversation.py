"""Multi-turn conversations on the real engine: the second turn reuses the first turn's KV pages.

Turn 2 of a conversation starts with turn 1's prompt and reply, so the prefix cache should serve those
pages and the server should report them (OpenAI `prompt_tokens_details.cached_tokens`, Anthropic
`cache_read_input_tokens`). The expected reuse is a lower bound computed here from an independent
tokenization: the full pages of the longest common prefix of what turn 1 computed and turn 2's prompt.
Outputs are compared with a second engine that has no prefix cache (`--no-prefix-cache`): reusing
pages must not change a single token.

Tool calls, tool results and thinking blocks are rendered by a Hermes/Qwen-style template put in front
of the real engine (the demo model's own ChatML template ignores them), so they are part of the
shared prefix too.
"""
from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, assert_kv_pages_released
from tests.server.fakes import HERMES_TEMPLATE, demo_tokenizer
from tidal.server.app import create_app

# A few hundred characters of system prompt: the shared prefix spans many 16-token pages.
SYSTEM = ("You are the coding assistant of a small team that maintains a Python library for parsing "
          "log files. Answer with short, correct Python code and one sentence of explanation. Prefer the "
          "standard library, name things clearly, and never invent functions that do not exist. When a "
          "question is ambiguous, pick the most common interpretation and say which one you picked.")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# This anthropic SDK has no sampling arguments; the server reads them from the body.
GREEDY = {"extra_body": {"temperature": 0}}
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather for a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


class Templated:
    """The real AsyncEngine behind a different chat template (same vocabulary, same model)."""

    def __init__(self, inner, tokenizer):
        self._inner, self.tokenizer = inner, tokenizer

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


@pytest.fixture(scope="module")
def hermes_tok():
    return demo_tokenizer(HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def page_size(demo_async_engine):
    return demo_async_engine.engine.config.page_size


def clients(url: str):
    return (openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60))


@pytest.fixture(scope="module")
def cold(cold_server):
    """(openai, anthropic) clients of the server without a prefix cache."""
    return clients(cold_server.url)


@pytest.fixture(scope="module")
def hermes(demo_async_engine, cold_async_engine, hermes_tok):
    """(warm openai, warm anthropic, cold openai, cold anthropic) clients of servers rendering tools."""
    warm = LiveServer(create_app(Templated(demo_async_engine, hermes_tok), MODEL))
    cold = LiveServer(create_app(Templated(cold_async_engine, hermes_tok), MODEL))
    yield (*clients(warm.url), *clients(cold.url))
    warm.close()
    cold.close()


def calls(r) -> list:
    """An OpenAI reply's tool calls without their (random) ids."""
    return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]


def blocks(m) -> list:
    """An Anthropic reply's content blocks without tool_use ids."""
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in m.content]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reuse_bound(computed: list[int], prompt: list[int], page_size: int) -> int:
    """Tokens of `prompt` that the cache must serve once `computed` (token ids whose KV an earlier
    request computed) is cached: the full pages of their common prefix; at least one prompt token is
    always computed anew, to sample from."""
    return min(common_prefix(computed, prompt), len(prompt) - 1) // page_size * page_size


def turn1_computed(tok, prompt: list[int], reply: str, completion_tokens: int) -> list[int]:
    """What turn 1 computed: its prompt and all reply tokens but the last sampled one (never fed back).
    The reply tokens are the reply text re-tokenized; check that this is plausibly what was generated."""
    ids = tok.encode(reply, add_special_tokens=False)
    assert len(ids) in (completion_tokens, completion_tokens - 1), "the reply does not re-tokenize to its tokens"
    return (prompt + ids)[:len(prompt) + completion_tokens - 1]


def test_openai_second_turn_reuses_the_first(openai_client, cold, tok, page_size, demo_async_engine):
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Write a function that counts the lines of a log file."}]
    r1 = openai_client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=40, temperature=0)
    reply = r1.choices[0].message.content
    p1 = tok.apply_chat_template(turn1, add_generation_prompt=True, tokenize=True)
    assert r1.usage.prompt_tokens == len(p1)

    turn2 = turn1 + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "Now make it skip empty lines."}]
    p2 = tok.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True)
    bound = reuse_bound(turn1_computed(tok, p1, reply, r1.usage.completion_tokens), p2, page_size)
    assert bound >= len(p1) // page_size * page_size > 0   # all of turn 1's prompt pages, at least

    kw = dict(model=MODEL, messages=turn2, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    r2 = openai_client.chat.completions.create(**kw)
    reference = cold[0].chat.completions.create(**kw)
    assert r2.usage.prompt_tokens == reference.usage.prompt_tokens == len(p2)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert bound <= cached < len(p2) and cached % page_size == 0
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == reference.choices[0].message.content
    assert r2.usage.completion_tokens == reference.usage.completion_tokens == 24

    # Streamed, with usage: the same tokens and at least the same reuse (turn 2 itself is cached now).
    chunks = list(openai_client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reference.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
    assert_kv_pages_released(demo_async_engine)


def test_anthropic_second_turn_reuses_the_first(anthropic_client, cold, tok, page_size):
    user1 = {"role": "user", "content": "Write a function that finds the longest line in a log file."}
    m1 = anthropic_client.messages.create(model=MODEL, system=SYSTEM, messages=[user1], max_tokens=40, **GREEDY)
    reply = m1.content[0].text
    p1 = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, user1], add_generation_prompt=True,
                                 tokenize=True)
    assert m1.usage.input_tokens + m1.usage.cache_read_input_tokens == len(p1)

    turn2 = [user1, {"role": "assistant", "content": reply},
             {"role": "user", "content": "Now return its line number too."}]
    p2 = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, *turn2], add_generation_prompt=True,
                                 tokenize=True)
    bound = reuse_bound(turn1_computed(tok, p1, reply, m1.usage.output_tokens), p2, page_size)
    assert bound >= len(p1) // page_size * page_size > 0

    kw = dict(model=MODEL, system=SYSTEM, messages=turn2, max_tokens=24, **GREEDY)
    m2 = anthropic_client.messages.create(**kw)
    reference = cold[1].messages.create(**kw)
    # Anthropic's accounting: input_tokens are the prompt tokens not read from the cache.
    assert bound <= m2.usage.cache_read_input_tokens < len(p2)
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == len(p2)
    assert (reference.usage.input_tokens, reference.usage.cache_read_input_tokens) == (len(p2), 0)
    assert m2.content[0].text == reference.content[0].text
    assert (m2.stop_reason, m2.usage.output_tokens) == (reference.stop_reason, reference.usage.output_tokens)

    with anthropic_client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == reference.content[0].text
    assert final.usage.cache_read_input_tokens >= m2.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(p2)


def test_openai_conversation_with_tool_calls_results_and_reasoning(hermes, hermes_tok, page_size):
    client, _, cold_client, _ = hermes
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "", "reasoning_content": "The user wants the weather: use the tool.",
              "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r1 = client.chat.completions.create(model=MODEL, messages=turn1, tools=TOOLS, max_tokens=24, temperature=0)
    reply = r1.choices[0].message.content or ""

    # What the template must have rendered: the call (arguments as an object) and its result.
    rendered = [*turn1[:2], {**turn1[2], "tool_calls": [{**call, "function": {"name": "get_weather",
                                                                              "arguments": {"city": "Paris"}}}]},
                turn1[3]]
    text1 = hermes_tok.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<think>\nThe user wants the weather: use the tool.\n</think>" in text1
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text1
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text1
    p1 = hermes_tok.encode(text1, add_special_tokens=False)
    assert r1.usage.prompt_tokens == len(p1)

    turn2 = turn1 + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "And in Lyon?"}]
    p2 = hermes_tok.apply_chat_template(rendered + turn2[4:], tools=TOOLS, add_generation_prompt=True,
                                        tokenize=True)
    # Turn 1's prompt is computed whole; its reply may have been reformatted by the output parsers.
    bound = reuse_bound(p1, p2, page_size)
    assert bound >= len(p1) // page_size * page_size > 0

    kw = dict(model=MODEL, messages=turn2, tools=TOOLS, max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    r2 = client.chat.completions.create(**kw)
    reference = cold_client.chat.completions.create(**kw)
    assert r2.usage.prompt_tokens == reference.usage.prompt_tokens == len(p2)
    assert bound <= r2.usage.prompt_tokens_details.cached_tokens < len(p2)
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == reference.choices[0].message.content
    assert calls(r2) == calls(reference)


def test_anthropic_conversation_with_tool_use_results_and_thinking(hermes, hermes_tok, page_size):
    _, client, _, cold_client = hermes
    turn1 = [{"role": "user", "content": "What is the weather in Oslo?"},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "I need the weather tool.", "signature": "sig"},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "snow, -3 C"}]}]}]
    m1 = client.messages.create(model=MODEL, system=SYSTEM, messages=turn1, tools=ANTHROPIC_TOOLS, max_tokens=24,
                                **GREEDY)
    reply = "".join(b.text for b in m1.content if b.type == "text")

    rendered = [{"role": "system", "content": SYSTEM}, turn1[0],
                {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
                 "tool_calls": [{"id": "toolu_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "snow, -3 C"}]
    text1 = hermes_tok.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    p1 = hermes_tok.encode(text1, add_special_tokens=False)
    assert m1.usage.input_tokens + m1.usage.cache_read_input_tokens == len(p1)

    turn2 = turn1 + [{"role": "assistant", "content": [{"type": "text", "text": reply}]},
                     {"role": "user", "content": "And tomorrow?"}]
    p2 = hermes_tok.apply_chat_template(rendered + [{"role": "assistant", "content": reply},
                                                    {"role": "user", "content": "And tomorrow?"}],
                                        tools=TOOLS, add_generation_prompt=True, tokenize=True)
    bound = reuse_bound(p1, p2, page_size)
    assert bound >= len(p1) // page_size * page_size > 0

    kw = dict(model=MODEL, system=SYSTEM, messages=turn2, tools=ANTHROPIC_TOOLS, max_tokens=16, **GREEDY)
    m2 = client.messages.create(**kw)
    reference = cold_client.messages.create(**kw)
    assert bound <= m2.usage.cache_read_input_tokens < len(p2)
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == len(p2)
    assert (reference.usage.input_tokens, reference.usage.cache_read_input_tokens) == (len(p2), 0)
    assert blocks(m2) == blocks(reference)
    assert (m2.stop_reason, m2.usage.output_tokens) == (reference.stop_reason, reference.usage.output_tokens)
