"""The chat pipeline shared by /v1/chat/completions, /v1/responses and /v1/messages.

Each API translates its request into the same native pieces: OpenAI-style message dicts (what chat
templates read), OpenAI-style function tools, a ToolChoice and SamplingParams. `plan_chat` renders the
prompt and picks the output parsers; `ChatOutput` consumes the engine's per-step outputs and yields
parser events (text, reasoning, tool calls) while keeping the totals each API reports at the end.

Without constrained decoding, `tool_choice` "required" / a named tool is enforced by ending the prompt
with the opening of a call in the model's own format (`<tool_call>\\n{"name": "f", "arguments": `),
which the tool parser is primed with; JSON mode is asked for in the system prompt and checked after.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from tidal.server.errors import APIError
from tidal.server.parsers import (TOOL_PARSERS, Event, OutputParser, Reasoning, ToolCall,
                                  make_reasoning_parser, prompt_opens_reasoning)
from tidal.server.state import ServerState
from tidal.types import RequestOutput, SamplingParams, TokenLogprob


@dataclass
class ToolChoice:
    mode: str = "auto"              # auto | none | required | named
    name: Optional[str] = None      # the function, when mode == "named"


JSON_INSTRUCTION = "Respond with a single valid JSON object and nothing else."


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    tool_parser: Optional[str] = None
    tools: Optional[list[dict]] = None
    reasoning_parser: Optional[str] = None
    forced_prefix: str = ""          # a call opening appended to the prompt (tool_choice required/named)
    parallel_tool_calls: bool = True
    json_mode: bool = False

    def new_parser(self) -> OutputParser:
        tools = TOOL_PARSERS[self.tool_parser](self.tools) if self.tool_parser else None
        if tools is not None and self.forced_prefix:
            tools.prime(self.forced_prefix)
        reasoning = None if self.forced_prefix else make_reasoning_parser(self.reasoning_parser, self.prompt_text)
        return OutputParser(reasoning, tools)


def require_model(state: ServerState, name: Optional[str]) -> None:
    """Reject a request for a model this server does not serve (404, naming both); no name means ours.

    A client that names another model would otherwise get this one's answers without knowing it."""
    if name is not None and name != state.model_name:
        raise APIError(404, f"model {name!r} is not served here; this server serves {state.model_name!r}",
                       "model", code="model_not_found")


def require_tokenizer(state: ServerState):
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer.json, so it can only take token-id prompts "
                            "(/v1/completions with a list of ints)")
    return state.tokenizer


