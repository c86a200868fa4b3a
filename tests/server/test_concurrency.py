"""Eight greedy streams at once return exactly what each returns alone.

The reference for each request is its output on a server without a prefix cache, run alone. The same
request alone on the prefix-cached server (later ones reuse the pages of earlier ones: the system
prompt is shared) and all eight at once in one batch (reusing their own cached prompts) must match it
token for token. The engine is held at its first step until all eight have arrived, so they are
provably decoded together.
"""
from __future__ import annotations

import asyncio
import threading

import anthropic
import openai

from tests.server.conftest import MODEL, assert_kv_pages_released, wait_until

SYSTEM = ("You are a patient tutor. Explain programming ideas to a beginner with a short example in "
          "Python, then one sentence on when to use it. Keep answers under a hundred words and avoid "
          "jargon unless you define it first.")
TOPICS = ["a for loop", "a dictionary", "list slicing", "a while loop with a break", "string formatting",
          "reading a text file line by line", "a function with default arguments", "exceptions and try/except"]
N = len(TOPICS)


def request(i: int) -> tuple[str, dict]:
    """Request i: even ones through OpenAI (eos ignored, fixed length), odd ones through Anthropic (no
    ignore_eos there: it may end at eos, which is as deterministic)."""
    user = f"Explain {TOPICS[i]}." + " Please be brief." * (i % 3)
    if i % 2 == 0:
        return "openai", dict(model=MODEL, max_tokens=20 + 2 * i, temperature=0, logprobs=True,
                              messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                              stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    return "anthropic", dict(model=MODEL, max_tokens=20 + 2 * i, system=SYSTEM, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": user}])


async def stream_one(url: str, i: int) -> dict:
    """Run request i as a stream; its text, tokens (OpenAI), finish reason, usage."""
    api, kw = request(i)
    if api == "openai":
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            text, tokens, finish, usage = [], [], None, None
            async for c in await client.chat.completions.create(**kw):
                if c.usage is not None:
                    usage = c.usage
                for ch in c.choices:
                    text.append(ch.delta.content or "")
                    tokens += [t.token for t in (ch.logprobs.content if ch.logprobs else None) or []]
                    finish = ch.finish_reason or finish
            return {"text": "".join(text), "tokens": tokens, "finish": finish, "n": usage.completion_tokens,
                    "prompt": usage.prompt_tokens, "cached": usage.prompt_tokens_details.cached_tokens}
    async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0, timeout=120) as client:
        async with client.messages.stream(**kw) as s:
            text = "".join([t async for t in s.text_stream])
            m = await s.get_final_message()
        return {"text": text, "tokens": None, "finish": m.stop_reason, "n": m.usage.output_tokens,
                "prompt": m.usage.input_tokens + m.usage.cache_read_input_tokens,
                "cached": m.usage.cache_read_input_tokens}


def outputs(r: dict) -> tuple:
    return r["text"], r["tokens"], r["finish"], r["n"], r["prompt"]


def test_parallel_greedy_streams_match_solo_runs(server, cold_server, demo_async_engine, cold_async_engine,
                                                 monkeypatch):
    reference = [asyncio.run(stream_one(cold_server.url, i)) for i in range(N)]
    assert all(r["cached"] == 0 for r in reference)
    assert [r["n"] for r in reference[::2]] == [20 + 2 * i for i in range(0, N, 2)]
    assert len({r["text"] for r in reference}) > 1            # different prompts, different answers

    solo = [asyncio.run(stream_one(server.url, i)) for i in range(N)]
    assert [outputs(r) for r in solo] == [outputs(r) for r in reference]
    assert all(r["cached"] > 0 for r in solo[1:])           # the shared system prompt was reused

    # All eight at once: hold the engine's first step until every request has reached it.
    engine = demo_async_engine.engine
    real_step, gate, batch_sizes = engine.step, threading.Event(), []

    def gated_step():
        gate.wait(60)
        outs = real_step()
        batch_sizes.append(len({o.request_id for o in outs}))
        return outs
    monkeypatch.setattr(engine, "step", gated_step)

    async def main():
        tasks = [asyncio.create_task(stream_one(server.url, i)) for i in range(N)]
        try:
            await asyncio.to_thread(wait_until, lambda: sum(demo_async_engine.num_requests()) == N,
                                    30.0, "all requests to reach the engine")
        finally:
            gate.set()
        return await asyncio.gather(*tasks)

    try:
        together = asyncio.run(main())
    finally:
        gate.set()
    assert max(batch_sizes) == N                             # they really were decoded in one batch
    assert [outputs(r) for r in together] == [outputs(r) for r in reference]
    assert all(r["cached"] > 0 for r in together)
    assert_kv_pages_released(demo_async_engine)
    assert_kv_pages_released(cold_async_engine)   # without a prefix cache: every page is free again
