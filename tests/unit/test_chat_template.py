"""Chat template rendering vs transformers' apply_chat_template, on templates written here that mimic
the structure of real ones (Qwen3-style ChatML with tools and thinking, Mixtral-style [INST], a plain
bos_token one), over conversations with system prompts, tool calls, tool results and unicode."""
from __future__ import annotations

import copy

import pytest
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

from tidal.errors import ConfigError, RequestError, TidalError
from tidal.tokenizer.chat_template import compile_chat_template, load_chat_template, render_chat_template

transformers = pytest.importorskip("transformers")

# ChatML with a tools system block, <tool_call> JSON, <tool_response> grouping, <think> handling of
# the latest assistant turns and an enable_thinking switch (the shape of Qwen3's template).
QWEN_LIKE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call functions. Their signatures are inside <tools></tools>:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nReply to a call as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('the system message must come first') }}{%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content | default('', true) %}
        {%- set reasoning = message.reasoning_content | default('', true) %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls | default([]) %}
            {%- set f = call.function if call.function is defined else call %}
            {{- ('\n' if (content or not loop.first) else '') + '<tool_call>\n{"name": "' + f.name + '", "arguments": ' }}
            {%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# [INST] turns that must alternate user/assistant, the system prompt folded into the first user turn.
MIXTRAL_LIKE = r"""
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = none %}
    {%- set rest = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in rest %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system %}
            {{- '[INST] ' + system + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""

# Plain text turns after bos_token; exercises trim_blocks/lstrip_blocks, loop controls, filters.
SIMPLE_BOS = """{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {{ m.role | upper }}: {{ m.content | trim }}
    {% if loop.index > 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""

# Odds and ends real templates use: tojson arguments, {% generation %}, dict(), strftime_now.
FEATURES = """{%- set d = dict(a=1) -%}
{{ tools | tojson(indent=2, sort_keys=True) }}|{{ messages | tojson(separators=(',', ':')) }}|{{ d.a }}
{%- for m in messages %}{% generation %}<{{ m.role }}>{% endgeneration %}{% endfor %}
{{- strftime_now('%Y') }}|{{ documents is none }}|{{ unk_token is defined }}"""

TEMPLATES = {"qwen": QWEN_LIKE, "mixtral": MIXTRAL_LIKE, "simple": SIMPLE_BOS, "features": FEATURES}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city (°C) — e.g. 東京",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. 'Zürich' or \"<Paris>\""},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "a + b",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "number"}, "b": {"type": "number"}}}}},
]

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Réponds en français si possible."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello! 你好 👋"}],
    "system_multi_turn": [
        SYSTEM,
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "4 — simple. 😀"},
        {"role": "user", "content": "  And in 日本語?  "},
    ],
    "tool_calls": [
        SYSTEM,
        {"role": "user", "content": "Weather in Zürich and 東京, then add 1.5 and 2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "東京", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "☀️"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25, "sky": "雨"}'},
        {"role": "assistant", "content": "Let me add too.", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1.5, "b": 2}}}]},
        {"role": "tool", "content": "3.5"},
    ],
    "thinking": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nFirst answer."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Second answer.", "reasoning_content": "new reasoning ✓"},
    ],
}
# Which conversations each template can render (the [INST] one has no tool or system-only turns).
SUPPORTED = {
    "qwen": ["single", "system_multi_turn", "tool_calls", "thinking"],
    "mixtral": ["single", "system_multi_turn"],
    "simple": ["single", "system_multi_turn", "thinking"],
    "features": ["single", "system_multi_turn", "tool_calls", "thinking"],
}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@pytest.fixture(scope="module")
def ref_tokenizer():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL)


def reference(ref_tokenizer, template, messages, **kwargs):
    ref_tokenizer.chat_template = template
    return ref_tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)


CASES = [(t, c) for t in TEMPLATES for c in SUPPORTED[t]]


