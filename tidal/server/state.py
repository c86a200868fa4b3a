"""What every route handler needs, resolved once when the app is created."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from tidal.server.parsers import resolve_reasoning_parser, resolve_tool_parser


@dataclass
class ServerState:
    engine: Any                      # an AsyncEngine, or anything with its interface (tests inject fakes)
    model_name: str
    tokenizer: Any                   # tidal.tokenizer.Tokenizer, or None for a model without one
    tool_parser: Optional[str]       # resolved name, None = no tool-call parsing
    reasoning_parser: Optional[str]  # resolved name, None = no reasoning split
    keepalive_s: float               # SSE keep-alive / ping interval while nothing else is sent
    api_key: Optional[str] = None
    sampling_defaults: dict = field(default_factory=dict)   # from the model's generation_config.json
    eos_token_ids: frozenset = frozenset()
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, engine: Any, model_name: str, api_key: Optional[str], tool_parser: str,
              reasoning_parser: str, keepalive_s: float) -> "ServerState":
        tok = getattr(engine, "tokenizer", None)
        templates = "\n".join(getattr(tok, "chat_templates", {}).values()) if tok is not None else ""
        eos = set(getattr(tok, "eos_token_ids", ()) or ())
        inner = getattr(engine, "engine", None)
        eos |= set(getattr(inner, "eos_token_ids", ()) or getattr(engine, "eos_token_ids", ()) or ())
        return cls(engine=engine, model_name=model_name, tokenizer=tok,
                   tool_parser=resolve_tool_parser(tool_parser, templates),
                   reasoning_parser=resolve_reasoning_parser(reasoning_parser, templates),
                   keepalive_s=keepalive_s, api_key=api_key, sampling_defaults=_sampling_defaults(engine),
                   eos_token_ids=frozenset(eos))


def _sampling_defaults(engine: Any) -> dict:
    """Defaults a request gets for fields it leaves out: the checkpoint's recommended sampling
    (generation_config.json), as model cards expect; otherwise the APIs' own default (temperature 1)."""
    explicit = getattr(engine, "sampling_defaults", None)
    if isinstance(explicit, dict):
        return dict(explicit)
    gen = getattr(getattr(getattr(engine, "engine", None), "loaded", None), "generation_config", None) or {}
    out = {}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if isinstance(gen.get(key), (int, float)) and not isinstance(gen.get(key), bool):
            out[key] = gen[key]
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    return out
