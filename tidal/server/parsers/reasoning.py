"""Split `<think>...</think>` reasoning from the answer, streaming-safe.

Families differ in who writes the opening tag. Qwen3 (original) models write `<think>` themselves;
DeepSeek-R1 and the Qwen3 "thinking" templates end the *prompt* with `<think>\\n`, so the output starts
inside reasoning and only `</think>` appears; a template with thinking switched off renders an empty
`<think></think>` pair into the prompt, so the output is all answer. `prompt_opens_reasoning` reads the
rendered prompt to tell these apart, which covers all three without per-model rules.

Rules: an opening tag counts only before any answer text (a model that discusses `<think>` tags in its
answer is left alone); reasoning ends at the first closing tag; whitespace around the reasoning and at
the start of the answer that follows it is formatting, not content, and is dropped. Output that never
opens reasoning passes through byte for byte.
"""
from __future__ import annotations

from typing import Optional

from tidal.server.parsers.base import Event, Reasoning, Text, merge_events, partial_tag_len

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def prompt_opens_reasoning(prompt: str, start_tag: str = "<think>", end_tag: str = "</think>") -> bool:
    """True when the prompt's last `start_tag` is not followed by `end_tag`: generation begins inside it."""
    i = prompt.rfind(start_tag)
    return i >= 0 and prompt.find(end_tag, i) < 0


class ReasoningParser:
    """One per request. `feed` each text delta, then `finish` once at the end of output."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, in_reasoning: bool = False):
        self._state = _REASONING if in_reasoning else _START
        # Starting inside reasoning, a model may still repeat the opening tag; drop it once.
        self._allow_open = in_reasoning
        self._strip_lead = in_reasoning
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return merge_events(self._drain(final=False))

    def finish(self) -> list[Event]:
        return merge_events(self._drain(final=True))

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            if self._state == _START:
                if not self._leave_start(final):
                    break
            elif self._state == _REASONING:
                if not self._reasoning(out, final):
                    break
            else:
                if self._strip_lead:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._strip_lead = False
                out.append(Text(self._buf))
                self._buf = ""
        return out

    def _leave_start(self, final: bool) -> bool:
        """Decide whether the output opens with reasoning. False: need more text."""
        s = self._buf.lstrip()
        if s.startswith(self.start_tag):
            self._buf = s[len(self.start_tag):]
            self._state, self._strip_lead = _REASONING, True
            return True
        if not final and (not s or self.start_tag.startswith(s)):
            return False   # only whitespace or part of the tag so far
        self._state = _CONTENT   # the buffer is answer text, leading whitespace and all
        return True

    def _reasoning(self, out: list[Event], final: bool) -> bool:
        if self._strip_lead:
            s = self._buf.lstrip()
            if self._allow_open and s.startswith(self.start_tag):
                self._buf = s[len(self.start_tag):]
                return True
            if not final and (not s or (self._allow_open and self.start_tag.startswith(s))):
                self._buf = s
                return False
            self._buf, self._strip_lead, self._allow_open = s, False, False
        i = self._buf.find(self.end_tag)
        if i >= 0:
            out.append(Reasoning(self._buf[:i].rstrip()))
            self._buf = self._buf[i + len(self.end_tag):]
            self._state, self._strip_lead = _CONTENT, True
            return True
        if final:
            out.append(Reasoning(self._buf.rstrip()))
            self._buf = ""
            return False
        # Hold back a possible split closing tag and trailing whitespace (it may precede the tag).
        keep = len(self._buf) - partial_tag_len(self._buf, (self.end_tag,))
        emit = self._buf[:keep].rstrip()
        out.append(Reasoning(emit))
        self._buf = self._buf[len(emit):]
        return False


def make_reasoning_parser(name: Optional[str], prompt: str) -> Optional[ReasoningParser]:
    """The parser for one request, or None. name: "qwen3" | "deepseek_r1" | None (already resolved)."""
    if name is None:
        return None
    opens = prompt_opens_reasoning(prompt, ReasoningParser.start_tag, ReasoningParser.end_tag)
    if name == "deepseek_r1":
        # R1 always reasons first; its template opens the tag, but older ones leave it to the model,
        # which we handle too because an opening tag at the start is dropped.
        closed = prompt.rfind(ReasoningParser.end_tag) > prompt.rfind(ReasoningParser.start_tag) >= 0
        return ReasoningParser(in_reasoning=not closed)
    return ReasoningParser(in_reasoning=opens)
