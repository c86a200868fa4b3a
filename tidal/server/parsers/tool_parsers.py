"""Tool-call parsers, one per model family's output format, streaming-safe.

Formats:
- hermes (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- qwen3_coder (Qwen3-Coder and other XML-style templates):
  `<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
  `[TOOL_CALLS]NAME[ARGS]{...}` (v11+), no closing tag.

Each parser emits text before a call as it arrives, holds back a suffix that could be the start of a
tag split across deltas, and emits each call whole once it closes (arguments as one JSON text). A
block that does not parse is returned as the model's raw text rather than dropped. Whitespace between
answer text and calls is formatting and is dropped when the output contains calls; output without
calls passes through byte for byte.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

from tidal.server.parsers.base import (Event, Text, ToolCall, alnum9_call_id, merge_events, openai_call_id,
                                       partial_tag_len)


def _tool_schemas(tools: Optional[list[dict]]) -> dict[str, dict]:
    """name -> JSON-schema `properties` of each function tool (OpenAI `{"type": "function", ...}` shape)."""
    out = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            out[fn["name"]] = params.get("properties") or {} if isinstance(params, dict) else {}
    return out


class ToolParser:
    """One per request: `feed` text deltas, then `finish` once. Subclasses implement the format."""

    name = ""
    tags: tuple[str, ...] = ()        # every tag the format uses (to decide skip_special_tokens)

    def __init__(self, tools: Optional[list[dict]] = None):
        self.schemas = _tool_schemas(tools)
        self.num_calls = 0
        self._ws = ""               # trailing whitespace of text, held until we know what follows
        self._after_call = False    # strip whitespace right after a call

    def new_call_id(self) -> str:
        return openai_call_id()

    def forced_prefix(self, name: Optional[str]) -> str:
        """Text that opens a call (of `name` when given); appended to the prompt when the request
        requires a tool call, and fed to the parser with `prime`."""
        raise NotImplementedError

    def prime(self, text: str) -> None:
        """Feed text that is part of the prompt, not the output (a forced prefix); nothing is emitted."""
        leftover = self.feed(text)
        assert not leftover, "a forced prefix must open a call"

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    # -- shared output helpers --------------------------------------------------------------------
    def _text(self, out: list[Event], s: str) -> None:
        if self._after_call:
            s = s.lstrip()
            if not s:
                return
            self._after_call = False
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body):]
        if body:
            out.append(Text(body))

    def _calls(self, out: list[Event], calls: list[ToolCall]) -> None:
        self._ws, self._after_call = "", True
        self.num_calls += len(calls)
        out.extend(calls)

    def _end(self, out: list[Event]) -> list[Event]:
        if self.num_calls == 0 and self._ws:
            out.append(Text(self._ws))
        self._ws = ""
        return merge_events(out)

    def _call(self, name: Any, args: Any) -> Optional[ToolCall]:
        """A ToolCall from a parsed name and arguments (dict or JSON text); None when malformed."""
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return None
        if args is None:
            args = {}
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        return ToolCall(self.new_call_id(), name, json.dumps(args, ensure_ascii=False))

    def _json_calls(self, obj: Any) -> Optional[list[ToolCall]]:
        """Calls from `{"name", "arguments"}` objects (one or a list); None if any is malformed."""
        items = obj if isinstance(obj, list) else [obj]
        calls = []
        for item in items:
            if not isinstance(item, dict):
                return None
            args = item.get("arguments", item.get("parameters"))
            call = self._call(item.get("name"), args)
            if call is None:
                return None
            calls.append(call)
        return calls or None


class TaggedToolParser(ToolParser):
    """Formats whose calls sit between an opening and a closing tag."""

    pairs: dict[str, str] = {}     # opening tag -> closing tag

    def __init__(self, tools: Optional[list[dict]] = None):
        super().__init__(tools)
        self._buf = ""
        self._open: Optional[str] = None   # the opening tag of the call being read
        self._scanned = 0                  # the closing tag does not start before this index of _buf

    def parse_block(self, open_tag: str, body: str) -> Optional[list[ToolCall]]:
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._open is None:
                hits = [(i, t) for t in self.pairs if (i := self._buf.find(t)) >= 0]
                if hits:
                    i, tag = min(hits)
                    self._text(out, self._buf[:i])
                    self._buf, self._open, self._scanned = self._buf[i + len(tag):], tag, 0
                    continue
                keep = len(self._buf) - partial_tag_len(self._buf, self.pairs)
                self._text(out, self._buf[:keep])
                self._buf = self._buf[keep:]
                return merge_events(out)
            close = self.pairs[self._open]
            j = self._buf.find(close, self._scanned)
            if j < 0:
                # A long call (a whole file as an argument) arrives in many deltas: rescan only the end.
                self._scanned = max(0, len(self._buf) - len(close) + 1)
                return merge_events(out)
            self._close_block(out, self._buf[:j], close)
            self._buf = self._buf[j + len(close):]

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._open is not None:
            # Unclosed: the model stopped (eos, stop string, length) inside the call. Keep it if whole.
            self._close_block(out, self._buf, "")
        else:
            self._text(out, self._buf)
        self._buf = ""
        return self._end(out)

    def _close_block(self, out: list[Event], body: str, close: str) -> None:
        calls = self.parse_block(self._open, body)
        if calls:
            self._calls(out, calls)
        else:
            self._text(out, self._open + body + close)
        self._open = None


class HermesToolParser(TaggedToolParser):
    name = "hermes"
    pairs = {"<tool_call>": "</tool_call>"}
    tags = ("<tool_call>", "</tool_call>")

    def forced_prefix(self, name: Optional[str]) -> str:
        return "<tool_call>\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")

    def parse_block(self, open_tag: str, body: str) -> Optional[list[ToolCall]]:
        try:
            return self._json_calls(json.loads(body))
        except json.JSONDecodeError:
            return None


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _types_of(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _types_of(sub)
    return types


def convert_parameter(value: str, schema: Any) -> Any:
    """An XML parameter's text as the JSON value its schema asks for; text stays text when unsure."""
    types = _types_of(schema)
    if value == "null" and ("null" in types or not types):
        return None
    if types and types <= {"string", "null"}:
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        if "boolean" in types and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value
    ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
          "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
    if not types or any(ok.get(t, lambda v: False)(parsed) for t in types):
        # No schema: numbers/objects/... as JSON, but a bare word stays a string (json.loads failed).
        return parsed
    return value


