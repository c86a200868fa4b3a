"""Anthropic-compatible routes: POST /v1/messages (streaming and not) and /v1/messages/count_tokens.

Messages are translated to the OpenAI-style dicts chat templates read: `tool_use` blocks become an
assistant message's `tool_calls`, `tool_result` blocks become `tool` messages, `thinking` blocks become
`reasoning_content`. Usage follows Anthropic's accounting: `input_tokens` excludes the prompt tokens
served from the prefix cache, which are reported as `cache_read_input_tokens`.
"""
from __future__ import annotations

import json
import logging
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from tidal.server.chat import (ChatOutput, ChatPlan, ToolChoice, plan_chat, require_model, sampling_params,
                               start_generation)
from tidal.server.errors import APIError, anthropic_body, from_exception
from tidal.server.parsers import Reasoning, Text
from tidal.server.protocol import AnthropicMessage, CountTokensRequest, MessagesRequest
from tidal.server.sse import HEARTBEAT, Pacer, sse, sse_response, unless_disconnected, with_heartbeat
from tidal.server.state import ServerState

log = logging.getLogger(__name__)
router = APIRouter()
_STOP_REASON = {"tool_calls": "tool_use", "stop_sequence": "stop_sequence", "stop": "end_turn",
                "length": "max_tokens", "abort": "end_turn"}
PING = sse({"type": "ping"}, "ping")


def _blocks_text(blocks: Any, where: str) -> str:
    """Text of a string or a list of text blocks; other block types are rejected."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, b in enumerate(blocks or []):
        kind = getattr(b, "type", None) if not isinstance(b, dict) else b.get("type")
        text = getattr(b, "text", None) if not isinstance(b, dict) else b.get("text")
        if kind == "text" and isinstance(text, str):
            parts.append(text)
        elif kind in ("image", "document"):
            raise APIError(400, f"{where}[{j}]: {kind} content is not supported by this server "
                                "(text-only model)", f"{where}[{j}]")
        else:
            raise APIError(400, f"{where}[{j}]: unsupported content block type {kind!r} here", f"{where}[{j}]")
    return "\n".join(parts)


def anthropic_messages(system: Any, messages: list[AnthropicMessage]) -> list[dict]:
    """Anthropic system + messages -> the dicts chat templates read."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _blocks_text(system, "system")})
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            _append(out, {"role": m.role, "content": m.content})
            continue
        texts, calls, reasoning = [], [], []
        for j, b in enumerate(m.content):
            kind, extra = b.type, b.model_extra or {}
            if kind == "text":
                texts.append(extra.get("text") or "")
            elif kind in ("image", "document"):
                raise APIError(400, f"{where}[{j}]: {kind} content is not supported by this server "
                                    "(text-only model)", f"{where}[{j}]")
            elif kind == "tool_use" and m.role == "assistant":
                cid = extra.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"
                names[cid] = extra.get("name", "")
                calls.append({"id": cid, "type": "function", "function": {
                    "name": extra.get("name", ""), "arguments": extra.get("input") or {}}})
            elif kind == "tool_result" and m.role == "user":
                tid = extra.get("tool_use_id")
                if not isinstance(tid, str):
                    raise APIError(400, f"{where}[{j}].tool_use_id is required", f"{where}[{j}].tool_use_id")
                content = _blocks_text(extra.get("content") or "", f"{where}[{j}].content")
                if extra.get("is_error"):
                    content = f"Error: {content}"
                tool = {"role": "tool", "tool_call_id": tid, "content": content}
                if names.get(tid):
                    tool["name"] = names[tid]
                out.append(tool)
            elif kind == "thinking" and m.role == "assistant":
                reasoning.append(extra.get("thinking") or "")
            elif kind == "redacted_thinking":
                continue   # encrypted by another provider: nothing we can show the model
            else:
                raise APIError(400, f"{where}[{j}]: content block type {kind!r} is not valid in a "
                                    f"{m.role} message", f"{where}[{j}].type")
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            out.append(msg)
        elif texts:
            _append(out, {"role": "user", "content": "\n".join(texts)})
    return out


def _append(out: list[dict], msg: dict) -> None:
    # Anthropic merges consecutive user turns; many chat templates insist on alternation.
    if msg["role"] == "user" and out and out[-1]["role"] == "user" and set(out[-1]) == {"role", "content"}:
        out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + msg["content"]}
    else:
        out.append(msg)


def _tools(body: CountTokensRequest) -> Optional[list[dict]]:
    if not body.tools:
        return None
    tools = []
    for i, t in enumerate(body.tools):
        if t.type not in (None, "custom"):
            # A server tool (web search, code execution, ...) runs on Anthropic's side; there is nothing
            # here to run it, so the model is not told about it.
            log.info("tools[%d]: server tool %r is not available here; left out", i, t.type)
            continue
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema or {"type": "object", "properties": {}}}
        if t.description:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    return tools or None


def _tool_choice(body: CountTokensRequest) -> ToolChoice:
    c = body.tool_choice
    if c is None:
        return ToolChoice()
    if c.type == "tool":
        if not c.name:
            raise APIError(400, "tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice.name")
        return ToolChoice("named", c.name)
    return ToolChoice({"auto": "auto", "any": "required", "none": "none"}[c.type])


