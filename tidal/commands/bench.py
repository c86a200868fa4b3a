"""`tidal bench decode`: decode speed per GPU budget and expert policy, side by side in one run.

The model is loaded once; each (budget, policy) row re-plans the GPU budget and rebuilds only the
expert runtime. Each row prefills one prompt of --prompt-len random tokens, then generates --gen
tokens (eos ignored) and reports decode tok/s next to the bandwidth bound of DESIGN.md:
  missed bytes per token = miss rate * MoE layers * top_k * S
  bound time per token   = max(missed bytes / (B_P + B_R), (dense + hit bytes) / HBM bandwidth)
with B_R the CPU kernel's rate while copies run (measured concurrently).

--routing SPEC (default `model`) takes the expert ids from a synthetic or recorded source instead of
the router's choice (the router still runs, at the same cost): random weights route almost uniformly,
which hides what a cache is for. Specs are in tidal/experts/routing.py. The source restarts before
every row, so all rows see the same expert ids and their miss rates compare policies, not luck.
Benchmarks only: serving always uses the model's routing.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from tidal.types import SamplingParams

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def configure(p) -> None:
    from tidal.cli import add_model_args

    sub = p.add_subparsers(dest="bench", required=True)
    d = sub.add_parser("decode", help="decode tok/s per budget and policy")
    add_model_args(d)
    d.add_argument("--budgets", default="16,24,32,0", help="comma-separated GiB; 0 = uncapped (all resident)")
    d.add_argument("--policies", default="qstar,transfer,cpu,static")
    d.add_argument("--prompt-len", type=int, default=2048)
    d.add_argument("--gen", type=int, default=256)
    d.add_argument("--routing", default="model", metavar="SPEC",
                   help="where expert ids come from: model (the router) | uniform | zipf:S,reuse:P (Zipf(S) "
                        "popularity; P = chance a token repeats the previous token's experts) | trace:FILE "
                        "(replay a `tidal trace` file's decode steps); the router always runs")
    d.add_argument("--json-out", default=None, help="also write the rows as JSON here")
    d.set_defaults(func=run_decode)


def _hbm_bandwidth() -> float:
    if not torch.cuda.is_available():
        return 0.0
    name = torch.cuda.get_device_name()
    return next((v for k, v in HBM_BYTES_PER_S.items() if k in name), 1.0e12)


def _one_row(engine, prompt: list[int], gen: int) -> dict:
    from tidal.experts.runtime import OffloadExperts

    rid = engine.add_request(prompt, SamplingParams(max_tokens=gen, ignore_eos=True))
    t0 = time.perf_counter()
    first = None
    runtime = engine.loaded.experts
    n = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                n += len(o.new_token_ids)
                if first is None:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    first = time.perf_counter()
                    if isinstance(runtime, OffloadExperts):
                        runtime.take_step_stats()  # count decode steps only
    end = time.perf_counter()
    row = {"ttft_s": first - t0, "decode_tok_s": (n - 1) / (end - first) if n > 1 else 0.0}
    if isinstance(runtime, OffloadExperts):
        st = runtime.take_step_stats()
        row.update(miss_rate=st.misses / max(1, st.hits + st.misses), q_over_m=st.fills / max(1, st.misses),
                   b_p=runtime.bandwidth.b_p, b_h=runtime.bandwidth.b_h,
                   b_r=runtime.bandwidth.b_cpu_concurrent or runtime.bandwidth.b_h - runtime.bandwidth.b_p,
                   cpu_s_per_tok=st.cpu_seconds / max(1, n - 1), gpu_s_per_tok=st.gpu_seconds / max(1, n - 1))
    else:
        row.update(miss_rate=0.0, q_over_m=0.0)
    return row


def _bound(engine, row: dict) -> float:
    cfg = engine.model_config
    S = engine.loaded.pool.expert_bytes
    x = len(cfg.moe_layers) * cfg.top_k * S
    missed = row["miss_rate"] * x
    from tidal.runner.loader import dense_bytes

    hbm = _hbm_bandwidth() or 1e12
    gpu_t = (dense_bytes(engine.loaded.model) + (1 - row["miss_rate"]) * x) / hbm
    miss_t = missed / (row.get("b_p", 1) + row.get("b_r", 0)) if missed else 0.0
    return 1.0 / max(gpu_t, miss_t)


def run_decode(args) -> int:
    from tidal.cli import engine_from_args
    from tidal.experts.routing import parse_routing
    from tidal.layers.moe import set_routing_override

    source = parse_routing(args.routing)  # before loading: a bad spec fails fast
    routing = source.spec if source is not None else "model"
    budgets = [float(b) for b in args.budgets.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    args.max_model_len = args.max_model_len or args.prompt_len + args.gen + 16
    args.max_running = 1
    args.max_batch_tokens = min(args.max_batch_tokens, args.prompt_len)
    # Every row replays the same prompt: a prefix-cache hit would skip its prefill (and with it
    # the prefill-time placement that the `cpu` policy depends on).
    args.no_prefix_cache = True
    engine = engine_from_args(args)
    set_routing_override(engine.loaded.model, source)   # this engine is never served
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.model_config.vocab_size, (args.prompt_len,), generator=gen).tolist()
    _report_routing_diversity(engine, prompt[:512], routing)
    rows = []
    for budget in budgets:
        for policy in (policies if budget else [None]):
            engine.reconfigure_experts(gpu_memory=budget or None, moe_policy=policy)
            if source is not None:
                source.reset()        # every row sees the same expert ids
            row = _one_row(engine, prompt, args.gen)
            row.update(budget_gib=budget or "uncapped", policy=policy or "all-resident", routing=routing,
                       slots=engine.memory_plan.expert_slots, experts=engine.memory_plan.total_experts)
            row["bound_tok_s"] = _bound(engine, row)
            row["achieved_over_bound"] = row["decode_tok_s"] / row["bound_tok_s"]
            rows.append(row)
            print(_format_row(row), file=sys.stderr, flush=True)
    print(_table(rows, engine, args))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def _report_routing_diversity(engine, prompt: list[int], routing: str = "model") -> None:
    """Dummy weights must route like a trained model: a 512-token batch should touch >= 95% of each
    layer's experts with no expert above 3x its uniform share. Print what this model does (or what
    the --routing source does, when one is installed)."""
    runtime = engine.loaded.experts
    seen: dict[int, torch.Tensor] = {}
    inner = runtime.forward

    def recording(layer, hidden, ids, weights):
        # Accumulate: with --max-batch-tokens below the prompt length the batch comes in chunks.
        flat = ids.reshape(-1).cpu()
        seen[layer] = torch.cat([seen[layer], flat]) if layer in seen else flat
        return inner(layer, hidden, ids, weights)

    runtime.forward = recording
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        del runtime.forward
    E, K = engine.model_config.num_experts, engine.model_config.top_k
    touched = [int(torch.unique(v).numel()) for v in seen.values()]
    share = [float(torch.bincount(v, minlength=E).max()) / (len(prompt) * K / E) for v in seen.values()]
    print(f"routing ({routing}) of a {len(prompt)}-token batch: experts touched per layer min {min(touched)}/{E} "
          f"({100 * min(touched) / E:.0f}%), mean {sum(touched) / len(touched):.1f}; busiest expert "
          f"max {max(share):.2f}x its uniform share", file=sys.stderr, flush=True)


def _format_row(r: dict) -> str:
    return (f"routing {r['routing']} budget {r['budget_gib']} policy {r['policy']}: {r['decode_tok_s']:.1f} tok/s, "
            f"miss {100 * r['miss_rate']:.1f}%, q/m {r['q_over_m']:.2f}, TTFT {r['ttft_s']:.2f}s")


def _table(rows: list[dict], engine, args) -> str:
    head = ("| budget GiB | policy | cache slots | decode tok/s | miss rate | q/m | B_P GB/s | B_H GB/s | "
            "bound tok/s | achieved/bound | TTFT s |")
    routing = rows[0]["routing"] if rows else args.routing
    lines = [f"model {engine.model_config.model_type} ({args.model}), prompt {args.prompt_len}, gen {args.gen}, "
             f"device {engine.device}, routing {routing}", "", head, "|" + "---|" * 11]
    for r in rows:
        bp = f"{r['b_p'] / 1e9:.1f}" if "b_p" in r else "-"
        bh = f"{r['b_h'] / 1e9:.1f}" if "b_h" in r else "-"
        lines.append(f"| {r['budget_gib']} | {r['policy']} | {r['slots']}/{r['experts']} | {r['decode_tok_s']:.1f} | "
                     f"{100 * r['miss_rate']:.1f}% | {r['q_over_m']:.2f} | {bp} | {bh} | {r['bound_tok_s']:.1f} | "
                     f"{r['achieved_over_bound']:.2f} | {r['ttft_s']:.2f} |")
    return "\n".join(lines)
