"""The offload runtime: the per-layer decode step over the host pool, expert cache and CPU executor.

For one MoE layer and one forward:
  1. classify the batch's routed experts into hits H (resident in the cache) and misses M;
  2. split M: q fills (copied into cache slots and kept) and m - q CPU-executed (policy.num_fills);
  3. start the CPU branch first (C++ workers, GIL released) on the CPU-executed experts;
  4. GPU branch: copy the fills on a copy stream into their slots, compute H u F from the slots;
  5. wait for the CPU branch and add its partial output.
Expert ids are visited in ascending order on the GPU branch, so when every expert of a layer runs
there the output is bit-identical to the all-resident model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from tidal.experts.bandwidth import BandwidthModel
from tidal.experts.base import ExpertRuntime
from tidal.experts.compute import swiglu_experts
from tidal.experts.gpu_cache import ExpertSlots, LRUResidency
from tidal.experts.host_pool import HostExpertPool
from tidal.experts.policy import POLICIES, num_fills

log = logging.getLogger(__name__)

PREFILL_TOKENS = 32   # forwards with at least this many tokens take the prefill path


@dataclass
class OffloadStats:
    """Cumulative counters; `last_step` holds the same for the most recent forward."""

    hits: int = 0
    misses: int = 0
    fills: int = 0
    cpu_executed: int = 0
    bytes_copied: int = 0
    cpu_seconds: float = 0.0     # wall time of CPU-branch jobs (submit -> done)
    gpu_seconds: float = 0.0     # wall time of the GPU branch as seen by the host (launch -> done)
    layer_calls: int = 0

    def add(self, other: "OffloadStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["hit_rate"] = self.hits / max(1, self.hits + self.misses)
        d["q_over_m"] = self.fills / max(1, self.misses)
        return d


class OffloadExperts(ExpertRuntime):
    def __init__(self, pool: HostExpertPool, num_slots: int, device: torch.device, policy: str = "qstar",
                 bandwidth: Optional[BandwidthModel] = None, cpu_kernel=None, adapt: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"unknown moe policy {policy!r}: use one of {', '.join(POLICIES)}")
        cfg = pool.cfg
        self.pool, self.device, self.policy, self.adapt = pool, torch.device(device), policy, adapt
        if num_slots < cfg.top_k and policy != "static" and policy != "cpu":
            raise ValueError(f"expert cache of {num_slots} slots is smaller than top_k={cfg.top_k}")
        self.slots = ExpertSlots(num_slots, cfg.hidden_size, cfg.moe_intermediate_size, pool.dtype, self.device)
        self.lru = LRUResidency(num_slots)
        self.bandwidth = bandwidth or BandwidthModel.default()
        self.cpu_kernel = cpu_kernel
        self.total = OffloadStats()
        self.step_stats = OffloadStats()
        self.on_gpu = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        if policy == "static":
            self._place_static()

    # -- placement ---------------------------------------------------------------------------------
    def _place_static(self) -> None:
        """llama.cpp's --n-cpu-moe: whole layers resident, the first layers' experts on the CPU."""
        E = self.pool.cfg.num_experts
        layers = list(self.pool.layers)
        resident_layers = layers[len(layers) - min(len(layers), self.lru.num_slots // E):]
        for layer in resident_layers:
            for e in range(E):
                slot, _ = self.lru.admit((layer, e))
                self._copy_in(layer, e, slot, stream=None)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def _copy_in(self, layer: int, expert: int, slot: int, stream) -> None:
        src_gu, src_d = self.pool.gate_up[layer][expert], self.pool.down[layer][expert]
        if stream is None:
            self.slots.gate_up[slot].copy_(src_gu, non_blocking=self.on_gpu)
            self.slots.down[slot].copy_(src_d, non_blocking=self.on_gpu)
        else:
            with torch.cuda.stream(stream):
                self.slots.gate_up[slot].copy_(src_gu, non_blocking=True)
                self.slots.down[slot].copy_(src_d, non_blocking=True)

    def resident_keys(self) -> list[tuple[int, int]]:
        return list(self.lru.keys())

    # -- the per-layer step ------------------------------------------------------------------------
    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        st = OffloadStats(layer_calls=1)
        ids_host = ids.to("cpu")                                         # [T, K]; the one sync per layer
        experts, counts = torch.unique(ids_host, return_counts=True)
        used = experts.tolist()
        tokens_per = dict(zip(used, counts.tolist()))
        hits, misses = [], []
        for e in used:
            (hits if (layer, e) in self.lru else misses).append(e)
        st.hits, st.misses = len(hits), len(misses)
        slot_of: dict[int, int] = {}
        self.lru.protected = {(layer, e) for e in hits}
        for e in hits:
            slot_of[e] = self.lru.touch((layer, e))

        if hidden.shape[0] >= PREFILL_TOKENS and self.policy != "static":
            # A prefill chunk reuses each expert for many tokens: the CPU would be compute-bound, so
            # every policy fills (for `cpu` this is KTransformers' prefill-updated placement).
            q = len(misses)
        else:
            q = num_fills(self.policy, len(misses), self.bandwidth.b_p, self.bandwidth.b_h)
        # A fill may not evict an expert this step uses: the rest of the misses run on the CPU.
        q = min(q, self.lru.num_slots - len(hits))
        # Fill the misses with the most tokens first: they move the most work onto the GPU.
        ranked = sorted(misses, key=lambda e: -tokens_per[e])
        fills, cpu_experts = ranked[:q], ranked[q:]
        st.fills, st.cpu_executed = len(fills), len(cpu_experts)

        # 1. CPU branch first, so it overlaps everything below.
        job, cpu_out, t_cpu = None, None, time.perf_counter()
        if cpu_experts:
            job, cpu_out = self._start_cpu(layer, hidden, ids_host, weights, set(cpu_experts))

        # 2. Fills: admit (LRU victim logic) and copy on the copy stream.
        t_gpu = time.perf_counter()
        timed = self.adapt and self.on_gpu and bool(fills)
        if timed:
            copy_start, copy_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            copy_start.record(self.copy_stream)
        for e in fills:
            slot, _ = self.lru.admit((layer, e))
            self.lru.protected.add((layer, e))
            slot_of[e] = slot
            self._copy_in(layer, e, slot, self.copy_stream)
        st.bytes_copied = len(fills) * self.pool.expert_bytes
        if timed:
            copy_end.record(self.copy_stream)
        copy_seconds = time.perf_counter() - t_gpu  # on the CPU cache device copies are synchronous
        if self.copy_stream is not None and fills:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

        # 3. GPU branch over hits and fills.
        out = swiglu_experts(hidden, ids, weights, self.slots.gate_up, self.slots.down, slot_of=slot_of)
        if self.on_gpu and self.adapt:
            torch.cuda.current_stream(self.device).synchronize()
        st.gpu_seconds = time.perf_counter() - t_gpu

        # 4. Merge.
        if job is not None:
            job.wait()
            st.cpu_seconds = self._job_seconds(time.perf_counter() - t_cpu)
            out += cpu_out.to(out.device, out.dtype, non_blocking=True)
        self.lru.protected = set()
        if self.adapt and self.policy == "qstar":
            if timed:
                copy_seconds = copy_start.elapsed_time(copy_end) / 1e3
            # Branch rates from the branches' own clocks (copy stream events, the kernel's job
            # timer), not from wall time that includes waiting for the other branch.
            self.bandwidth.observe(st.bytes_copied, copy_seconds if fills else 0.0,
                                   len(cpu_experts) * self.pool.expert_bytes, st.cpu_seconds)
        self.total.add(st)
        self.step_stats.add(st)
        return out

    def _job_seconds(self, wall: float) -> float:
        """The CPU job's own duration (submit -> done) when the kernel reports it, else wall time."""
        if self.cpu_kernel is not None and hasattr(self.cpu_kernel, "last_job_stats"):
            return self.cpu_kernel.last_job_stats()["done_us"] / 1e6
        return wall

    def _start_cpu(self, layer: int, hidden: torch.Tensor, ids_host: torch.Tensor, weights: torch.Tensor,
                   cpu_set: set[int]):
        """Submit the CPU-executed experts' (token, expert, weight) pairs to the C++ workers."""
        T, K = ids_host.shape
        mask = torch.zeros_like(ids_host, dtype=torch.bool)
        for e in cpu_set:
            mask |= ids_host == e
        tok_idx = torch.arange(T).unsqueeze(1).expand(T, K)[mask].to(torch.int32)
        exp_idx = ids_host[mask].to(torch.int32)
        w = weights.to("cpu", torch.float32)[mask].contiguous()
        x = hidden.to("cpu", torch.float32).contiguous()                      # [T, H]
        out = torch.zeros(T, hidden.shape[1], dtype=torch.float32)
        args = (x, tok_idx, exp_idx, w, self.pool.gate_up[layer], self.pool.down[layer], out)
        if self.cpu_kernel is not None:
            return self.cpu_kernel.submit(*args), out
        from tidal.kernels.cpu_experts import torch_reference_experts
        torch_reference_experts(*args)
        return _DoneJob(), out

    # -- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        d = self.total.as_dict()
        d.update(policy=self.policy, slots=self.lru.num_slots, resident=len(self.lru),
                 b_p_gbps=self.bandwidth.b_p / 1e9, b_h_gbps=self.bandwidth.b_h / 1e9)
        return d

    def take_step_stats(self) -> OffloadStats:
        s, self.step_stats = self.step_stats, OffloadStats()
        return s


class _DoneJob:
    def wait(self) -> None:
        pass
