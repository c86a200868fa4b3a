"""Tool-call and reasoning parsers on synthetic model outputs, fed whole, split at every position,
and one character at a time: the events must not depend on how the text was cut into deltas."""
from __future__ import annotations

import json
import random

import pytest

from tidal.server.parsers import (OutputParser, ReasoningParser, Text, ToolCall,
                                  make_reasoning_parser, prompt_opens_reasoning, resolve_reasoning_parser,
                                  resolve_tool_parser)
from tidal.server.parsers.tool_parsers import HermesToolParser, MistralToolParser, Qwen3CoderToolParser

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "opts": {"type": "object"},
                                     "note": {"type": ["string", "null"]}}}}}]


def normalize(events) -> list:
    out = []
    for e in events:
        if isinstance(e, ToolCall):
            out.append(("call", e.name, json.loads(e.arguments)))
        elif out and out[-1][0] == ("text" if isinstance(e, Text) else "reasoning"):
            out[-1] = (out[-1][0], out[-1][1] + e.text)
        elif e.text:
            out.append(("text" if isinstance(e, Text) else "reasoning", e.text))
    return out


def run(make, pieces) -> list:
    p = make()
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    return normalize(events)


def splits(text: str):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check(make, text: str, expected: list) -> None:
    for pieces in splits(text):
        assert run(make, pieces) == expected, f"split {pieces!r}"


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

HERMES_CASES = [
    ("Hello there.\n", [("text", "Hello there.\n")]),
    ("Sure.\n\n<tool_call>\n" + CALL + "\n</tool_call>",
     [("text", "Sure."), ("call", "get_weather", {"city": "Paris"})]),
    ("<tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n"
     '{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}\n</tool_call>\nDone.',
     [("call", "get_weather", {"city": "Paris"}), ("call", "f", {"x": [1, 2]}), ("text", "Done.")]),
    ("a <tool b </tool_call> c", [("text", "a <tool b </tool_call> c")]),
    ("x <tool_call>{not json}</tool_call> y", [("text", "x <tool_call>{not json}</tool_call> y")]),
    ("<tool_call>\n" + CALL + "\n", [("call", "get_weather", {"city": "Paris"})]),   # ended by eos
    ("<tool_call>\n{\"name\": \"get_weather\", \"argum", [("text", "<tool_call>\n{\"name\": \"get_weather\", \"argum")]),
    ('Café ☕ <tool_call>{"name": "f", "arguments": {"q": "é"}}</tool_call>',
     [("text", "Café ☕"), ("call", "f", {"q": "é"})]),
]


@pytest.mark.parametrize("text,expected", HERMES_CASES)
def test_hermes(text, expected):
    check(HermesToolParser, text, expected)


XML_CASES = [
    ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
     "<parameter=opts>\n{\"a\": [1]}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
     "</function>\n</tool_call>",
     [("text", "Checking."), ("call", "get_weather",
                              {"city": "123", "days": 3, "metric": True, "opts": {"a": [1]}, "note": None})]),
    ("<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n</function>",
     [("call", "get_weather", {"city": "New\nYork"})]),
    ("<tool_call>\n<function=unknown_tool>\n<parameter=n>\n42\n</parameter>\n<parameter=w>\nhello\n</parameter>\n"
     "</function>\n</tool_call><tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
     "</function>\n</tool_call>",
     [("call", "unknown_tool", {"n": 42, "w": "hello"}), ("call", "get_weather", {"city": "Rome"})]),
    ("no calls <function here", [("text", "no calls <function here")]),
]


@pytest.mark.parametrize("text,expected", XML_CASES)
def test_qwen3_coder(text, expected):
    check(lambda: Qwen3CoderToolParser(WEATHER_TOOLS), text, expected)


