"""The synchronous engine core.

`step()` is three calls (schedule -> execute -> update) plus output processing: appending sampled
tokens, stop checks, incremental detokenisation. Front ends (LLM, CLI, HTTP server) talk to it in
token ids and native types only.
"""
from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

from tidal.config import EngineConfig, parse_dtype
from tidal.errors import ConfigError, RequestError
from tidal.kvcache.page_pool import KVPool, PageAllocator
from tidal.kvcache.state_pool import StatePool, StateSlotAllocator
from tidal.experts.policy import POLICIES
from tidal.memory.budget import cap_allocator
from tidal.memory.budget import plan as plan_memory
from tidal.runner.loader import build_experts, dense_bytes, load_model
from tidal.runner.model_runner import ModelRunner
from tidal.runner.sampler import make_generator
from tidal.scheduler.scheduler import Scheduler
from tidal.tokenizer.detokenizer import IncrementalDetokenizer
from tidal.tokenizer.stop import StopStringMatcher
from tidal.types import Request, RequestOutput, SamplingParams
from tidal.weights.hf import resolve_model_path

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}: use cpu, cuda or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}: use cpu, cuda or auto")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but torch sees no CUDA GPU "
                          f"(torch {torch.__version__}); use --device cpu or install a CUDA build of torch")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())  # memory APIs need an explicit index
    return dev


