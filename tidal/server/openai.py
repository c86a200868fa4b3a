"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

Wire formats follow OpenAI's API reference; engine extensions that vLLM popularised (top_k, min_p,
repetition_penalty, ignore_eos, chat_template_kwargs, `reasoning_content` on messages and deltas) are
accepted too because agent frontends send them.
"""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from tidal.server.chat import (ChatOutput, ChatPlan, ToolChoice, default_max_tokens, plan_chat, require_model,
                               require_tokenizer, sampling_params, start_generation, template_arguments, token_text)
from tidal.server.errors import APIError, from_exception, openai_body
from tidal.server.parsers import Reasoning, Text, ToolCall
from tidal.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tidal.server.sse import HEARTBEAT, KEEPALIVE, Pacer, sse, sse_response, unless_disconnected, with_heartbeat
from tidal.server.state import ServerState
from tidal.types import TokenLogprob

router = APIRouter()
_FINISH = {"tool_calls": "tool_calls", "stop_sequence": "stop", "stop": "stop", "length": "length",
           "abort": "stop"}


def _state(request: Request) -> ServerState:
    return request.app.state.tidal


def _model_card(state: ServerState) -> dict:
    # One object readable as both an OpenAI model and an Anthropic model (each SDK ignores the other's
    # fields), so either client can list models from the same URL.
    created = datetime.fromtimestamp(state.created, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tidal",
            "type": "model", "display_name": state.model_name, "created_at": created,
            "max_model_len": getattr(state.engine, "max_model_len", None)}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = _state(request)
    return {"object": "list", "data": [_model_card(state)], "has_more": False, "first_id": state.model_name,
            "last_id": state.model_name}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    state = _state(request)
    require_model(state, model_id)
    return _model_card(state)


# -- request translation ---------------------------------------------------------------------------------
def _text_content(content: Any, where: str) -> str:
    """A message's content as one string; non-text parts are rejected (this server reads text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = getattr(part, "type", None)
        text = getattr(part, "text", None)
        if kind in ("text", "input_text", "output_text") and isinstance(text, str):
            parts.append(text)
        elif kind in ("image_url", "input_image", "image"):
            raise APIError(400, f"{where}[{j}]: image input is not supported by this server (text-only model)",
                           f"{where}[{j}]")
        else:
            raise APIError(400, f"{where}[{j}]: unsupported content part type {kind!r}", f"{where}[{j}]")
    return "\n".join(parts)