def _plan(state: ServerState, body: CountTokensRequest, max_tokens: Optional[int], **sampling: Any) -> ChatPlan:
    kwargs: dict[str, Any] = {}
    if body.thinking is not None:
        kwargs["enable_thinking"] = body.thinking.type != "disabled"
    config = body.output_config.model_extra if body.output_config is not None else {}
    if config.get("effort"):
        kwargs["reasoning_effort"] = config["effort"]
    fmt = config.get("format") or {}
    if fmt and (fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict)):
        raise APIError(400, "output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config.format")
    params = sampling_params(state, max_tokens, **sampling)
    parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    return plan_chat(state, anthropic_messages(body.system, body.messages), params, max_tokens,
                     tools=_tools(body), tool_choice=_tool_choice(body), parallel_tool_calls=parallel,
                     json_schema=fmt.get("schema") if fmt else None, template_kwargs=kwargs)


def _usage(out: ChatOutput) -> dict:
    return {"input_tokens": out.prompt_tokens - out.cached_tokens, "output_tokens": out.output_tokens,
            "cache_read_input_tokens": out.cached_tokens, "cache_creation_input_tokens": 0}


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    require_model(request.app.state.tidal, body.model)
    plan = await run_in_threadpool(_plan, request.app.state.tidal, body, 1)
    return {"input_tokens": len(plan.prompt_ids)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    state: ServerState = request.app.state.tidal
    require_model(state, body.model)
    plan = await run_in_threadpool(_plan, state, body, body.max_tokens, temperature=body.temperature,
                                   top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences)
    mid = f"msg_{uuid.uuid4().hex}"
    stream = start_generation(state, plan.prompt_ids, plan.params, mid)
    out = ChatOutput(plan, state.eos_token_ids, state.tokenizer)
    if body.stream:
        return sse_response(_events(state, out, stream, mid))

    async def collect() -> None:
        async for o in stream:
            out.push(o)

    await unless_disconnected(request, collect(), stream)
    content: list[dict] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not out.tool_calls:
        content.append({"type": "text", "text": out.final_content()})
    for c in out.tool_calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)})
    return {"id": mid, "type": "message", "role": "assistant", "model": state.model_name, "content": content,
            "stop_reason": _STOP_REASON[out.kind], "stop_sequence": out.stop_sequence, "usage": _usage(out)}


async def _events(state: ServerState, out: ChatOutput, stream: AsyncIterator, mid: str) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, then per content block content_block_start,
    content_block_delta..., content_block_stop, then message_delta and message_stop. A ping follows
    the first block's start (as Anthropic's own stream does) and keeps the connection alive while
    nothing else is sent."""
    yield sse({"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": state.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(out.plan.prompt_ids), "output_tokens": 0,
                  "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}}, "message_start")
    index, open_kind = -1, None

    def start(block: dict) -> list[str]:
        nonlocal index, open_kind
        msgs = stop()
        index += 1
        open_kind = block["type"]
        msgs.append(sse({"type": "content_block_start", "index": index, "content_block": block},
                        "content_block_start"))
        if index == 0:
            msgs.append(PING)
        return msgs

    def stop() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        msgs = []
        if open_kind == "thinking":
            msgs.append(delta({"type": "signature_delta", "signature": ""}))
        msgs.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
        open_kind = None
        return msgs

    def delta(d: dict) -> str:
        return sse({"type": "content_block_delta", "index": index, "delta": d}, "content_block_delta")

    def render(event: Any) -> list[str]:
        msgs: list[str] = []
        if isinstance(event, Reasoning):
            if open_kind != "thinking":
                msgs += start({"type": "thinking", "thinking": "", "signature": ""})
            msgs.append(delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, Text):
            if open_kind != "text":
                msgs += start({"type": "text", "text": ""})
            msgs.append(delta({"type": "text_delta", "text": event.text}))
        else:   # a whole tool call: its block opens, carries the arguments, and closes at once
            msgs += start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
            msgs.append(delta({"type": "input_json_delta", "partial_json": event.arguments}))
            msgs += stop()
        return msgs

    pacer = Pacer(state.keepalive_s)
    try:
        async with aclosing(with_heartbeat(stream, state.keepalive_s)) as items:
            async for item in items:
                msgs = [PING] if item is HEARTBEAT else [m for e in out.push(item) for m in render(e)]
                if not msgs and pacer.due():
                    msgs = [PING]
                for m in msgs:
                    yield m
                if msgs:
                    pacer.sent()
    except Exception as e:  # failed after the stream started: Anthropic's error event
        yield sse(anthropic_body(from_exception(e)), "error")
        return
    if index < 0:
        for m in start({"type": "text", "text": ""}):
            yield m
    for m in stop():
        yield m
    usage = _usage(out)
    yield sse({"type": "message_delta", "delta": {"stop_reason": _STOP_REASON[out.kind],
                                                  "stop_sequence": out.stop_sequence}, "usage": usage},
              "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
