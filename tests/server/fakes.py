"""A scripted stand-in for AsyncEngine, and a chat template that renders tools and reasoning.

The demo model's output is random, so tool calls and reasoning are driven end to end by a fake engine
that "generates" a scripted text through the real demo tokenizer (token by token, like the engine's
per-step outputs). It records each prompt so tests can check what the server rendered.
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable, Optional, Union

from tidal.tokenizer.tokenizer import Tokenizer
from tidal.types import RequestOutput, SamplingParams
from tidal.weights.demo import demo_model_path

# Hermes/Qwen-style template written for these tests: tools in the system turn, assistant tool calls
# as <tool_call> JSON, tool results as <tool_response>, thinking switchable like Qwen3's.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# Qwen3-Coder-style template: XML tool calls (enough of it for the parser to be detected).
XML_TEMPLATE = HERMES_TEMPLATE.replace(
    'Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call>.',
    "Call a tool with <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>.")


def demo_tokenizer(template: Optional[str] = None) -> Tokenizer:
    tok = Tokenizer.from_dir(demo_model_path())
    if template is not None:
        tok = Tokenizer(tok.backend, special_tokens=tok.special_tokens, eos_token_ids=tok.eos_token_ids,
                        chat_templates={"default": template}, name=tok.name)
    return tok


Script = Union[str, Callable[[str], str]]


class FakeEngine:
    """The AsyncEngine interface (`generate`, `tokenizer`, `max_model_len`), replaying a script."""

    max_model_len = 4096

    def __init__(self, tokenizer: Tokenizer, script: Script = "", *, tokens_per_step: int = 1,
                 first_token_delay: float = 0.0, fail_after: Optional[int] = None, cached_tokens: int = 0):
        self.tokenizer = tokenizer
        self.script = script
        self.tokens_per_step = tokens_per_step
        self.first_token_delay = first_token_delay
        self.fail_after = fail_after
        self.cached_tokens = cached_tokens
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []
        self.eos = min(tokenizer.eos_token_ids)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str):
        prompt = self.tokenizer.decode(prompt_ids)
        self.prompts.append(prompt)
        self.params.append(params)
        text = self.script(prompt) if callable(self.script) else self.script
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.first_token_delay:
            await asyncio.sleep(self.first_token_delay)
        n = len(prompt_ids)
        done = 0
        while True:
            chunk = ids[done:done + self.tokens_per_step]
            if self.fail_after is not None and done >= self.fail_after:
                raise RuntimeError("scripted engine failure")
            done += len(chunk)
            if done >= params.max_tokens:
                chunk = chunk[:len(chunk) - (done - params.max_tokens)]
                done = params.max_tokens
                yield RequestOutput(request_id, chunk, self.tokenizer.decode(chunk), True, "length", [], n,
                                    self.cached_tokens, done)
                return
            if done >= len(ids):   # the script is over: the model says eos
                yield RequestOutput(request_id, chunk + [self.eos], self.tokenizer.decode(chunk), True, "stop",
                                    [], n, self.cached_tokens, done + 1)
                return
            yield RequestOutput(request_id, chunk, self.tokenizer.decode(chunk), False, None, [], n,
                                self.cached_tokens, done)
            await asyncio.sleep(0)


def hermes_call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