class Engine:
    def __init__(self, model: str | Path, *, device: str = "auto", dtype: str | torch.dtype = "auto",
                 max_model_len: Optional[int] = None, max_running: int = 4, page_size: int = 16,
                 kv_cache_tokens: Optional[int] = None, max_batch_tokens: int = 8192,
                 load_format: str = "auto", seed: int = 0, progress: bool = True,
                 gpu_memory: Optional[float] = None, expert_cache_gib: Optional[float] = None,
                 expert_cache_slots: Optional[int] = None, moe_policy: Optional[str] = None,
                 offload_device: Optional[str] = None, adapt: bool = True, cpu_threads: Optional[int] = None,
                 prefix_cache: bool = True):
        dev = resolve_device(device)
        if load_format not in ("auto", "safetensors", "ftw", "gguf", "dummy"):
            raise ConfigError(f"unknown load format {load_format!r}: use auto, safetensors, ftw, gguf or dummy")
        for name, value in (("max_running", max_running), ("page_size", page_size),
                            ("max_batch_tokens", max_batch_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        is_file = load_format in ("dummy", "gguf") or str(model).endswith(".gguf")  # files, not Hub ids
        path = Path(model).expanduser() if is_file else resolve_model_path(model)
        self.loaded = load_model(path, dev, parse_dtype(dtype), load_format, seed, progress)
        cfg = self.loaded.config
        self.model_config = cfg
        self.tokenizer = None
        if self.loaded.model_dir is not None and (self.loaded.model_dir / "tokenizer.json").exists():
            from tidal.tokenizer.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_dir(self.loaded.model_dir, self.loaded.generation_config)
        limit = cfg.max_position_embeddings
        max_model_len = min(max_model_len or min(limit, 8192), limit)
        kv_tokens = kv_cache_tokens or max_model_len * max_running
        kv_tokens = max(kv_tokens, max_model_len)
        num_pages = -(-kv_tokens // page_size)
        self.config = EngineConfig(device=str(dev), dtype=self.loaded.pool.dtype, max_model_len=max_model_len,
                                   max_running=max_running, page_size=page_size, kv_cache_tokens=num_pages * page_size,
                                   max_batch_tokens=max(max_batch_tokens, 1), load_format=load_format, seed=seed)
        kv_dtype = self.loaded.pool.dtype
        kv_bytes = num_pages * page_size * KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        if moe_policy is not None and moe_policy not in POLICIES:
            raise ConfigError(f"unknown --moe-policy {moe_policy!r}: use one of {', '.join(POLICIES)}")
        if offload_device is not None and offload_device not in ("cpu", "cuda"):
            raise ConfigError(f"unknown offload device {offload_device!r}: use cpu or cuda")
        self.memory_plan = plan_memory(cfg, dev, kv_dtype, dense_bytes(self.loaded.model), kv_bytes,
                                       max_batch_tokens, max_running, gpu_memory, expert_cache_gib,
                                       expert_cache_slots)
        cap_allocator(dev, self.memory_plan.budget_bytes)
        self.kv_pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, dev)
        self._kv_bytes, self._offload_device, self._cpu_threads = kv_bytes, offload_device, cpu_threads
        build_experts(self.loaded, dev, self.memory_plan, moe_policy, offload_device, adapt, cpu_threads)
        log.info("memory plan: %s", self.memory_plan.describe())
        self.state_pool = StatePool.for_model(cfg, max_running, dev)  # None unless linear-attention layers
        self.scheduler = Scheduler(PageAllocator(num_pages), page_size, max_running, max_batch_tokens,
                                   prefix_cache=prefix_cache,
                                   state_slots=StateSlotAllocator(max_running) if self.state_pool else None)
        self.runner = ModelRunner(self.loaded.model, self.kv_pool, dev, self.state_pool)
        self.device = dev
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._stops: dict[str, StopStringMatcher] = {}
        self.eos_token_ids = self._eos_ids()

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids)
        eos = self.loaded.generation_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None:
            ids.update(self.tokenizer.eos_token_ids)
        return frozenset(i for i in ids if i is not None)

    def summary(self) -> str:
        """The start-up summary: model, memory plan, bandwidths, q*/m, cache slots."""
        cfg, st = self.model_config, self.loaded.experts.stats()
        lines = [f"model    {cfg.model_type}: {cfg.num_layers} layers, {cfg.num_experts} experts x "
                 f"{len(cfg.moe_layers)} MoE layers, top-{cfg.top_k}; {str(self.config.dtype).removeprefix('torch.')} "
                 f"on {self.device}",
                 f"memory   {self.memory_plan.describe()}",
                 f"context  max {self.config.max_model_len} tokens, {self.config.max_running} concurrent requests, "
                 f"KV cache {self.config.kv_cache_tokens} tokens"]
        if "b_p_gbps" in st:
            lines.append(f"experts  policy {st['policy']}: B_P {st['b_p_gbps']:.1f} GB/s, B_H {st['b_h_gbps']:.1f} GB/s, "
                         f"q*/m {st['b_p_gbps'] / max(st['b_h_gbps'], 1e-9):.2f}, {st['slots']} cache slots")
        else:
            where = "GPU" if self.device.type == "cuda" else "CPU (C++ kernel)" if getattr(
                self.loaded.experts, "cpu_kernel", None) else "CPU (torch)"
            lines.append(f"experts  all resident, computed on the {where}")
        return "\n".join(lines)

    def reconfigure_experts(self, gpu_memory: Optional[float] = None, moe_policy: Optional[str] = None,
                            expert_cache_slots: Optional[int] = None, adapt: bool = True) -> None:
        """Re-plan the GPU budget and rebuild the expert runtime, keeping the host pool, dense weights
        and KV cache (benchmarks sweep budgets and policies without reloading the model)."""
        # Drop every reference to the old runtime (the MoE layers hold one) before freeing its memory.
        self.loaded.model.set_expert_runtime(None)
        self.loaded.experts = None
        import gc
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        cfg = self.model_config
        self.memory_plan = plan_memory(cfg, self.device, self.config.dtype, dense_bytes(self.loaded.model),
                                       self._kv_bytes, self.config.max_batch_tokens, self.config.max_running,
                                       gpu_memory, None, expert_cache_slots)
        cap_allocator(self.device, self.memory_plan.budget_bytes)
        build_experts(self.loaded, self.device, self.memory_plan, moe_policy, self._offload_device, adapt,
                      self._cpu_threads)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        params = params or SamplingParams()
        params.validate()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        if len(prompt_ids) >= self.config.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this engine serves at most "
                               f"{self.config.max_model_len - 1} prompt tokens (--max-model-len)")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise RequestError(f"duplicate request id {rid!r}")
        req = Request(rid, prompt_ids, params, eos_token_ids=self.eos_token_ids,
                      generator=make_generator(params.seed, self.device))
        self._requests[rid] = req
        if self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        self._stops[rid] = StopStringMatcher(params.stop)
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._forget(req)

    def abort_all(self) -> None:
        for rid in list(self._requests):
            self.abort(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        result = self.runner.execute(batch)
        self.scheduler.update(batch)
        outputs = []
        for s in batch.seqs:
            req = s.request
            if req.request_id in result.token_ids and not req.finished:
                outputs.append(self._append(req, result.token_ids[req.request_id],
                                            result.logprobs.get(req.request_id)))
        return outputs

    def _append(self, req: Request, token: int, logprob) -> RequestOutput:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        p = req.params
        reason = None
        if not p.ignore_eos and token in req.eos_token_ids:
            reason, req.stop_reason = "stop", token
        elif token in p.stop_token_ids:
            reason, req.stop_reason = "stop", token
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            reason = "length"
        text = ""
        detok = self._detok.get(req.request_id)
        stops = self._stops[req.request_id]
        if detok is not None:
            # The eos/stop token itself is not part of the text.
            delta = detok.push(token) if reason != "stop" else ""
            if reason is not None:
                delta += detok.flush()
            text, hit = stops.feed(delta)
            if hit:
                reason = "stop"
                req.stop_reason = stops.matched
            elif reason is not None:
                text += stops.flush()
        if reason is not None:
            self.scheduler.finish(req, reason)
        out = RequestOutput(req.request_id, [token], text, req.finished, req.finish_reason,
                            [logprob] if logprob is not None else [], len(req.prompt_ids),
                            req.num_cached_prefix, len(req.output_ids), req.stop_reason)
        if req.finished:
            self._forget(req)
        return out

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self._stops.pop(req.request_id, None)

    # -- convenience -------------------------------------------------------------------------------
    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[tuple[Request, str]]:
        """Run prompts to completion; returns (request, text) in prompt order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs, texts = [], {}
        for ids, p in zip(prompts, plist):
            rid = self.add_request(ids, p)
            reqs.append(self._requests[rid])
            texts[rid] = []
        while self.has_unfinished():
            for out in self.step():
                texts[out.request_id].append(out.new_text)
        return [(r, "".join(texts[r.request_id])) for r in reqs]
