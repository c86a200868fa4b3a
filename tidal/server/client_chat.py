"""`tidal chat --url URL`: a terminal chat with a running `tidal serve` (or any OpenAI-compatible
server), streaming from /v1/chat/completions with httpx (already a dependency; no SDK needed).

Reasoning is shown dimmed when the terminal supports it and is not sent back in the history, as chat
templates drop earlier turns' reasoning anyway. Ctrl-C while a reply streams stops that reply (closing
the connection aborts it on the server) and keeps the conversation; Ctrl-C at the prompt quits.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterator, Optional, TextIO

import httpx

from tidal.errors import TidalError
from tidal.repl import chat_repl

DIM, RESET = "\033[2m", "\033[0m"


def api_base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _headers(api_key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(response: httpx.Response) -> str:
    try:
        body = json.loads(response.read())
        return body.get("error", {}).get("message") or str(body)
    except (ValueError, AttributeError):
        return response.text


def server_model(client: httpx.Client, base: str) -> str:
    """The first model the server lists (tidal serve lists exactly one)."""
    try:
        r = client.get(f"{base}/models")
    except httpx.HTTPError as e:
        raise TidalError(f"cannot reach {base}: {e}") from None
    if r.status_code != 200:
        raise TidalError(f"{base}/models answered {r.status_code}: {_error_text(r)}")
    data = r.json().get("data") or []
    if not data:
        raise TidalError(f"{base}/models lists no model")
    return data[0]["id"]


def sse_data(lines: Iterator[str]) -> Iterator[dict]:
    """JSON payloads of an SSE stream's `data:` lines, until `[DONE]` (comments are keep-alives)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def stream_reply(client: httpx.Client, base: str, body: dict, out: Optional[TextIO] = None,
                 dim: bool = False) -> tuple[str, str]:
    """POST a streaming chat completion, writing text to `out` (stdout) as it arrives; returns
    (content, reasoning)."""
    out = out or sys.stdout
    content, reasoning = [], []
    in_reasoning = False
    with client.stream("POST", f"{base}/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise TidalError(f"the server answered {r.status_code}: {_error_text(r)}")
        for chunk in sse_data(r.iter_lines()):
            if "error" in chunk:
                raise TidalError(f"the server failed: {chunk['error'].get('message')}")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                think = delta.get("reasoning_content") or delta.get("reasoning")
                if think:
                    if not in_reasoning and dim:
                        out.write(DIM)
                    in_reasoning = True
                    reasoning.append(think)
                    out.write(think)
                text = delta.get("content")
                if text:
                    if in_reasoning:
                        out.write((RESET if dim else "") + "\n")
                        in_reasoning = False
                    content.append(text)
                    out.write(text)
                out.flush()
    if in_reasoning and dim:
        out.write(RESET)
    return "".join(content), "".join(reasoning)


def request_body(args: Any, model: str, messages: list[dict]) -> dict:
    """The chat request from the CLI's sampling flags (extensions go as extra fields)."""
    body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": args.top_p}
    for key in ("top_k", "min_p", "repetition_penalty", "seed"):
        value = getattr(args, key, None)
        if value is not None:
            body[key] = value
    if getattr(args, "stop", None):
        body["stop"] = list(args.stop)
    if getattr(args, "ignore_eos", False):
        body["ignore_eos"] = True
    return body


def chat_with_server(args: Any) -> int:
    base = api_base(args.url)
    api_key = getattr(args, "api_key", None) or os.environ.get("TIDAL_API_KEY")
    dim = sys.stdout.isatty()
    system = getattr(args, "system", None)
    with httpx.Client(headers=_headers(api_key), timeout=httpx.Timeout(30.0, read=None)) as client:
        model = server_model(client, base)

        def reply(messages: list[dict]):
            try:
                text, _ = stream_reply(client, base, request_body(args, model, messages), dim=dim)
            except KeyboardInterrupt:
                return None
            except httpx.HTTPError as e:
                raise TidalError(f"lost the connection to {base}: {e}") from None
            return text

        return chat_repl(reply, system, f"tidal chat with {model} at {base}")
