"""Tool calls and reasoning end to end: a fake engine replays scripted model output through the real
tokenizer and a Hermes/Qwen-style chat template; the official clients must see structured results."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.fakes import HERMES_TEMPLATE, XML_TEMPLATE, FakeEngine, demo_tokenizer, hermes_call
from tidal.server.app import create_app

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
USER = [{"role": "user", "content": "Weather in Paris?"}]

REASONING = "The user wants the weather. I should call get_weather."
SCRIPT = (f"<think>\n{REASONING}\n</think>\n\nLet me check.\n\n"
          + hermes_call("get_weather", {"city": "Paris", "days": 2}) + "\n"
          + hermes_call("get_weather", {"city": "Lyon"}))
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Lyon"})]


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer(HERMES_TEMPLATE)


@pytest.fixture
def fake(tokenizer, live):
    """(engine, openai client, anthropic client) around a fake engine replaying SCRIPT 3 tokens a step."""
    engine = FakeEngine(tokenizer, SCRIPT, tokens_per_step=3)
    srv = live(create_app(engine, MODEL))   # parsers chosen by "auto" from the template
    return (engine, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0))


def openai_calls(tool_calls) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def test_openai_tool_calls_and_reasoning(fake):
    engine, client, _ = fake
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert openai_calls(msg.tool_calls) == CALLS
    assert len({c.id for c in msg.tool_calls}) == 2 and all(c.type == "function" for c in msg.tool_calls)
    assert msg.content == "Let me check."
    assert msg.model_extra["reasoning_content"] == REASONING
    assert "get_weather" in engine.prompts[-1] and "<tools>" in engine.prompts[-1]   # tools were rendered


def test_openai_streaming_tool_calls_and_reasoning(fake):
    _, client, _ = fake
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or tc.id
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert reasoning == REASONING and content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == CALLS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The SDK's own stream accumulator agrees.
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=TOOLS) as s:
        final = s.get_final_completion()
    assert openai_calls(final.choices[0].message.tool_calls) == CALLS


def test_parallel_tool_calls_false_keeps_the_first(fake):
    _, client, _ = fake
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, parallel_tool_calls=False)
    assert openai_calls(r.choices[0].message.tool_calls) == CALLS[:1]


def test_tool_choice_required_and_named_force_a_call(fake):
    engine, client, _ = fake
    engine.script = '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required")
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n<tool_call>\n")
    assert openai_calls(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Oslo"})]
    engine.script = '{"city": "Oslo"}}\n</tool_call>'
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert engine.prompts[-1].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert openai_calls(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Oslo"})]
    assert r.choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "nope" in e.value.body["message"]


def test_tool_choice_none_hides_tools_and_parses_nothing(fake):
    engine, client, _ = fake
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in engine.prompts[-1]
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "<tool_call>" in r.choices[0].message.content


def test_tool_results_round_trip_into_the_prompt(fake):
    engine, client, _ = fake
    engine.script = "It is sunny."
    client.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}])
    prompt = engine.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt


def test_anthropic_tool_use_and_thinking(fake):
    _, _, client = fake
    m = client.messages.create(model=MODEL, max_tokens=1000, messages=USER, tools=ANTHROPIC_TOOLS)
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert m.content[0].thinking == REASONING and m.content[1].text == "Let me check."
    assert [(b.name, b.input) for b in m.content[2:]] == CALLS
    assert m.content[2].id != m.content[3].id


def test_anthropic_streaming_tool_use_and_thinking(fake):
    _, _, client = fake
    with client.messages.stream(model=MODEL, max_tokens=1000, messages=USER, tools=ANTHROPIC_TOOLS) as s:
        events = [e.type for e in s]   # the SDK's higher-level events; raw types checked below
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == REASONING and final.content[1].text == "Let me check."
    assert [(b.name, b.input) for b in final.content[2:]] == CALLS
    assert "thinking" in events and "text" in events and "input_json" in events

    raw = [e for e in client.messages.create(model=MODEL, max_tokens=1000, messages=USER, tools=ANTHROPIC_TOOLS,
                                             stream=True)]
    kinds = [e.type if e.type != "content_block_delta" else e.delta.type for e in raw]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    # (the SDK drops `ping` events; test_anthropic_api checks them on the raw stream)
    assert collapsed == ["message_start",
                         "content_block_start", "thinking_delta", "signature_delta", "content_block_stop",
                         "content_block_start", "text_delta", "content_block_stop",
                         "content_block_start", "input_json_delta", "content_block_stop",
                         "content_block_start", "input_json_delta", "content_block_stop",
                         "message_delta", "message_stop"]
    assert [e.index for e in raw if e.type == "content_block_start"] == [0, 1, 2, 3]


def test_anthropic_thinking_switch_and_tool_choice(fake):
    engine, _, client = fake
    engine.script = "Plain answer."
    client.messages.create(model=MODEL, max_tokens=100, messages=USER, thinking={"type": "disabled"})
    assert engine.prompts[-1].endswith("<think>\n\n</think>\n\n")    # the template closed reasoning
    engine.script = '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    m = client.messages.create(model=MODEL, max_tokens=100, messages=USER, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "any"})
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Oslo"})]


def test_anthropic_tool_result_round_trip(fake):
    engine, _, client = fake
    engine.script = "Sunny."
    client.messages.create(model=MODEL, max_tokens=100, tools=ANTHROPIC_TOOLS, messages=[
        *USER,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "call it", "signature": "sig"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]}]}])
    prompt = engine.prompts[-1]
    assert "<think>\ncall it\n</think>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_responses_api_function_calls_and_reasoning(fake):
    engine, client, _ = fake
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call", "function_call"]
    assert r.output[0].content[0].text == REASONING and r.output[1].content[0].text == "Let me check."
    assert [(o.name, json.loads(o.arguments)) for o in r.output[2:]] == CALLS
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "function_call"]
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in args] == [a for _, a in CALLS]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    # A follow-up turn carrying the calls and their outputs renders them into the prompt.
    engine.script = "Sunny in both."
    call = final.output[2]
    client.responses.create(model=MODEL, tools=tools, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in engine.prompts[-1]
    assert "<tool_response>\nsunny\n</tool_response>" in engine.prompts[-1]


def test_xml_tool_calls_are_detected_from_the_template(live):
    engine = FakeEngine(demo_tokenizer(XML_TEMPLATE), "Checking.\n<tool_call>\n<function=get_weather>\n"
                        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                        "</function>\n</tool_call>", tokens_per_step=2)
    srv = live(create_app(engine, MODEL))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    assert r.choices[0].message.content == "Checking."
    assert openai_calls(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris", "days": 3})]


def test_json_mode_returns_the_json_object(fake):
    engine, client, _ = fake
    engine.script = 'Here you go:\n```json\n{"a": 1, "b": [true, null]}\n```'
    r = client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "json_object"})
    assert json.loads(r.choices[0].message.content) == {"a": 1, "b": [True, None]}
    assert "JSON" in engine.prompts[-1]
