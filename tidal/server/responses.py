"""OpenAI Responses API: POST /v1/responses (text, function tools, reasoning; streaming and not).

The server keeps no conversation state: `previous_response_id` is refused with a message saying to
send the whole conversation (what Codex does with `store: false`). Non-function tools (web search,
file search, ...) are hosted tools this server does not have; they are left out of the prompt.
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from tidal.server.chat import (ChatOutput, ChatPlan, ToolChoice, plan_chat, require_model, sampling_params,
                               start_generation, template_arguments)
from tidal.server.errors import APIError, from_exception
from tidal.server.parsers import Reasoning, ToolCall
from tidal.server.protocol import ResponsesRequest
from tidal.server.sse import HEARTBEAT, KEEPALIVE, Pacer, sse, sse_response, unless_disconnected, with_heartbeat
from tidal.server.state import ServerState

log = logging.getLogger(__name__)
router = APIRouter()


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "reasoning_text", "summary_text") \
                and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{where}[{j}]: {kind} is not supported by this server (text-only model)",
                           f"{where}[{j}]")
        else:
            raise APIError(400, f"{where}[{j}]: unsupported content part type {kind!r}", f"{where}[{j}]")
    return "\n".join(parts)


def responses_messages(body: ResponsesRequest) -> list[dict]:
    """instructions + input items -> the dicts chat templates read."""
    out: list[dict] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        out.append({"role": "user", "content": body.input})
        return out
    reasoning: list[str] = []   # a reasoning item belongs to the assistant turn that follows it
    names: dict[str, str] = {}
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        d = {"type": item.type, **(item.model_extra or {})}
        kind = d.get("type") or ("message" if "role" in d else None)
        if kind == "message":
            role = d.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: must be user, assistant, system or developer, got {role!r}",
                               f"{where}.role")
            msg = {"role": "system" if role == "developer" else role,
                   "content": _content_text(d.get("content", ""), f"{where}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = "\n".join(reasoning), []
            out.append(msg)
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(d.get(key), str):
                    raise APIError(400, f"{where}.{key} is required", f"{where}.{key}")
            names[d["call_id"]] = d["name"]
            call = {"id": d["call_id"], "type": "function",
                    "function": {"name": d["name"], "arguments": template_arguments(d.get("arguments", "{}"))}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)   # parallel calls of one turn
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = "\n".join(reasoning), []
                out.append(msg)
        elif kind == "function_call_output":
            if not isinstance(d.get("call_id"), str):
                raise APIError(400, f"{where}.call_id is required", f"{where}.call_id")
            output = d.get("output", "")
            msg = {"role": "tool", "tool_call_id": d["call_id"],
                   "content": output if isinstance(output, str) else _content_text(output, f"{where}.output")}
            if names.get(d["call_id"]):
                msg["name"] = names[d["call_id"]]
            out.append(msg)
        elif kind == "reasoning":
            text = _content_text(d.get("content") or [], f"{where}.content") or \
                _content_text(d.get("summary") or [], f"{where}.summary")
            if text:
                reasoning.append(text)
        else:
            raise APIError(400, f"{where}.type: input item type {kind!r} is not supported", f"{where}.type")
    return out


def _tools(body: ResponsesRequest) -> Optional[list[dict]]:
    tools = []
    for i, t in enumerate(body.tools or []):
        d = t.model_extra or {}
        if t.type != "function":
            log.info("tools[%d]: hosted tool type %r is not available here; left out", i, t.type)
            continue
        if not isinstance(d.get("name"), str):
            raise APIError(400, f"tools[{i}].name is required", f"tools[{i}].name")
        fn = {"name": d["name"], "parameters": d.get("parameters") or {"type": "object", "properties": {}}}
        if d.get("description"):
            fn["description"] = d["description"]
        tools.append({"type": "function", "function": fn})
    return tools or None


def _tool_choice(body: ResponsesRequest) -> ToolChoice:
    c = body.tool_choice
    if c is None or isinstance(c, str):
        return ToolChoice(c or "auto")
    name = (c.model_extra or {}).get("name")
    if c.type == "function" and isinstance(name, str):
        return ToolChoice("named", name)
    raise APIError(400, "tool_choice: expected 'auto', 'none', 'required' or {\"type\": \"function\", "
                        "\"name\": ...}", "tool_choice")


def _plan(state: ServerState, body: ResponsesRequest) -> ChatPlan:
    if body.previous_response_id:
        raise APIError(400, "previous_response_id: this server does not store responses; send the whole "
                            "conversation in `input`", "previous_response_id")
    kwargs: dict[str, Any] = {}
    effort = (body.reasoning.model_extra or {}).get("effort") if body.reasoning else None
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if effort == "none":
            kwargs["enable_thinking"] = False
    fmt = ((body.text.model_extra or {}).get("format") if body.text else None) or {}
    params = sampling_params(state, body.max_output_tokens, temperature=body.temperature, top_p=body.top_p)
    return plan_chat(state, responses_messages(body), params, body.max_output_tokens, tools=_tools(body),
                     tool_choice=_tool_choice(body), parallel_tool_calls=body.parallel_tool_calls,
                     json_mode=fmt.get("type") == "json_object",
                     json_schema=fmt.get("schema") if fmt.get("type") == "json_schema" else None,
                     template_kwargs=kwargs)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(out: ChatOutput) -> dict:
    return {"input_tokens": out.prompt_tokens, "input_tokens_details": {"cached_tokens": out.cached_tokens},
            "output_tokens": out.output_tokens, "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens()},
            "total_tokens": out.prompt_tokens + out.output_tokens}


def _response(state: ServerState, body: ResponsesRequest, rid: str, created: int, status: str,
              output: list[dict], out: Optional[ChatOutput]) -> dict:
    tool_choice = body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None \
        else body.tool_choice.model_dump()
    incomplete = status == "incomplete"
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": state.model_name,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls, "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump() for t in body.tools or []], "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "usage": _usage(out) if out is not None and out.finished else None}


def _status(out: ChatOutput) -> str:
    return "incomplete" if out.kind == "length" else "completed"


def _reasoning_item(iid: str, text: str, status: str) -> dict:
    return {"id": iid, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def _message_item(iid: str, text: str, status: str) -> dict:
    return {"id": iid, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []}


def _call_item(iid: str, call: ToolCall, status: str) -> dict:
    return {"id": iid, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status != "in_progress" else "", "status": status}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state: ServerState = request.app.state.tidal
    require_model(state, body.model)
    plan = await run_in_threadpool(_plan, state, body)
    rid = _item_id("resp")
    created = int(time.time())
    stream = start_generation(state, plan.prompt_ids, plan.params, rid)
    out = ChatOutput(plan, state.eos_token_ids, state.tokenizer)
    if body.stream:
        return sse_response(_events(state, body, out, stream, rid, created))

    async def collect() -> None:
        async for o in stream:
            out.push(o)

    await unless_disconnected(request, collect(), stream)
    output = []
    if out.reasoning:
        output.append(_reasoning_item(_item_id("rs"), out.reasoning, "completed"))
    if out.content or not out.tool_calls:
        output.append(_message_item(_item_id("msg"), out.final_content(), "completed"))
    output += [_call_item(_item_id("fc"), c, "completed") for c in out.tool_calls]
    return _response(state, body, rid, created, _status(out), output, out)


async def _events(state: ServerState, body: ResponsesRequest, out: ChatOutput, stream: AsyncIterator,
                  rid: str, created: int) -> AsyncIterator[str]:
    seq = 0
    items: list[dict] = []          # finished output items, for the final response
    current: Optional[dict] = None  # {"kind", "id", "index", "text"} of the open text/reasoning item

    def ev(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    def open_item(kind: str) -> list[str]:
        nonlocal current
        msgs = close_item()
        iid = _item_id("rs" if kind == "reasoning" else "msg")
        current = {"kind": kind, "id": iid, "index": len(items), "text": ""}
        if kind == "reasoning":
            msgs.append(ev("response.output_item.added", output_index=current["index"],
                           item=_reasoning_item(iid, "", "in_progress")))
            part = {"type": "reasoning_text", "text": ""}
        else:
            msgs.append(ev("response.output_item.added", output_index=current["index"],
                           item=_message_item(iid, "", "in_progress")))
            part = {"type": "output_text", "text": "", "annotations": []}
        msgs.append(ev("response.content_part.added", item_id=iid, output_index=current["index"],
                       content_index=0, part=part))
        return msgs

    def close_item() -> list[str]:
        nonlocal current
        if current is None:
            return []
        c, current = current, None
        where = dict(item_id=c["id"], output_index=c["index"], content_index=0)
        if c["kind"] == "reasoning":
            item = _reasoning_item(c["id"], c["text"], "completed")
            msgs = [ev("response.reasoning_text.done", text=c["text"], **where),
                    ev("response.content_part.done", part={"type": "reasoning_text", "text": c["text"]}, **where)]
        else:
            item = _message_item(c["id"], c["text"], "completed")
            msgs = [ev("response.output_text.done", text=c["text"], logprobs=[], **where),
                    ev("response.content_part.done", part=item["content"][0], **where)]
        msgs.append(ev("response.output_item.done", output_index=c["index"], item=item))
        items.append(item)
        return msgs

    def call(event: ToolCall) -> list[str]:
        msgs = close_item()
        iid, index = _item_id("fc"), len(items)
        msgs.append(ev("response.output_item.added", output_index=index, item=_call_item(iid, event, "in_progress")))
        msgs.append(ev("response.function_call_arguments.delta", item_id=iid, output_index=index,
                       delta=event.arguments))
        msgs.append(ev("response.function_call_arguments.done", item_id=iid, output_index=index,
                       arguments=event.arguments, name=event.name))
        item = _call_item(iid, event, "completed")
        msgs.append(ev("response.output_item.done", output_index=index, item=item))
        items.append(item)
        return msgs

    yield ev("response.created", response=_response(state, body, rid, created, "in_progress", [], None))
    yield ev("response.in_progress", response=_response(state, body, rid, created, "in_progress", [], None))
    def render(event: Any) -> list[str]:
        if isinstance(event, ToolCall):
            return call(event)
        kind = "reasoning" if isinstance(event, Reasoning) else "message"
        msgs = open_item(kind) if current is None or current["kind"] != kind else []
        current["text"] += event.text
        where = dict(item_id=current["id"], output_index=current["index"], content_index=0)
        if kind == "reasoning":
            msgs.append(ev("response.reasoning_text.delta", delta=event.text, **where))
        else:
            msgs.append(ev("response.output_text.delta", delta=event.text, logprobs=[], **where))
        return msgs

    pacer = Pacer(state.keepalive_s)
    try:
        async with aclosing(with_heartbeat(stream, state.keepalive_s)) as source:
            async for item in source:
                msgs = [KEEPALIVE] if item is HEARTBEAT else [m for e in out.push(item) for m in render(e)]
                if not msgs and pacer.due():
                    msgs = [KEEPALIVE]
                for m in msgs:
                    yield m
                if msgs:
                    pacer.sent()
    except Exception as e:
        err = from_exception(e)
        yield ev("error", code="server_error" if err.status >= 500 else "invalid_request_error",
                 message=err.message, param=err.param)
        return
    if not items and current is None:
        for m in open_item("message"):
            yield m
    for m in close_item():
        yield m
    status = _status(out)
    final = _response(state, body, rid, created, status, items, out)
    yield ev("response.completed" if status == "completed" else "response.incomplete", response=final)