def openai_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI chat messages -> the dicts chat templates read."""
    out, call_names = [], {}
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _text_content(m.content, f"messages[{i}].content")}
        if m.tool_calls:
            msg["tool_calls"] = []
            for c in m.tool_calls:
                cid = c.id or f"call_{uuid.uuid4().hex[:24]}"
                call_names[cid] = c.function.name
                msg["tool_calls"].append({"id": cid, "type": "function", "function": {
                    "name": c.function.name, "arguments": template_arguments(c.function.arguments)}})
        if m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(400, f"messages[{i}].tool_call_id is required for role 'tool'",
                               f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
            name = m.name or call_names.get(m.tool_call_id)
            if name:
                msg["name"] = name
        elif m.name:
            msg["name"] = m.name
        reasoning = m.reasoning_content or m.reasoning
        if reasoning and m.role == "assistant":
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def tool_choice_from_openai(choice: Any) -> ToolChoice:
    if choice is None or isinstance(choice, str):
        return ToolChoice(choice or "auto")
    return ToolChoice("named", choice.function.name)


def usage_dict(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _usage(out: ChatOutput) -> dict:
    usage = usage_dict(out.prompt_tokens, out.output_tokens, out.cached_tokens)
    usage["completion_tokens_details"] = {"reasoning_tokens": out.reasoning_tokens()}
    return usage


def chat_logprobs(tokenizer: Any, items: list[TokenLogprob]) -> dict:
    def entry(tid: int, lp: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in items]}


def _chat_plan(state: ServerState, body: ChatCompletionRequest) -> ChatPlan:
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(
        state, max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos or None,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        skip_special_tokens=body.skip_special_tokens)
    # Keys that apply_chat_template takes itself cannot be template variables.
    kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items()
              if k not in ("messages", "tools", "add_generation_prompt", "tokenize", "conversation")}
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if body.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
    fmt = body.response_format
    schema = None
    if fmt is not None and fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema", {})
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    for t in tools or []:   # templates read `parameters` without checking that it is there
        t["function"].setdefault("parameters", {"type": "object", "properties": {}})
    return plan_chat(state, openai_messages(body.messages), params, max_tokens, tools=tools,
                     tool_choice=tool_choice_from_openai(body.tool_choice),
                     parallel_tool_calls=body.parallel_tool_calls,
                     json_mode=fmt is not None and fmt.type == "json_object", json_schema=schema,
                     template_kwargs=kwargs)


def _tool_call_dict(call: ToolCall, index: Optional[int] = None) -> dict:
    d = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return d if index is None else {"index": index, **d}


# -- chat completions -----------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    require_model(state, body.model)
    # Rendering and tokenizing a long agent prompt takes a while: keep it off the event loop.
    plan = await run_in_threadpool(_chat_plan, state, body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = start_generation(state, plan.prompt_ids, plan.params, rid)
    out = ChatOutput(plan, state.eos_token_ids, state.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chat_events(state, out, stream, rid, created, body.logprobs, include_usage))

    async def collect() -> None:
        async for o in stream:
            out.push(o)

    await unless_disconnected(request, collect(), stream)
    message: dict[str, Any] = {"role": "assistant", "content": out.final_content() or
                               (None if out.tool_calls else "")}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [_tool_call_dict(c) for c in out.tool_calls]
    return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": _FINISH[out.kind],
                         "logprobs": chat_logprobs(state.tokenizer, out.logprobs) if body.logprobs else None}],
            "usage": _usage(out)}


async def _chat_events(state: ServerState, out: ChatOutput, stream: AsyncIterator, rid: str, created: int,
                       want_logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: Optional[str] = None) -> str:
        lp = None
        if want_logprobs and len(out.logprobs) > sent_logprobs[0]:
            # Logprobs ride on the next chunk sent: a parser may hold a token's text back for a while.
            lp = chat_logprobs(state.tokenizer, out.logprobs[sent_logprobs[0]:])
            sent_logprobs[0] = len(out.logprobs)
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

    def render(event: Any) -> str:
        if isinstance(event, Text):
            return chunk({"content": event.text})
        if isinstance(event, Reasoning):
            return chunk({"reasoning_content": event.text})
        calls[0] += 1
        return chunk({"tool_calls": [_tool_call_dict(event, calls[0] - 1)]})

    sent_logprobs, calls = [0], [0]
    pacer = Pacer(state.keepalive_s)
    yield chunk({"role": "assistant", "content": ""})
    try:
        async with aclosing(with_heartbeat(stream, state.keepalive_s)) as items:
            async for item in items:
                msgs = [KEEPALIVE] if item is HEARTBEAT else [render(e) for e in out.push(item)]
                if not msgs and pacer.due():
                    msgs = [KEEPALIVE]
                for m in msgs:
                    yield m
                if msgs:
                    pacer.sent()
    except Exception as e:  # the request failed after streaming started: say so in OpenAI's shape
        yield sse(openai_body(from_exception(e)))
        return
    yield chunk({}, _FINISH[out.kind])
    if include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                   "choices": [], "usage": _usage(out)})
    yield sse("[DONE]")


# -- legacy completions ---------------------------------------------------------------------------------
def _prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "prompt: only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return require_tokenizer(state).encode(prompt)
    return [int(t) for t in prompt]


def completion_logprobs(tokenizer: Any, items: list[TokenLogprob], offset: int) -> dict:
    tokens, offsets = [], []
    for x in items:
        text = token_text(tokenizer, x.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in items],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in x.top} for x in items],
            "text_offset": offsets}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    require_model(state, body.model)
    if body.suffix:
        raise APIError(400, "suffix: insertion (fill-in-the-middle) is not supported", "suffix")
    ids = await run_in_threadpool(_prompt_ids, state, body.prompt)
    params = sampling_params(
        state, body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed, stop=body.stop,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos or None, logprobs=body.logprobs,
        skip_special_tokens=body.skip_special_tokens)
    if body.max_tokens is None:
        params.max_tokens = default_max_tokens(state, len(ids))
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    echo = ""
    if body.echo:
        echo = state.tokenizer.decode(ids) if state.tokenizer is not None else ""
    stream = start_generation(state, ids, params, rid)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_completion_events(state, stream, rid, created, echo, body.logprobs, include_usage))
    text, lps, last = [], [], None

    async def collect() -> None:
        nonlocal last
        async for o in stream:
            text.append(o.new_text)
            lps.extend(o.new_logprobs)
            last = o

    await unless_disconnected(request, collect(), stream)
    full = echo + "".join(text)
    return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": [{"index": 0, "text": full, "finish_reason": _finish(last),
                         "logprobs": completion_logprobs(state.tokenizer, lps, len(echo))
                         if body.logprobs is not None else None}],
            "usage": usage_dict(len(ids), last.num_output_tokens if last else 0,
                                last.num_cached_tokens if last else 0)}


def _finish(last: Any) -> Optional[str]:
    reason = getattr(last, "finish_reason", None)
    return "length" if reason == "length" else "stop" if reason else None


async def _completion_events(state: ServerState, stream: AsyncIterator, rid: str, created: int, echo: str,
                             logprobs: Optional[int], include_usage: bool) -> AsyncIterator[str]:
    def chunk(text: str, finish: Optional[str] = None, lp: Optional[dict] = None) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]})

    offset = len(echo)
    if echo:
        yield chunk(echo)
    last = None
    try:
        async with aclosing(with_heartbeat(stream, state.keepalive_s)) as items:
            async for item in items:
                if item is HEARTBEAT:
                    yield KEEPALIVE
                    continue
                last = item
                lp = completion_logprobs(state.tokenizer, item.new_logprobs, offset) if logprobs is not None else None
                offset += len(item.new_text)
                if item.new_text or lp or item.finished:
                    yield chunk(item.new_text, _finish(item) if item.finished else None, lp)
    except Exception as e:
        yield sse(openai_body(from_exception(e)))
        return
    if include_usage and last is not None:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [], "usage": usage_dict(last.num_prompt_tokens, last.num_output_tokens,
                                                      last.num_cached_tokens)})
    yield sse("[DONE]")

