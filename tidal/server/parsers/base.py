"""What the output parsers emit, and the one text helper they all need.

A parser turns the model's text, arriving in arbitrary deltas, into a stream of events: plain text,
reasoning text, and whole tool calls. The HTTP layer maps events onto each API's wire format. Parsers
are streaming-safe: feeding a text in one piece or split at any position gives the same events once
adjacent events of one kind are merged (see `merge_events`).
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Iterable, Union


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str   # a JSON object, serialised (what OpenAI's `function.arguments` carries)


Event = Union[Text, Reasoning, ToolCall]


def partial_tag_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`.

    That suffix may be the start of a tag split across deltas, so it is held back until the next
    delta (or the end of output) shows whether it is one.
    """
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def merge_events(events: Iterable[Event]) -> list[Event]:
    """Join adjacent Text (or Reasoning) events and drop empty ones."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, (Text, Reasoning)):
            if not e.text:
                continue
            if out and type(out[-1]) is type(e):
                out[-1] = type(e)(out[-1].text + e.text)
                continue
        out.append(e)
    return out


_ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def alnum9_call_id() -> str:
    # Mistral's chat templates reject tool call ids that are not exactly 9 alphanumerics.
    return "".join(secrets.choice(_ALNUM) for _ in range(9))
