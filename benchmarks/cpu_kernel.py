"""Micro-benchmark: Tidal's CPU expert kernel against torch, measured side by side in one run.

    python benchmarks/cpu_kernel.py [--threads N] [--experts 128] [--iters 20]

Shape: Qwen3-30B-A3B experts (H=2048, I=768, bf16), k routed experts per token, at batch 1 (decode)
and a batch of 64 tokens. The bank holds --experts experts (128: 1.2 GB, far bigger than any LLC) and
every call routes to experts not used by the previous calls, so weights come from DRAM as in serving.

Rows per case:
  tidal exact      native kernel, bf16 weights widened to fp32, fp32 activations (the default)
  tidal fast-bf16  native kernel with vdpbf16ps (activations rounded to bf16); AVX-512-BF16 only
  torch bf16       the usual torch MoE loop: F.linear per expert in bf16, index_add_ into out
  torch fp32 ref   tidal.kernels.cpu_experts.torch_reference_experts (weights upcast per call)
Columns: ms per call (median), weight GB/s (bytes of the experts touched / time), speed-up vs torch
bf16. Also printed: Python submit overhead, worker wake-up latency (submit -> first / last worker
running, back to back and after an idle gap), and a DRAM read reference (torch fp32 sum).

AMX is not used: decode at batch 1 is bound by DRAM reads, which the AVX-512 paths already saturate;
AMX tiles would only pay off for prefill-sized token tiles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tidal.kernels import cpu_experts as ce  # noqa: E402
from tidal.kernels.torch_experts import grouped_swiglu  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: physical cores)")
    p.add_argument("--experts", type=int, default=128, help="experts in the bank (default 128)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per cell (default 20)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--ks", default="1,4,8", help="experts per token, comma separated")
    p.add_argument("--batches", default="1,64", help="tokens per call, comma separated")
    p.add_argument("--max-seconds", type=float, default=8.0, help="time cap per cell (slow torch rows)")
    p.add_argument("--no-fp32-ref", action="store_true", help="skip the torch fp32 reference rows")
    return p.parse_args()


def build_bank(E: int, H: int, I: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A few random bases copied into every expert: contents do not change speed, copying is fast.
    g = torch.Generator().manual_seed(0)
    bases_gu = [(torch.randn(2 * I, H, generator=g) * 0.03).to(torch.bfloat16) for _ in range(4)]
    bases_d = [(torch.randn(H, I, generator=g) * 0.03).to(torch.bfloat16) for _ in range(4)]
    gate_up = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
    down = torch.empty(E, H, I, dtype=torch.bfloat16)
    for e in range(E):
        gate_up[e].copy_(bases_gu[e % 4])
        down[e].copy_(bases_d[e % 4])
    return gate_up, down


def make_routes(n_calls: int, T: int, k: int, E: int, seed: int = 0):
    """Per call: (token_idx, expert_ids, weights, experts touched). Batch 1 walks a random expert
    permutation so consecutive calls never reuse experts; larger batches route each token to k
    distinct random experts."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=g)
    routes = []
    for c in range(n_calls):
        if T == 1:
            eid = perm[(torch.arange(k) + c * k) % E]
            tok = torch.zeros(k, dtype=torch.long)
        else:
            eid = torch.rand(T, E, generator=g).topk(k, dim=1).indices.reshape(-1)
            tok = torch.arange(T).repeat_interleave(k)
        w = torch.rand(T * k, generator=g)
        routes.append((tok.to(torch.int32), eid.to(torch.int32), w, int(torch.unique(eid).numel())))
    return routes


def torch_bf16_moe(x, token_idx, expert_ids, weights, gate_up, down, out) -> None:
    """The straightforward torch MoE loop on bf16 weights (what a torch CPU offload would run)."""
    grouped_swiglu(x, token_idx, expert_ids, weights, gate_up, down, out, compute_dtype=torch.bfloat16)


def time_calls(fn, routes, x, gate_up, down, warmup: int, max_seconds: float) -> tuple[float, float]:
    """Median seconds per call and mean experts touched, over the routes after `warmup` calls."""
    out = torch.zeros_like(x)
    times, touched = [], []
    start = time.perf_counter()
    for i, (tok, eid, w, n_exp) in enumerate(routes):
        t0 = time.perf_counter()
        fn(x, tok, eid, w, gate_up, down, out)
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
            touched.append(n_exp)
            if t1 - start > max_seconds and len(times) >= 3:
                break
    return statistics.median(times), statistics.mean(touched)


def wake_latency(kernel: ce.CpuExpertKernel, routes, x, gate_up, down, gap_s: float, n: int = 30):
    """Medians (us) of: submit() call, submit -> first worker, -> last worker, -> phase 1 complete,
    -> job done."""
    out = torch.zeros_like(x)
    rows = []
    for tok, eid, w, _ in routes[:n]:
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        job = kernel.submit(x, tok, eid, w, gate_up, down, out)
        sub = (time.perf_counter() - t0) * 1e6
        job.wait()
        s = kernel.last_job_stats()
        rows.append((sub, s["first_start_us"], s["last_start_us"], s["barrier_us"], s["done_us"]))
    return [statistics.median(col) for col in zip(*rows)]