MISTRAL_CASES = [
    ("[TOOL_CALLS][" + CALL + ', {"name": "f", "arguments": {}}]',
     [("call", "get_weather", {"city": "Paris"}), ("call", "f", {})]),
    ('Let me look. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}',
     [("text", "Let me look."), ("call", "get_weather", {"city": "Paris"}), ("call", "f", {})]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
     [("text", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par')]),
    ("plain [TOOL answer", [("text", "plain [TOOL answer")]),
]


@pytest.mark.parametrize("text,expected", MISTRAL_CASES)
def test_mistral(text, expected):
    check(MistralToolParser, text, expected)


def test_mistral_ids_are_nine_alphanumerics():
    p = MistralToolParser()
    calls = [e for e in p.feed('[TOOL_CALLS]f[ARGS]{"a": 1}') + p.finish() if isinstance(e, ToolCall)]
    assert len(calls) == 1 and len(calls[0].id) == 9 and calls[0].id.isalnum()


REASONING_CASES = [
    (False, "<think>\nLet me think.\n</think>\n\nThe answer is 4.", [("reasoning", "Let me think."),
                                                                     ("text", "The answer is 4.")]),
    (True, "Let me think.\n</think>\n\nThe answer.", [("reasoning", "Let me think."), ("text", "The answer.")]),
    (True, "<think>\nhmm</think>ok", [("reasoning", "hmm"), ("text", "ok")]),
    (False, "  plain answer, then <think> is just text ", [("text", "  plain answer, then <think> is just text ")]),
    (False, "<think>unfinished thought", [("reasoning", "unfinished thought")]),
    (False, "<think></think>\n\nanswer", [("text", "answer")]),
    (True, "still thinking <thi", [("reasoning", "still thinking <thi")]),
    (False, "<thin", [("text", "<thin")]),
    (False, "\n\n", [("text", "\n\n")]),
]


@pytest.mark.parametrize("in_reasoning,text,expected", REASONING_CASES)
def test_reasoning(in_reasoning, text, expected):
    check(lambda: ReasoningParser(in_reasoning), text, expected)


def test_reasoning_is_not_searched_for_tool_calls():
    text = "<think>I could emit <tool_call>" + CALL + "</tool_call> here.</think>\nOK.\n<tool_call>" + CALL + "</tool_call>"
    expected = [("reasoning", "I could emit <tool_call>" + CALL + "</tool_call> here."), ("text", "OK."),
                ("call", "get_weather", {"city": "Paris"})]
    check(lambda: OutputParser(ReasoningParser(), HermesToolParser()), text, expected)


def test_text_before_a_tag_streams_at_once():
    p = HermesToolParser()
    assert normalize(p.feed("Hello world <tool")) == [("text", "Hello world")]
    assert p.feed("_call>" + CALL) == []              # inside the call: nothing yet
    assert normalize(p.feed("</tool_call>")) == [("call", "get_weather", {"city": "Paris"})]
    r = ReasoningParser(in_reasoning=True)
    assert normalize(r.feed("step one </thi")) == [("reasoning", "step one")]
    assert normalize(r.feed("nk>answer")) == [("text", "answer")]


def test_forced_prefix_primes_the_parser():
    for cls, name, rest in [
        (HermesToolParser, "get_weather", '{"city": "Paris"}}\n</tool_call>'),
        (Qwen3CoderToolParser, "get_weather", "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    ]:
        p = cls(WEATHER_TOOLS)
        p.prime(p.forced_prefix(name))
        assert normalize(p.feed(rest) + p.finish()) == [("call", "get_weather", {"city": "Paris"})]


def test_prompt_decides_where_reasoning_starts():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert make_reasoning_parser("qwen3", "assistant\n<think>\n").in_reasoning
    assert not make_reasoning_parser("qwen3", "assistant\n").in_reasoning
    assert make_reasoning_parser("deepseek_r1", "<｜Assistant｜>").in_reasoning
    assert not make_reasoning_parser("deepseek_r1", "<think>\n\n</think>").in_reasoning
    assert make_reasoning_parser(None, "<think>") is None


def test_auto_detection_from_templates():
    assert resolve_tool_parser("auto", "{{ '<tool_call>' }}") == "hermes"
    assert resolve_tool_parser("auto", "<tool_call>\n<function=") == "qwen3_coder"
    assert resolve_tool_parser("auto", "[TOOL_CALLS]") == "mistral"
    assert resolve_tool_parser("auto", "plain chatml") is None
    assert resolve_tool_parser("none", "<tool_call>") is None
    assert resolve_tool_parser("mistral", "") == "mistral"
    assert resolve_reasoning_parser("auto", "{% if x %}<think>{% endif %}") == "qwen3"
    assert resolve_reasoning_parser("auto", "chatml") is None
    assert resolve_reasoning_parser("deepseek_r1", "") == "deepseek_r1"
