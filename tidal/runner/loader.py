"""Builds a ready model: config -> modules on the device -> weights streamed in -> expert runtime."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from tidal.config import ModelConfig
from tidal.errors import CheckpointError
from tidal.experts.bandwidth import BandwidthModel, load_cached, machine_key, profile, store
from tidal.experts.base import ExpertRuntime
from tidal.experts.host_pool import HostExpertPool
from tidal.experts.resident import ResidentExperts
from tidal.experts.runtime import OffloadExperts
from tidal.memory.budget import MemoryPlan
from tidal.models.registry import model_class
from tidal.weights.hf import iter_tensors, list_tensors, read_json

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: torch.nn.Module
    pool: HostExpertPool
    experts: Optional[ExpertRuntime]
    model_dir: Optional[Path]            # None for dummy weights built from a bare config.json
    generation_config: dict


def resolve_dtype(requested: Optional[torch.dtype], cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if requested is not None:
        return requested
    if device.type == "cpu" and cfg.dtype == torch.float16:
        return torch.float32  # CPU half-precision matmuls are slow and lose range; bf16 stays bf16
    return cfg.dtype


def load_model(model_dir: Path, device: torch.device, dtype: Optional[torch.dtype],
               load_format: str = "auto", seed: int = 0, progress: bool = True) -> LoadedModel:
    """Load a Hugging Face directory, an FTW directory (`tidal convert`), a .gguf file, or (with
    load_format='dummy') a config.json path or directory. 'auto' picks FTW when the directory has an
    ftw.json, GGUF for a .gguf file, else safetensors."""
    if load_format == "auto":
        from tidal.weights.ftw import is_ftw_dir
        load_format = ("gguf" if model_dir.suffix == ".gguf" and not model_dir.is_dir()
                       else "ftw" if is_ftw_dir(model_dir) else "safetensors")
    gguf = None
    if load_format == "gguf":
        from tidal.weights.gguf import GGUFCheckpoint
        gguf = GGUFCheckpoint(model_dir)
        cfg, gen_cfg = gguf.model_config(), dict(gguf.generation_config)
    else:
        if load_format == "dummy":
            config_path = model_dir if model_dir.is_file() else model_dir / "config.json"
        else:
            config_path = model_dir / "config.json"
        cfg = ModelConfig.from_file(config_path)
        gen_cfg = (read_json(config_path.parent / "generation_config.json", required=False) or {})
    dtype = resolve_dtype(dtype, cfg, device)
    model = model_class(cfg.model_type)(cfg, dtype, device)
    pool = HostExpertPool(cfg, dtype, "cpu")
    if load_format == "dummy":
        from tidal.weights.dummy import dummy_tensors
        tensors = dummy_tensors(model, pool, seed)
        total = None
    elif load_format == "safetensors":
        infos = list_tensors(model_dir)
        tensors, total = iter_tensors(infos), len(infos)
    elif load_format == "ftw":
        from tidal.weights.ftw import FtwCheckpoint
        ftw = FtwCheckpoint(model_dir)
        tensors, total = ftw.iter_tensors(pool), ftw.num_tensors
    elif gguf is not None:
        tensors, total = gguf.iter_tensors(dtype), gguf.num_tensors
    else:
        raise CheckpointError(f"unknown load format {load_format!r}: use auto, safetensors, ftw, gguf or dummy")
    bar = tqdm(tensors, total=total, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    try:
        model.load_weights(bar, pool)
    finally:
        if gguf is not None:
            gguf.close()
    if device.type == "cuda":
        pool.pin()  # filled first, pinned after: pinning a growing buffer would double the work
    log.info("loaded %s (%s): %d layers, %d experts x %d MoE layers (%.2f GB of experts), dtype %s on %s",
             cfg.model_type, load_format, cfg.num_layers, cfg.num_experts, len(cfg.moe_layers),
             pool.total_bytes / 1e9, str(dtype).removeprefix("torch."), device)
    model_dir_out = None if load_format == "dummy" else gguf.tokenizer_dir() if gguf is not None else model_dir
    return LoadedModel(cfg, model, pool, None, model_dir_out, gen_cfg)


def dense_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def build_experts(loaded: LoadedModel, device: torch.device, plan: MemoryPlan, policy: Optional[str],
                  offload_device: Optional[str], adapt: bool, cpu_threads: Optional[int]) -> ExpertRuntime:
    """Choose and attach the expert runtime: all-resident when everything fits and no policy was
    asked for, else the offload runtime with an expert cache of plan.expert_slots slots."""
    from tidal.kernels.cpu_experts import CpuExpertKernel, kernel_available

    kernel = CpuExpertKernel(cpu_threads) if kernel_available() else None
    if kernel is None:
        log.warning("the C++ CPU expert kernel is not built; CPU experts run through torch (slower)")
    cache_device = torch.device(offload_device) if offload_device else device
    offload = policy is not None or offload_device is not None or (device.type == "cuda" and not plan.all_resident)
    if not offload:
        runtime: ExpertRuntime = ResidentExperts(loaded.pool, device, kernel)
    else:
        bw = _bandwidth_for(loaded.pool, kernel, cache_device, loaded.config.top_k)
        runtime = OffloadExperts(loaded.pool, max(plan.expert_slots, 0), cache_device, policy or "qstar",
                                 bw, kernel, adapt)
    loaded.experts = runtime
    loaded.model.set_expert_runtime(runtime)
    return runtime


def _bandwidth_for(pool: HostExpertPool, kernel, device: torch.device, top_k: int) -> BandwidthModel:
    """The cached per-machine profile, measured now (a few seconds) when none exists."""
    if device.type != "cuda":
        return BandwidthModel.default()
    threads = kernel.num_threads if kernel is not None else torch.get_num_threads()
    key = machine_key(pool.expert_bytes, pool.dtype, threads)
    cached = load_cached(key)
    if cached is not None:
        log.info("bandwidth profile from cache: B_P %.1f GB/s, B_H %.1f GB/s", cached.b_p / 1e9, cached.b_h / 1e9)
        return cached
    log.warning("no bandwidth profile for this machine yet: measuring (a few seconds; `tidal profile` redoes it)")
    layer = pool.layers[0]
    bw = profile(pool.gate_up[layer], pool.down[layer], kernel, device, top_k, seconds=0.5)
    store(key, bw)
    return bw