@pytest.mark.parametrize("template,conversation", CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_matches_transformers(ref_tokenizer, template, conversation, add_generation_prompt, with_tools):
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    ours = render_chat_template(TEMPLATES[template], copy.deepcopy(messages), tools=tools,
                                add_generation_prompt=add_generation_prompt, special_tokens=SPECIAL)
    assert ours == reference(ref_tokenizer, TEMPLATES[template], messages, tools=tools,
                             add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_extra_kwargs_reach_the_template(ref_tokenizer, enable_thinking):
    messages = CONVERSATIONS["system_multi_turn"]
    ours = render_chat_template(QWEN_LIKE, messages, special_tokens=SPECIAL, enable_thinking=enable_thinking)
    assert ours == reference(ref_tokenizer, QWEN_LIKE, messages, add_generation_prompt=True,
                             enable_thinking=enable_thinking)
    assert ours.endswith("<think>\n\n</think>\n\n") != enable_thinking


def test_qwen_like_renders_the_expected_structure():
    text = render_chat_template(QWEN_LIKE, CONVERSATIONS["tool_calls"], tools=TOOLS, special_tokens=SPECIAL)
    assert '"description": "Current weather for a city (°C) — e.g. 東京"' in text   # tojson keeps unicode
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in text
    assert '"arguments": {"city": "東京", "unit": "celsius"}}' in text               # string arguments as-is
    assert text.count("<|im_start|>user\n<tool_response>") == 2                       # grouped results
    assert "None" not in text                                                         # content: None dropped
    assert text.endswith("<|im_start|>assistant\n")


def test_raise_exception_becomes_request_error(ref_tokenizer):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(RequestError, match="Conversation roles must alternate"):
        render_chat_template(MIXTRAL_LIKE, bad, special_tokens=SPECIAL)
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        reference(ref_tokenizer, MIXTRAL_LIKE, bad)
    with pytest.raises(RequestError, match="system message must come first"):
        render_chat_template(QWEN_LIKE, [{"role": "user", "content": "a"}, SYSTEM])


def test_template_errors():
    with pytest.raises(ConfigError, match="does not compile"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "x"}])
    # The sandbox is immutable: templates cannot modify their inputs.
    with pytest.raises(RequestError):
        render_chat_template("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])
    with pytest.raises(RequestError):
        render_chat_template("{{ messages[0].__class__ }}{{ ().__class__.__bases__ }}",
                             [{"role": "user", "content": "x"}])
    with pytest.raises(RequestError, match="empty conversation"):
        render_chat_template(SIMPLE_BOS, [])
    assert issubclass(RequestError, TidalError) and issubclass(ConfigError, TidalError)


def test_inputs_are_not_mutated_and_templates_are_compiled_once():
    messages = copy.deepcopy(CONVERSATIONS["tool_calls"])
    before = copy.deepcopy(messages)
    render_chat_template(QWEN_LIKE, messages, tools=TOOLS, special_tokens=SPECIAL)
    assert messages == before
    assert compile_chat_template(QWEN_LIKE) is compile_chat_template(QWEN_LIKE)


def test_reasoning_aliases(ref_tokenizer):
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "via the 'reasoning' field"}]
    ours = render_chat_template(QWEN_LIKE, messages, add_generation_prompt=False)
    assert "<think>\nvia the 'reasoning' field\n</think>" in ours
    assert ours == reference(ref_tokenizer, QWEN_LIKE, messages, add_generation_prompt=False)


def test_load_chat_template(tmp_path):
    assert load_chat_template("{{ x }}") == "{{ x }}"
    f = tmp_path / "t.jinja"
    f.write_text(SIMPLE_BOS)
    assert load_chat_template(f) == SIMPLE_BOS
    assert load_chat_template(str(f)) == SIMPLE_BOS
    with pytest.raises(ConfigError, match="--chat-template"):
        load_chat_template(tmp_path / "nope.jinja")
