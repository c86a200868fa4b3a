"""`tidal doctor`: what this machine is, what it measures, and what a given model will do on it.

The prediction uses DESIGN.md's performance model with this machine's measured bandwidths and a miss
rate of (1 - cache fraction), which is what a global LRU gets under uniform routing (trained models
route with locality, so real miss rates are lower).
"""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

GIB = 1 << 30


def configure(p) -> None:
    p.add_argument("--model", default=None, help="model directory or config.json to plan for")
    p.add_argument("--gpu-memory", type=float, default=None, help="plan for this GPU budget (GiB)")
    p.add_argument("--reprofile", action="store_true", help="measure bandwidths even if a profile is cached")
    p.add_argument("--seconds", type=float, default=0.5, help="measuring time per profile phase")
    p.set_defaults(func=run)


# -- machine facts -------------------------------------------------------------------------------------
def cpu_facts() -> dict:
    info = {"model": "unknown", "flags": set()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        info["model"] = m.group(1).strip() if m else info["model"]
        f = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        info["flags"] = set(f.group(1).split()) if f else set()
    except OSError:
        pass
    from tidal.kernels.cpu_experts import detected_isa, physical_core_cpus

    cpus, _ = physical_core_cpus()
    flags = info["flags"]
    isa = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX-512-BF16", "avx512_bf16"),
                                   ("AMX-BF16", "amx_bf16")) if flag in flags]
    return {"model": info["model"], "logical": os.cpu_count(), "physical": len(cpus), "isa": isa,
            "kernel_path": detected_isa()}


