"""Render Hugging Face chat templates (Jinja) the way transformers does.

A checkpoint's chat template is Jinja code written against transformers' renderer, so we reproduce
that renderer's environment rather than inventing our own: a sandbox that cannot mutate its inputs,
`trim_blocks` + `lstrip_blocks`, the `loopcontrols` extension, the `raise_exception` / `strftime_now`
globals, a `tojson` filter that does not HTML-escape, and a no-op `{% generation %}` block (templates
written for assistant-token masks use it). Inputs are copied into plain JSON-like data first, as
transformers does, so a template sees the same values and cannot reach Python objects' methods.

Errors: a template that does not compile raises ConfigError; anything a template raises while
rendering (its own `raise_exception(...)`, or a bad input it trips over) raises RequestError, because
at that point the template is fine and the request's messages are what it rejects.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tidal.errors import ConfigError, RequestError

# Names under which clients send a message's reasoning; chat templates read `reasoning_content`
# (and gpt-oss templates read `thinking`), so each alias is copied to both (transformers does the same).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the block to find assistant tokens for training masks; serving only needs the
    text, but without this extension such templates would not even parse.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: Any) -> None:
    # Templates call this to reject a conversation (e.g. roles that do not alternate).
    raise RequestError(f"chat template rejected the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' which would change the prompt; transformers
    # replaces it with plain json.dumps and exposes these arguments, so templates rely on them.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=64)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template text; raises ConfigError when it is not valid Jinja."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"chat template does not compile (line {e.lineno}): {e.message}") from None


def load_chat_template(value: str | Path) -> str:
    """Template text from a `--chat-template` value: a path to a file, or the Jinja text itself."""
    text = str(value)
    if "{{" in text or "{%" in text:
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        raise ConfigError(f"--chat-template: {text!r} is neither a readable file nor Jinja template text")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template: cannot read {path}: {e}") from None


def _plain(value: Any) -> Any:
    """Deep copy into plain JSON-like data (the template must not see or mutate caller objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)       # strip subclasses (enums...) back to str
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):   # pydantic models from the HTTP layer
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Any) -> list[dict]:
    """Messages as transformers hands them to templates: plain dicts, keys whose value is None dropped
    (OpenAI clients send `content: null` next to `tool_calls`, which many templates would render as
    "None"), and reasoning aliased under `reasoning_content` and `thinking`."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise RequestError(f"each chat message must be an object, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    template: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` (OpenAI-style dicts) with a chat template.

    special_tokens: the tokenizer's named special tokens as strings ({"bos_token": "<s>", ...}); the
    template sees each as a variable. kwargs become template variables too (e.g. enable_thinking) and
    win over special tokens of the same name, as in transformers. `documents` defaults to None.
    """
    compiled = compile_chat_template(template)
    if messages is None or len(messages) == 0:
        raise RequestError("cannot apply a chat template to an empty conversation")
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise RequestError(f"each tool must be a JSON schema object, got {tool!r}")
    variables = {**dict(special_tokens or {}), **kwargs}
    variables.setdefault("documents", None)
    variables = _plain(variables)
    try:
        return compiled.render(
            messages=normalize_messages(messages),
            tools=_plain(tools),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except RequestError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        # The template compiled, so this is a conversation shape it does not handle.
        raise RequestError(f"chat template failed on this conversation: {type(e).__name__}: {e}") from None
