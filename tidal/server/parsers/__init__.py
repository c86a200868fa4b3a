"""Output parsing for chat responses: reasoning first, then tool calls in what is left.

`resolve_tool_parser` / `resolve_reasoning_parser` turn the `--tool-parser` / `--reasoning-parser`
flags into a parser name once per server, reading the chat template when the flag is "auto".
`OutputParser` chains the per-request parsers: text inside reasoning is never searched for tool calls
(models often mention a tool while thinking about it).
"""
from __future__ import annotations

from typing import Optional

from tidal.errors import ConfigError
from tidal.server.parsers.base import Event, Reasoning, Text, ToolCall, merge_events
from tidal.server.parsers.reasoning import ReasoningParser, make_reasoning_parser, prompt_opens_reasoning
from tidal.server.parsers.tool_parsers import TOOL_PARSERS, ToolParser

TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS, "none")
REASONING_PARSER_CHOICES = ("auto", "deepseek_r1", "qwen3", "none")

__all__ = ["Event", "Text", "Reasoning", "ToolCall", "OutputParser", "ToolParser", "ReasoningParser",
           "TOOL_PARSERS", "TOOL_PARSER_CHOICES", "REASONING_PARSER_CHOICES", "resolve_tool_parser",
           "resolve_reasoning_parser", "make_reasoning_parser", "prompt_opens_reasoning"]


def resolve_tool_parser(flag: str, template: str) -> Optional[str]:
    """The tool parser name for `--tool-parser flag`, or None for no tool-call parsing."""
    if flag == "none":
        return None
    if flag != "auto":
        if flag not in TOOL_PARSERS:
            raise ConfigError(f"--tool-parser {flag!r}: choose one of {', '.join(TOOL_PARSER_CHOICES)}")
        return flag
    # Order matters: XML-style templates also contain <tool_call>.
    if "<function=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    return None


def resolve_reasoning_parser(flag: str, template: str) -> Optional[str]:
    """The reasoning parser name for `--reasoning-parser flag`, or None."""
    if flag == "none":
        return None
    if flag != "auto":
        if flag not in REASONING_PARSER_CHOICES:
            raise ConfigError(f"--reasoning-parser {flag!r}: choose one of "
                              f"{', '.join(REASONING_PARSER_CHOICES)}")
        return flag
    return "qwen3" if "</think>" in template or "<think>" in template else None


class OutputParser:
    """Reasoning split, then tool calls, for one request. Either part may be absent."""

    def __init__(self, reasoning: Optional[ReasoningParser] = None, tools: Optional[ToolParser] = None):
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str) -> list[Event]:
        events = self.reasoning.feed(text) if self.reasoning else [Text(text)]
        return merge_events(self._through_tools(events))

    def finish(self) -> list[Event]:
        out = self._through_tools(self.reasoning.finish() if self.reasoning else [])
        if self.tools is not None:
            out += self.tools.finish()
        return merge_events(out)

    def _through_tools(self, events: list[Event]) -> list[Event]:
        if self.tools is None:
            return list(events)
        out: list[Event] = []
        for e in events:
            out.extend(self.tools.feed(e.text) if isinstance(e, Text) else [e])
        return out