def ram_facts() -> dict:
    mem = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            mem[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {"total": mem.get("MemTotal", 0), "available": mem.get("MemAvailable", 0),
            "memlock": None if soft == resource.RLIM_INFINITY else soft}


def gpu_facts() -> Optional[dict]:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    facts = {"name": props.name, "total": total, "free": free, "used_by_others": total - free,
             "capability": f"{props.major}.{props.minor}", "pcie": None}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current,"
                              "pcie.link.gen.max,pcie.link.width.max", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        if out:
            gen, width, gen_max, width_max = [x.strip() for x in out[0].split(",")]
            facts["pcie"] = f"gen {gen} x{width} (max gen {gen_max} x{width_max})"
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    return facts


# -- prediction ------------------------------------------------------------------------------------------
def predict(cfg, bw, plan, dense_bytes: int, hbm: float) -> dict:
    """Decode tok/s at batch 1 from the performance model (DESIGN.md), uniform-routing miss rate."""
    S = 3 * cfg.hidden_size * cfg.moe_intermediate_size * torch.tensor([], dtype=cfg.dtype).element_size()
    x = len(cfg.moe_layers) * cfg.top_k * S
    embed = cfg.vocab_size * cfg.hidden_size * torch.tensor([], dtype=cfg.dtype).element_size()
    active_dense = max(dense_bytes - embed, 0)   # the embedding is a row lookup, not a full read
    if plan is None:   # CPU only: every expert byte and the dense weights come through the CPU
        t = (x + active_dense) / max(bw.b_cpu_alone, 1.0)
        return {"miss_rate": 1.0, "tok_s": 1 / t}
    cache_fraction = min(1.0, plan.expert_slots / plan.total_experts)
    r = 1.0 - cache_fraction
    b_r = bw.b_cpu_concurrent or max(bw.b_h - bw.b_p, 0.0)
    miss_t = r * x / (bw.b_p + b_r) if r > 0 else 0.0
    gpu_t = (active_dense + (1 - r) * x) / hbm
    return {"miss_rate": r, "tok_s": 1 / max(miss_t, gpu_t), "miss_s": miss_t, "gpu_s": gpu_t}


def run(args) -> int:
    from tidal.config import ModelConfig
    from tidal.experts.bandwidth import load_cached, machine_key, profile, store
    from tidal.kernels.cpu_experts import CpuExpertKernel, kernel_available
    from tidal.memory.budget import plan as plan_memory

    say = print
    cpu, ram, gpu = cpu_facts(), ram_facts(), gpu_facts()
    say("## Machine")
    say(f"CPU      {cpu['model']}: {cpu['physical']} physical cores ({cpu['logical']} logical); "
        f"ISA {', '.join(cpu['isa']) or 'baseline x86-64'}; Tidal's kernel path: {cpu['kernel_path']}")
    memlock = "unlimited" if ram["memlock"] is None else f"{ram['memlock'] / GIB:.2f} GiB"
    say(f"RAM      {ram['total'] / GIB:.1f} GiB total, {ram['available'] / GIB:.1f} GiB available; "
        f"pinned-memory limit (ulimit -l): {memlock}")
    if gpu:
        say(f"GPU      {gpu['name']} (compute {gpu['capability']}), {gpu['total'] / GIB:.1f} GiB VRAM, "
            f"{gpu['free'] / GIB:.1f} GiB free, {gpu['used_by_others'] / GIB:.1f} GiB used by others; "
            f"PCIe {gpu['pcie'] or 'unknown'}")
    else:
        say("GPU      none visible to torch: Tidal runs every expert on the CPU")

    cfg = None
    if args.model:
        path = Path(args.model)
        cfg = ModelConfig.from_file(path if path.is_file() else path / "config.json")
    H, I, k = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k) if cfg else (2048, 768, 8)
    dtype = cfg.dtype if cfg else torch.bfloat16
    kernel = CpuExpertKernel() if kernel_available() else None
    threads = kernel.num_threads if kernel else torch.get_num_threads()
    expert_bytes = 3 * H * I * torch.tensor([], dtype=dtype).element_size()
    key = machine_key(expert_bytes, dtype, threads)
    bw = None if args.reprofile else load_cached(key)
    say("\n## Bandwidth" + (" (cached profile)" if bw else " (measuring)"))
    if bw is None:
        E = 64
        gate_up, down = torch.randn(E, 2 * I, H).to(dtype), torch.randn(E, H, I).to(dtype)
        device = torch.device("cuda" if gpu else "cpu")
        if gpu:
            gate_up, down = gate_up.pin_memory(), down.pin_memory()
        bw = profile(gate_up, down, kernel, device, k, args.seconds,
                     progress=lambda s: print(f"  measuring {s} ...", file=sys.stderr))
        store(key, bw)
    if gpu:
        say(f"B_P {bw.b_p_alone / 1e9:.1f} GB/s alone, {bw.b_p / 1e9:.1f} while the CPU runs; CPU experts "
            f"{bw.b_cpu_alone / 1e9:.1f} GB/s alone, {bw.b_cpu_concurrent / 1e9:.1f} while copies run; "
            f"q*/m = {bw.qstar_fraction:.2f}")
    else:
        say(f"CPU expert kernel: {bw.b_cpu_alone / 1e9:.1f} GB/s ({threads} workers)")
    if cfg is None:
        say("\n(pass --model DIR or a config.json for a memory plan and a speed prediction)")
        return 0

    say(f"\n## {cfg.model_type}: {len(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts, top-{cfg.top_k}")
    from tidal.models.registry import model_class

    with torch.device("meta"):
        meta = model_class(cfg.model_type)(cfg, cfg.dtype, "meta")
    dense = sum(p.numel() * p.element_size() for p in meta.parameters())
    experts = expert_bytes * cfg.num_experts * len(cfg.moe_layers)
    fits_host = experts + (0 if gpu else dense) < ram["available"]
    say(f"weights: experts {experts / GIB:.1f} GiB (host RAM), dense {dense / GIB:.2f} GiB "
        f"({'GPU' if gpu else 'host'}); host RAM {'is enough' if fits_host else 'is NOT enough'} "
        f"({ram['available'] / GIB:.1f} GiB available)")
    plan = None
    if gpu:
        budget = args.gpu_memory or 0.9 * gpu["free"] / GIB
        kv = 4 * 4096 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()
        device = torch.device("cuda", torch.cuda.current_device())
        try:
            plan = plan_memory(cfg, device, dtype, dense, kv, 8192, 4, budget)
        except Exception as e:  # the budget is too small: say so and stop
            say(f"does not fit: {e}")
            return 1
        say(f"suggested: --gpu-memory {budget:.0f}  -> {plan.describe()}")
        if plan.all_resident:
            say("every expert fits on the GPU: Tidal runs all-resident (no offload)")
    hbm = 4.8e12 if gpu and "H200" in gpu["name"] else 1.0e12
    pred = predict(cfg, bw, plan, dense, hbm)
    say(f"predicted decode (batch 1, uniform routing, miss rate {100 * pred['miss_rate']:.0f}%): "
        f"{pred['tok_s']:.1f} tok/s; trained models' routing locality lowers the miss rate")
    return 0