def dram_read_gbs(threads: int) -> float:
    buf = torch.ones(128 << 20)  # 512 MiB fp32
    buf.sum()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        ts.append(time.perf_counter() - t0)
    return buf.numel() * 4 / min(ts) / 1e9


def main() -> None:
    args = parse_args()
    if not ce.kernel_available():
        sys.exit(f"native kernel unavailable: {ce.unavailable_reason()}")
    threads = args.threads or ce.physical_core_cpus()[1]
    torch.set_num_threads(threads)
    H, I, E = args.hidden, args.intermediate, args.experts
    ks = [int(v) for v in args.ks.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    expert_bytes = 3 * H * I * 2

    exact = ce.CpuExpertKernel(threads, fast_bf16_dot=False)
    fast = ce.CpuExpertKernel(threads, fast_bf16_dot=True)
    gate_up, down = build_bank(E, H, I)
    print(f"CPU expert kernel benchmark: H={H} I={I} bf16, bank {E} experts "
          f"({E * expert_bytes / 1e9:.2f} GB), {threads} threads (pinned {exact.pinned_threads}), "
          f"isa {exact.isa}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"DRAM read reference (torch fp32 sum, {threads} threads): {dram_read_gbs(threads):.1f} GB/s")

    methods = [("tidal exact", exact.run)]
    if fast.fast_bf16_dot:
        methods.append(("tidal fast-bf16", fast.run))
    methods.append(("torch bf16", torch_bf16_moe))
    if not args.no_fp32_ref:
        methods.append(("torch fp32 ref", ce.torch_reference_experts))

    warmup = 2
    header = f"{'k':>2} {'batch':>5} {'experts':>7}  {'method':<16} {'ms/call':>9} {'GB/s':>7} {'vs torch bf16':>13}"
    print()
    print(header)
    print("-" * len(header))
    for T in batches:
        for k in ks:
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(T * 100 + k))
            routes = make_routes(warmup + args.iters, T, k, E, seed=T * 100 + k)
            # correctness spot check of the exact path against the fp32 reference
            tok, eid, w, _ = routes[0]
            o1, o2 = torch.zeros(T, H), torch.zeros(T, H)
            exact.run(x, tok, eid, w, gate_up, down, o1)
            ce.torch_reference_experts(x, tok, eid, w, gate_up, down, o2)
            err = float((o1 - o2).abs().max() / o2.abs().max().clamp_min(1e-30))
            results = {}
            for name, fn in methods:
                results[name] = time_calls(fn, routes, x, gate_up, down, warmup, args.max_seconds)
            base = results["torch bf16"][0]
            for name, _ in methods:
                sec, touched = results[name]
                gbs = touched * expert_bytes / sec / 1e9
                print(f"{k:>2} {T:>5} {touched:>7.1f}  {name:<16} {sec * 1e3:>9.3f} {gbs:>7.1f} {base / sec:>12.2f}x")
            print(f"{'':>17}  (exact vs fp32 reference: max rel err {err:.1e})")

    print()
    k = max(ks)
    routes = make_routes(40, 1, k, E, seed=7)
    x = torch.randn(1, H)
    for gap in (0.0, 0.002):
        sub, first, last, p1, done = wake_latency(exact, routes, x, gate_up, down, gap)
        p1_gbs = k * 2 * H * I * 2 / (p1 * 1e-6) / 1e9
        p2_gbs = k * H * I * 2 / ((done - p1) * 1e-6) / 1e9
        print(f"batch 1 k={k}, {'back to back' if gap == 0 else f'after {gap * 1e3:.0f} ms idle'}: submit() "
              f"{sub:.1f} us; after submit: first worker {first:.1f} us, last worker {last:.1f} us, "
              f"phase 1 done {p1:.0f} us ({p1_gbs:.1f} GB/s), job done {done:.0f} us "
              f"(phase 2 {p2_gbs:.1f} GB/s)")
    # Fixed per-call cost: a job with 8 experts of a tiny intermediate size (I=16), batch 1.
    gu_s = torch.zeros(E, 32, H, dtype=torch.bfloat16)
    d_s = torch.zeros(E, H, 16, dtype=torch.bfloat16)
    tok, eid, w, _ = routes[0]
    out = torch.zeros(1, H)
    n = 500
    t_val = timeit.timeit(lambda: ce._validate(x, tok, eid, w, gu_s, d_s, out), number=n) / n * 1e6
    exact.run(x, tok, eid, w, gu_s, d_s, out)
    t_run = timeit.timeit(lambda: exact.run(x, tok, eid, w, gu_s, d_s, out), number=n) / n * 1e6
    done = statistics.median(exact.run(x, tok, eid, w, gu_s, d_s, out) or exact.last_job_stats()["done_us"]
                             for _ in range(200))
    print(f"fixed cost per call ({k} tiny experts): run() {t_run:.1f} us, of which argument checks {t_val:.1f} us, "
          f"submit -> done inside the pool {done:.1f} us")
    exact.close()
    fast.close()


if __name__ == "__main__":
    main()