class Qwen3CoderToolParser(TaggedToolParser):
    name = "qwen3_coder"
    # Models sometimes drop the outer <tool_call>; a bare <function=...> block is a call too.
    pairs = {"<tool_call>": "</tool_call>", "<function=": "</function>"}
    tags = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")

    def forced_prefix(self, name: Optional[str]) -> str:
        return "<tool_call>\n" + (f"<function={name}>\n" if name else "")

    def parse_block(self, open_tag: str, body: str) -> Optional[list[ToolCall]]:
        text = body if open_tag == "<tool_call>" else "<function=" + body + "</function>"
        calls = []
        for m in _FUNCTION.finditer(text):
            name = m.group(1).strip()
            props = self.schemas.get(name, {})
            args = {}
            for p in _PARAMETER.finditer(m.group(2)):
                key, value = p.group(1).strip(), p.group(2)
                # The template writes each value between newlines; they are not part of it.
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[key] = convert_parameter(value, props.get(key))
            call = self._call(name, args)
            if call is None:
                return None
            calls.append(call)
        leftover = _FUNCTION.sub("", text).strip()
        return calls if calls and not leftover else None


_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9_\-]*)?\[ARGS\]")


class MistralToolParser(ToolParser):
    name = "mistral"
    tags = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    _open_tag = "[TOOL_CALLS]"

    def __init__(self, tools: Optional[list[dict]] = None):
        super().__init__(tools)
        self._buf = ""
        self._in_call = False
        self._retry = True     # the buffer changed in a way that could complete the JSON

    def new_call_id(self) -> str:
        return alnum9_call_id()

    def forced_prefix(self, name: Optional[str]) -> str:
        # Which of the two layouts the model writes depends on its tokenizer version, so only the
        # tag is forced; the name is asked for in the system prompt.
        return self._open_tag

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._retry = self._retry or "}" in text or "]" in text
        out: list[Event] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self._open_tag)
                if i >= 0:
                    self._text(out, self._buf[:i])
                    self._buf, self._in_call, self._retry = self._buf[i + len(self._open_tag):], True, True
                    continue
                keep = len(self._buf) - partial_tag_len(self._buf, (self._open_tag,))
                self._text(out, self._buf[:keep])
                self._buf = self._buf[keep:]
                return merge_events(out)
            if not self._retry:
                return merge_events(out)
            self._retry = False
            parsed = self._decode(self._buf)
            if parsed is None:
                return merge_events(out)
            calls, used = parsed
            self._calls(out, calls)
            self._buf, self._in_call, self._retry = self._buf[used:], False, True

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._in_call:
            parsed = self._decode(self._buf)
            if parsed is not None:
                self._calls(out, parsed[0])
                self._text(out, self._buf[parsed[1]:])
            else:
                self._text(out, self._open_tag + self._buf)
        else:
            self._text(out, self._buf)
        self._buf = ""
        return self._end(out)

    def _decode(self, buf: str) -> Optional[tuple[list[ToolCall], int]]:
        """(calls, characters used) when buf starts with a complete call list; None otherwise."""
        start = len(buf) - len(buf.lstrip())
        decoder = json.JSONDecoder()
        if buf[start:start + 1] in ("[", "{"):
            try:
                obj, end = decoder.raw_decode(buf, start)
            except json.JSONDecodeError:
                return None
            calls = self._json_calls(obj)
            return (calls, end) if calls else None
        m = _MISTRAL_NAMED.match(buf, start)
        if m is None:
            return None
        try:
            args, end = decoder.raw_decode(buf, m.end())
        except json.JSONDecodeError:
            return None
        call = self._call(m.group(1), args)
        return ([call], end) if call else None


TOOL_PARSERS: dict[str, Callable[[Optional[list[dict]]], ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "mistral": MistralToolParser,
}