def _add_system_note(messages: list[dict], note: str) -> list[dict]:
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + note) if first["content"] else note
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def _tags_are_special(tokenizer: Any, tags: tuple[str, ...]) -> bool:
    """Whether decoding with skip_special_tokens would drop one of these tags from the text."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return False
    added = backend.get_added_tokens_decoder()
    for tag in tags:
        tid = tokenizer.token_to_id(tag)
        if tid is not None and tid in added and added[tid].special:
            return True
    return False


def plan_chat(state: ServerState, messages: list[dict], params: SamplingParams, max_tokens: Optional[int], *,
              tools: Optional[list[dict]] = None, tool_choice: Optional[ToolChoice] = None,
              parallel_tool_calls: bool = True, json_mode: bool = False, json_schema: Optional[dict] = None,
              template_kwargs: Optional[dict] = None) -> ChatPlan:
    """Render the prompt and choose parsers. Raises APIError/RequestError naming what is wrong."""
    tok = require_tokenizer(state)
    choice = tool_choice or ToolChoice()
    tools = tools or None
    if tools is None and choice.mode in ("required", "named"):
        raise APIError(400, f"tool_choice is {choice.mode!r} but the request has no tools", "tool_choice")
    names = [t["function"]["name"] for t in tools or []]
    if choice.mode == "named" and choice.name not in names:
        raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools "
                            f"({', '.join(names)})", "tool_choice")
    active = tools is not None and choice.mode != "none"
    parser = state.tool_parser if active else None
    if choice.mode in ("required", "named") and parser is None:
        raise APIError(400, f"tool_choice {choice.mode!r} needs a tool-call parser, and none is known for "
                            "this model's chat template; start the server with --tool-parser", "tool_choice")
    if json_mode or json_schema is not None:
        note = JSON_INSTRUCTION
        if json_schema is not None:
            note += " It must conform to this JSON schema:\n" + json.dumps(json_schema, ensure_ascii=False)
        messages = _add_system_note(messages, note)
    forced = ""
    if choice.mode in ("required", "named"):
        forced = TOOL_PARSERS[parser](tools).forced_prefix(choice.name)
        if parser == "mistral" and choice.name:
            messages = _add_system_note(messages, f"Call the function {choice.name} now.")
    # A tool_choice of "none" keeps the tools out of the prompt so the model does not try to call them.
    text = tok.apply_chat_template(messages, tools=tools if active else None, add_generation_prompt=True,
                                   tokenize=False, **(template_kwargs or {}))
    if forced:
        if prompt_opens_reasoning(text):
            text += "</think>\n\n"     # a forced call comes after (empty) reasoning
        text += forced
    ids = tok.encode(text, add_special_tokens=False)
    if max_tokens is None:
        params.max_tokens = default_max_tokens(state, len(ids))
    tags: tuple[str, ...] = ()
    if parser:
        tags += TOOL_PARSERS[parser].tags
    if state.reasoning_parser:
        tags += ("<think>", "</think>")
    if params.skip_special_tokens and tags and _tags_are_special(tok, tags):
        params.skip_special_tokens = False   # the parsers must see their tags in the text
    return ChatPlan(ids, text, params, parser, tools if active else None,
                    None if forced else state.reasoning_parser, forced, parallel_tool_calls,
                    json_mode or json_schema is not None)


def sampling_params(state: ServerState, max_tokens: Optional[int], **fields: Any) -> SamplingParams:
    """SamplingParams from request fields (None = not given: the model's default, then the API's).
    max_tokens None means "the rest of the context": pass it to `plan_chat`, which knows the prompt."""
    values = {k: v for k, v in fields.items() if v is not None}
    for key, value in state.sampling_defaults.items():
        values.setdefault(key, value)
    values.setdefault("temperature", 1.0)
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    return SamplingParams(max_tokens=max_tokens or 1, **values)


def extract_json(text: str) -> Optional[str]:
    """The first JSON object in text (models like to wrap it in prose or ``` fences), re-serialised."""
    decoder = json.JSONDecoder()
    i = text.find("{")
    while i >= 0:
        try:
            obj, _ = decoder.raw_decode(text, i)
            return json.dumps(obj, ensure_ascii=False)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
    return None


@dataclass
class ChatOutput:
    """Accumulates one chat request's output. `push` each RequestOutput; the events it returns are
    what to stream; the fields hold the totals once `finished`."""

    plan: ChatPlan
    eos_token_ids: frozenset = frozenset()
    tokenizer: Any = None
    parser: OutputParser = None
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None     # the engine's: stop | length | abort
    stop_sequence: Optional[str] = None     # the stop string that ended it, when one did
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        if self.parser is None:
            self.parser = self.plan.new_parser()
        self.prompt_tokens = len(self.plan.prompt_ids)

    def push(self, out: RequestOutput) -> list[Event]:
        self.output_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.prompt_tokens = out.num_prompt_tokens or self.prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        self.output_tokens = out.num_output_tokens or len(self.output_ids)
        events = self.parser.feed(out.new_text) if out.new_text else []
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            events += self.parser.finish()
            self.stop_sequence = self._stop_string(out)
        return self._record(events)

    def _record(self, events: list[Event]) -> list[Event]:
        kept = []
        for e in events:
            if isinstance(e, ToolCall):
                if self.tool_calls and not self.plan.parallel_tool_calls:
                    continue
                self.tool_calls.append(e)
            elif isinstance(e, Reasoning):
                self.reasoning += e.text
            else:
                self.content += e.text
            kept.append(e)
        return kept

    def _stop_string(self, out: RequestOutput) -> Optional[str]:
        stops = self.plan.params.stop
        if self.finish_reason != "stop" or not stops:
            return None
        reason = getattr(out, "stop_reason", None)
        if isinstance(reason, str):
            return reason
        last = self.output_ids[-1] if self.output_ids else None
        if last is not None and (last in self.eos_token_ids or last in self.plan.params.stop_token_ids):
            return None
        if len(stops) == 1 or self.tokenizer is None:
            return stops[0]
        # The text we got stops before the match; the earliest stop string in the full decode matched.
        raw = self.tokenizer.decode(self.output_ids, skip_special_tokens=self.plan.params.skip_special_tokens)
        return min(stops, key=lambda s: (raw.find(s) if s in raw else len(raw) + 1, -len(s)))

    @property
    def kind(self) -> str:
        """How it ended, in API-neutral terms: tool_calls | stop_sequence | stop | length | abort."""
        if self.tool_calls and self.finish_reason in ("stop", None):
            return "tool_calls"
        if self.finish_reason == "stop" and self.stop_sequence is not None:
            return "stop_sequence"
        return self.finish_reason or "stop"

    def reasoning_tokens(self) -> int:
        """Tokens spent reasoning, by re-encoding the reasoning text (the engine does not split counts)."""
        if not self.reasoning or self.tokenizer is None:
            return 0
        return min(self.output_tokens, len(self.tokenizer.encode(self.reasoning, add_special_tokens=False)))

    def final_content(self) -> str:
        if self.plan.json_mode:
            return extract_json(self.content) or self.content
        return self.content


def start_generation(state: ServerState, prompt_ids: list[int], params: SamplingParams, request_id: str):
    """Check the request now (so a bad one gets a 400 before any streaming starts), then return the
    engine's output iterator. Closing the iterator aborts the request."""
    limit = int(getattr(state.engine, "max_model_len", 0) or 0)
    if limit and len(prompt_ids) >= limit:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, but this server's context is {limit} "
                            f"tokens (--max-model-len {limit}), so a prompt may have at most {limit - 1}",
                       code="context_length_exceeded")
    check = getattr(state.engine, "check_request", None)
    if check is not None:
        check(prompt_ids, params)
    return state.engine.generate(prompt_ids, params, request_id)


def default_max_tokens(state: ServerState, prompt_len: int) -> int:
    """What a request that sets no limit gets: the rest of the context window."""
    limit = int(getattr(state.engine, "max_model_len", 0) or 0)
    return max(1, limit - prompt_len) if limit else 4096


def template_arguments(arguments: Any) -> Any:
    """Tool-call arguments as chat templates expect them: a dict (most apply `tojson` themselves)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
