"""`tidal profile`: measure B_P, B_H and both together for a model's expert shape; cache the result."""
from __future__ import annotations

import sys

import torch


def configure(p) -> None:
    p.add_argument("--model", default=None, help="model directory or config.json (default: Qwen3-30B-A3B shape)")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--seconds", type=float, default=1.0, help="measuring time per phase")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from tidal.config import ModelConfig
    from tidal.experts.bandwidth import machine_key, profile, store
    from tidal.kernels.cpu_experts import CpuExpertKernel, kernel_available

    if args.model:
        path = Path(args.model)
        cfg = ModelConfig.from_file(path if path.is_file() else path / "config.json")
        H, I, k, dtype = cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k, cfg.dtype
    else:
        H, I, k, dtype = 2048, 768, 8, torch.bfloat16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    E = 64
    # A bank larger than the last-level cache, so the CPU side really reads DRAM.
    gate_up = torch.randn(E, 2 * I, H).to(dtype)
    down = torch.randn(E, H, I).to(dtype)
    if device.type == "cuda":
        gate_up, down = gate_up.pin_memory(), down.pin_memory()
    kernel = CpuExpertKernel(args.cpu_threads) if kernel_available() else None
    threads = kernel.num_threads if kernel else torch.get_num_threads()
    print(f"profiling expert shape H={H} I={I} {str(dtype).removeprefix('torch.')}, top_k={k}, "
          f"{threads} CPU threads ({kernel.isa if kernel else 'torch'}), device {device}", file=sys.stderr)
    bw = profile(gate_up, down, kernel, device, k, args.seconds,
                 progress=lambda s: print(f"  measuring {s} ...", file=sys.stderr))
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    store(machine_key(expert_bytes, dtype, threads), bw)
    g = 1e9
    print(f"| measurement | GB/s |\n|---|---|\n| copy alone (B_P) | {bw.b_p_alone / g:.1f} |\n"
          f"| CPU kernel alone (B_H, paper) | {bw.b_cpu_alone / g:.1f} |\n"
          f"| copy while CPU runs | {bw.b_p / g:.1f} |\n| CPU while copy runs (B_R) | {bw.b_cpu_concurrent / g:.1f} |\n"
          f"| together | {bw.b_h / g:.1f} |\n\nq*/m = {bw.qstar_fraction:.2f} from the concurrent rates "
          f"(paper's alone-measured ratio B_P/B_H = {bw.b_p_alone / max(bw.b_cpu_alone, 1):.2f})")
    return 0
