"""GET /metrics in Prometheus' text exposition format (version 0.0.4), written by hand: a handful of
series does not justify a dependency.

Series come from `AsyncEngine.metrics()`; the expert runtime's own counters (hit rate, q/m, fills,
...) are exported under `tidal_experts_*` whatever their names, so new counters need no change here.
"""
from __future__ import annotations

import math
import re
from typing import Any

from tidal.engine.async_engine import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _num(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def _label(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_").lower() or "value"


class _Writer:
    def __init__(self, model: str):
        self.lines: list[str] = []
        self.model = _label(model)

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[str, dict, float]]) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for suffix, labels, value in samples:
            lab = ",".join([f'model_name="{self.model}"'] + [f'{k}="{_label(v)}"' for k, v in labels.items()])
            self.lines.append(f"{name}{suffix}{{{lab}}} {_num(value)}")

    def simple(self, name: str, kind: str, help_: str, value: float) -> None:
        self.metric(name, kind, help_, [("", {}, value)])

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        cum = h.cumulative()
        samples = [("_bucket", {"le": _num(float(b))}, c) for b, c in zip(h.buckets, cum)]
        samples += [("_bucket", {"le": "+Inf"}, cum[-1]), ("_sum", {}, h.total), ("_count", {}, h.count)]
        self.metric(name, "histogram", help_, samples)


def render(snapshot: dict, model_name: str) -> str:
    """The exposition text for one `AsyncEngine.metrics()` snapshot."""
    w = _Writer(model_name)
    s = snapshot
    w.simple("tidal_requests_running", "gauge", "Requests holding KV cache (prefilling or decoding).",
             s.get("running", 0))
    w.simple("tidal_requests_waiting", "gauge", "Requests queued for admission.", s.get("waiting", 0))
    finished = s.get("requests_finished", {})
    w.metric("tidal_requests_finished_total", "counter", "Finished requests by finish reason.",
             [("", {"reason": r}, n) for r, n in sorted(finished.items())] or [("", {"reason": "stop"}, 0)])
    w.simple("tidal_request_errors_total", "counter", "Requests failed by an engine error.",
             s.get("request_errors", 0))
    w.simple("tidal_step_errors_total", "counter", "Engine steps that raised.", s.get("step_errors", 0))
    w.simple("tidal_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", s.get("prompt_tokens", 0))
    w.simple("tidal_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
             s.get("cached_prompt_tokens", 0))
    w.simple("tidal_generation_tokens_total", "counter", "Generated tokens.", s.get("generation_tokens", 0))
    w.simple("tidal_generation_tokens_per_second", "gauge", "Generated tokens per second, last 10 s.",
             s.get("tokens_per_second", 0.0))
    w.simple("tidal_engine_steps_total", "counter", "Engine steps run.", s.get("steps", 0))
    w.simple("tidal_engine_step_seconds_total", "counter", "Time spent in engine steps.", s.get("step_seconds", 0.0))
    if "ttft" in s:
        w.histogram("tidal_time_to_first_token_seconds", "Arrival to first generated token.", s["ttft"])
    if "itl" in s:
        w.histogram("tidal_inter_token_latency_seconds", "Time between generated tokens of a request.", s["itl"])
    experts = s.get("experts") or {}
    info = {k: v for k, v in experts.items() if isinstance(v, str)}
    if info:
        w.metric("tidal_experts_info", "gauge", "Expert runtime settings.", [("", info, 1)])
    for key, value in sorted(experts.items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            w.simple(f"tidal_experts_{_name(key)}", "gauge", f"Expert runtime counter {key!r}.", value)
    return "\n".join(w.lines) + "\n"
