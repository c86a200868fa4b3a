"""B_P and B_H: measured on this machine, cached per machine, and tracked online while serving.

Terms (DESIGN.md): B_P is the host->GPU copy rate of expert-sized chunks from the pinned host pool;
B_H is the host's expert bandwidth. Both branches read the same DRAM, so the split uses rates
measured *concurrently*: b_p = copy rate while the CPU kernel runs, b_h = b_p + CPU-kernel rate
while copies run. Then q*/m = b_p / b_h balances the two branch times exactly
(q/b_p = (m-q)/(b_h-b_p)). The paper's alone-measured ratio is reported beside it.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

EMA = 0.05   # weight of one observation in the online estimate


@dataclass
class BandwidthModel:
    b_p: float                    # bytes/s, copy rate (concurrent with the CPU branch)
    b_h: float                    # bytes/s, copy + CPU rates together
    b_p_alone: float = 0.0
    b_cpu_alone: float = 0.0
    b_cpu_concurrent: float = 0.0
    source: str = "default"

    @classmethod
    def default(cls) -> "BandwidthModel":
        """A placeholder used only until a profile exists (PCIe 4 x16 copy, dual-channel DDR5)."""
        return cls(b_p=25e9, b_h=25e9 + 40e9, source="default")

    @property
    def qstar_fraction(self) -> float:
        return self.b_p / self.b_h if self.b_h > 0 else 1.0

    def observe(self, copied: int, copy_seconds: float, cpu_bytes: int, cpu_seconds: float) -> None:
        """Fold one layer step's realised branch rates into the estimate (moving average), so the
        split follows contention from other programs."""
        b_cpu = self.b_h - self.b_p
        if copied > 0 and copy_seconds > 0:
            self.b_p += EMA * (copied / copy_seconds - self.b_p)
        if cpu_bytes > 0 and cpu_seconds > 0:
            b_cpu += EMA * (cpu_bytes / cpu_seconds - b_cpu)
        self.b_h = self.b_p + max(b_cpu, 0.0)


def machine_key(expert_bytes: int, dtype: torch.dtype, threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "nogpu"
    return f"{cpu}|{gpu}|threads={threads}|expert={expert_bytes}|{str(dtype).removeprefix('torch.')}"


def cache_path() -> Path:
    return Path(os.environ.get("TIDAL_CACHE", Path.home() / ".cache" / "tidal")) / "bandwidth.json"


def load_cached(key: str) -> Optional[BandwidthModel]:
    try:
        entry = json.loads(cache_path().read_text()).get(key)
    except (OSError, json.JSONDecodeError):
        return None
    return BandwidthModel(**entry) if entry else None


def store(key: str, model: BandwidthModel) -> None:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        data = {}
    data[key] = asdict(model)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def profile(gate_up: torch.Tensor, down: torch.Tensor, kernel, device: torch.device, top_k: int = 8,
            seconds: float = 1.0, progress=None) -> BandwidthModel:
    """Measure copy, CPU and concurrent rates on one layer's banks (gate_up [E,2I,H], down [E,H,I]).

    Copies go to expert slots on `device` through the engine's own copy path; the CPU side runs
    the engine's own kernel at batch 1 over `top_k` experts, as in decode.
    """
    E = gate_up.shape[0]
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    H = gate_up.shape[2]
    gen = torch.Generator().manual_seed(0)

    def cpu_once() -> int:
        ids = torch.randperm(E, generator=gen)[:top_k].to(torch.int32)
        x = torch.randn(1, H)
        out = torch.zeros(1, H)
        args = (x, torch.zeros(top_k, dtype=torch.int32), ids, torch.full((top_k,), 1.0 / top_k),
                gate_up, down, out)
        if kernel is not None:
            kernel.run(*args)
        else:
            from tidal.kernels.cpu_experts import torch_reference_experts
            torch_reference_experts(*args)
        return top_k * expert_bytes

    n_slots = min(E, 16)
    slot_gu = torch.empty((n_slots,) + tuple(gate_up.shape[1:]), dtype=gate_up.dtype, device=device)
    slot_d = torch.empty((n_slots,) + tuple(down.shape[1:]), dtype=down.dtype, device=device)
    on_gpu = device.type == "cuda"
    stream = torch.cuda.Stream(device) if on_gpu else None

    def copy_for(duration: float, stop: Optional[threading.Event] = None) -> float:
        """Copy experts round-robin for `duration` s (or until `stop`); returns bytes/s."""
        moved, i, t0 = 0, 0, time.perf_counter()
        while True:
            e = int(torch.randint(E, (1,), generator=gen))
            if on_gpu:
                with torch.cuda.stream(stream):
                    slot_gu[i % n_slots].copy_(gate_up[e], non_blocking=True)
                    slot_d[i % n_slots].copy_(down[e], non_blocking=True)
                if i % 8 == 7:
                    stream.synchronize()
            else:
                slot_gu[i % n_slots].copy_(gate_up[e])
                slot_d[i % n_slots].copy_(down[e])
            moved += expert_bytes
            i += 1
            elapsed = time.perf_counter() - t0
            if (stop is not None and stop.is_set()) or (stop is None and elapsed >= duration):
                break
        if on_gpu:
            stream.synchronize()
        return moved / (time.perf_counter() - t0)

    def cpu_for(duration: float) -> float:
        moved, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration:
            moved += cpu_once()
        return moved / (time.perf_counter() - t0)

    cpu_once()
    copy_for(0.1)  # warm up both paths
    steps = ["copy alone", "cpu alone", "both at once"]
    if progress:
        progress(steps[0])
    b_p_alone = copy_for(seconds)
    if progress:
        progress(steps[1])
    b_cpu_alone = cpu_for(seconds)
    if progress:
        progress(steps[2])
    # Concurrent: copies in a thread (they release the GIL in the CUDA calls), the kernel here.
    stop, result = threading.Event(), {}
    th = threading.Thread(target=lambda: result.setdefault("p", copy_for(0, stop)))
    th.start()
    b_cpu_conc = cpu_for(seconds)
    stop.set()
    th.join()
    b_p_conc = result["p"]
    return BandwidthModel(b_p=b_p_conc, b_h=b_p_conc + b_cpu_conc, b_p_alone=b_p_alone,
                          b_cpu_alone=b_cpu_alone, b_cpu_concurrent=b_cpu_conc, source="measured")
