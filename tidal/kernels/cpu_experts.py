"""CPU expert executor: the native kernel (csrc/, loaded with ctypes) and a torch fallback.

Computes routed SwiGLU experts exactly as Hugging Face ``Qwen3MoeExperts`` does, for a list of
(token, expert, routing weight) pairs against one layer's host-pool banks::

    gate_up = gate_up_bank[e] @ x[t]            # [2I]: rows 0..I-1 gate, I..2I-1 up
    h       = silu(gate_up[:I]) * gate_up[I:]   # [I]
    out[t] += w * (down_bank[e] @ h)            # [H]

in fp32 (weights bf16 / fp16 / fp32 are widened exactly; accumulation is fp32).

Rules of the native kernel (``CpuExpertKernel``):
- ``submit`` returns at once; the work runs on a persistent pool of pinned worker threads while the
  caller drives the GPU. ``CpuExpertJob.wait`` blocks without the GIL (ctypes drops it).
- One job at a time per kernel: a second ``submit`` first waits for the previous job.
- The job keeps references to its tensors until it is waited on (or seen done); nobody may write
  ``out`` or the inputs meanwhile.
- Results do not depend on the thread count (each output element is summed in a fixed order).
- The default bf16 path is exact in the activations (fp32); ``fast_bf16_dot=True`` rounds the
  activations to bf16 to use AVX-512-BF16 ``vdpbf16ps`` (results then differ by ~1e-3 relative).

Environment (read when a kernel is created): ``TIDAL_CPU_ISA`` caps the instruction set
(generic|avx2|avx512|avx512_bf16), ``TIDAL_CPU_FAST_BF16=1`` makes ``fast_bf16_dot`` default to on,
``TIDAL_CPU_SPIN_US`` sets how long idle workers spin before sleeping, ``TIDAL_CPU_PREFETCH=0`` turns
off software prefetch (tuning).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.machinery
import os
import threading
import weakref
from pathlib import Path

import torch

from tidal.kernels.torch_experts import grouped_swiglu

__all__ = [
    "CpuExpertJob",
    "CpuExpertKernel",
    "detected_isa",
    "kernel_available",
    "physical_core_cpus",
    "supported_isas",
    "torch_reference_experts",
    "unavailable_reason",
]

ISA_NAMES = ("generic", "avx2", "avx512", "avx512_bf16")  # index = TIDAL_ISA_* level in csrc
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ABI_VERSION = 1
_DEFAULT_SPIN_US = 200  # decode submits of consecutive layers come back within about this
_FLAG_NO_PREFETCH = 1

# Error codes of csrc/cpu_experts.h.
_E_INVAL, _E_TOKEN, _E_EXPERT, _E_ISA, _E_NOMEM, _E_THREAD, _E_CLOSED = -1, -2, -3, -4, -5, -6, -7

_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lib_tried = False
_lib_lock = threading.Lock()

_c_int64_p = ctypes.POINTER(ctypes.c_int64)


def _library_path() -> Path | None:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_cpu_experts{suffix}"
        if path.is_file():
            return path
    return None


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_i64, c_u64, c_vp = ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    sigs = {
        "tidal_cpu_abi_version": ([], c_int),
        "tidal_cpu_detect_isa": ([], c_int),
        "tidal_cpu_create": (
            [c_int, ctypes.POINTER(c_int), c_int, c_int, c_int, c_int, c_int, ctypes.POINTER(c_vp)],
            c_int,
        ),
        "tidal_cpu_destroy": ([c_vp], None),
        "tidal_cpu_num_threads": ([c_vp], c_int),
        "tidal_cpu_isa": ([c_vp], c_int),
        "tidal_cpu_fast_bf16": ([c_vp], c_int),
        "tidal_cpu_pinned_count": ([c_vp], c_int),
        "tidal_cpu_submit": (
            [c_vp, c_vp, c_i64, c_i64, c_i64, c_i64, c_vp, c_vp, c_vp, c_i64, c_vp, c_vp, c_int, c_vp,
             ctypes.POINTER(c_u64), _c_int64_p],
            c_int,
        ),
        "tidal_cpu_wait": ([c_vp, c_u64], c_int),
        "tidal_cpu_done": ([c_vp, c_u64], c_int),
        "tidal_cpu_last_job_stats": ([c_vp, _c_int64_p], c_int),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def _load() -> ctypes.CDLL | None:
    global _lib, _lib_error, _lib_tried
    if _lib_tried:
        return _lib
    with _lib_lock:
        if _lib_tried:
            return _lib
        path = _library_path()
        if path is None:
            _lib_error = (
                "native library tidal/kernels/_cpu_experts*.so is not built (reinstall Tidal with a "
                "C++17 compiler: pip install -e .)"
            )
        else:
            try:
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                version = lib.tidal_cpu_abi_version()
                if version != _ABI_VERSION:
                    _lib_error = f"{path.name} has ABI {version}, expected {_ABI_VERSION}: rebuild it"
                else:
                    _lib = lib
            except (OSError, AttributeError) as exc:
                _lib_error = f"cannot load {path}: {exc}"
        _lib_tried = True
    return _lib


def kernel_available() -> bool:
    """True if the native CPU expert kernel is built and loadable here."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``kernel_available()`` is False (None when it is available)."""
    _load()
    return _lib_error


def _env_isa_cap() -> str | None:
    value = os.environ.get("TIDAL_CPU_ISA", "").strip().lower()
    return value or None


def detected_isa() -> str:
    """Instruction set the kernel will use by default: "avx512_bf16", "avx512", "avx2" or "generic"
    (the CPU's best, capped by TIDAL_CPU_ISA); "none" when the native kernel is unavailable."""
    lib = _load()
    if lib is None:
        return "none"
    best = lib.tidal_cpu_detect_isa()
    cap = _env_isa_cap()
    if cap in ISA_NAMES:
        best = min(best, ISA_NAMES.index(cap))
    return ISA_NAMES[best]


def supported_isas() -> list[str]:
    """Every instruction-set level this CPU can run the kernel with (the ``isa`` argument), lowest
    first; empty when the native kernel is unavailable. Ignores TIDAL_CPU_ISA."""
    lib = _load()
    return [] if lib is None else list(ISA_NAMES[: lib.tidal_cpu_detect_isa() + 1])


def _core_key(cpu: int) -> str | None:
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            with open(base + name) as f:
                return f.read().strip()
        except OSError:
            continue
    return None


def physical_core_cpus() -> tuple[list[int], int]:
    """(cpus, n_cores): the CPUs this process may run on, ordered with one CPU per physical core first
    (SMT siblings deduplicated via /sys topology when readable), then the remaining siblings; n_cores
    is the number of physical cores among them."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
        return list(range(n)), n
    firsts: list[int] = []
    siblings: list[int] = []
    seen: set[str] = set()
    for cpu in allowed:
        key = _core_key(cpu)
        if key is not None and key in seen:
            siblings.append(cpu)
            continue
        if key is not None:
            seen.add(key)
        firsts.append(cpu)
    return firsts + siblings, len(firsts)


# ---------------------------------------------------------------------------------------------
# Argument validation (shared by the native kernel and the torch fallback)


def _check(name: str, t, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: expected dtype {want}, got {str(t.dtype).removeprefix('torch.')}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def _validate(x, token_idx, expert_ids, weights, gate_up, down, out) -> tuple[int, int, int, int, int]:
    """Checks everything but index ranges; returns (T, H, I, E, N)."""
    _check("x", x, 2, (torch.float32,))
    _check("token_idx", token_idx, 1, (torch.int32,))
    _check("expert_ids", expert_ids, 1, (torch.int32,))
    _check("weights", weights, 1, (torch.float32,))
    _check("gate_up", gate_up, 3, tuple(_DTYPE_CODES))
    _check("down", down, 3, (gate_up.dtype,))
    _check("out", out, 2, (torch.float32,))
    T, H = x.shape
    N = token_idx.shape[0]
    if expert_ids.shape[0] != N:
        raise ValueError(f"expert_ids: length {expert_ids.shape[0]} != token_idx length {N}")
    if weights.shape[0] != N:
        raise ValueError(f"weights: length {weights.shape[0]} != token_idx length {N}")
    E, two_i, h_gu = gate_up.shape
    if h_gu != H:
        raise ValueError(f"gate_up: shape {tuple(gate_up.shape)} does not match hidden size {H} of x")
    if two_i % 2:
        raise ValueError(f"gate_up: dimension 1 must be 2*intermediate (even), got {two_i}")
    I = two_i // 2
    if tuple(down.shape) != (E, H, I):
        raise ValueError(f"down: expected shape {(E, H, I)} to match gate_up, got {tuple(down.shape)}")
    if tuple(out.shape) != (T, H):
        raise ValueError(f"out: expected shape {(T, H)} to match x, got {tuple(out.shape)}")
    if out.numel():
        out_storage = out.untyped_storage().data_ptr()
        for name, t in (("x", x), ("weights", weights)):
            if t.numel() and t.untyped_storage().data_ptr() == out_storage:
                raise ValueError(f"out: must not share memory with {name}")
    return T, H, I, E, N


def _check_range(name: str, t: torch.Tensor, bound: int) -> None:
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= bound:
        bad = int(((t < 0) | (t >= bound)).nonzero()[0, 0])
        raise ValueError(f"{name}[{bad}] = {int(t[bad])} is out of range [0, {bound})")


def torch_reference_experts(x, token_idx, expert_ids, weights, gate_up, down, out) -> None:
    """Torch version of the kernel (same arguments and semantics): out[t] += w * expert_e(x[t]),
    weights upcast to fp32 per expert. The fallback when ``kernel_available()`` is False."""
    T, H, I, E, N = _validate(x, token_idx, expert_ids, weights, gate_up, down, out)
    if N == 0:
        return
    _check_range("token_idx", token_idx, T)
    _check_range("expert_ids", expert_ids, E)
    grouped_swiglu(x, token_idx, expert_ids, weights, gate_up, down, out, compute_dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Native kernel

_live_kernels: "weakref.WeakSet[CpuExpertKernel]" = weakref.WeakSet()
# Bumped in a forked child, whose copies of the kernels have no worker threads (cheaper than calling
# os.getpid() on every submit, which is a real syscall in sandboxes).
_fork_epoch = 0


def _after_fork_in_child() -> None:
    global _fork_epoch
    _fork_epoch += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_all() -> None:
    for kernel in list(_live_kernels):
        try:
            kernel.close()
        except Exception:
            pass


class CpuExpertJob:
    """A submitted job. ``wait()`` blocks without the GIL; ``done()`` polls. Both are idempotent."""

    __slots__ = ("_kernel", "_id", "_refs", "_done")

    def __init__(self, kernel: "CpuExpertKernel | None", job_id: int, refs: tuple | None):
        self._kernel = kernel
        self._id = job_id
        self._refs = refs  # keeps the tensors alive while workers read/write them
        self._done = kernel is None

    def wait(self) -> None:
        kernel = self._kernel  # read once: another thread may finish this job concurrently
        if self._done or kernel is None:
            return
        kernel._lib.tidal_cpu_wait(kernel._handle, self._id)
        self._finish()

    def done(self) -> bool:
        kernel = self._kernel
        if self._done or kernel is None:
            return True
        if kernel._lib.tidal_cpu_done(kernel._handle, self._id):
            self._finish()
            return True
        return False

    def _finish(self) -> None:
        self._done = True
        self._refs = None
        self._kernel = None


class CpuExpertKernel:
    """A persistent pool of worker threads running expert jobs (see the module docstring)."""

    def __init__(
        self,
        num_threads: int | None = None,
        pin_threads: bool = True,
        *,
        fast_bf16_dot: bool | None = None,
        isa: str | None = None,
        spin_us: int | None = None,
    ):
        """num_threads: workers (None: the physical cores this process may use). pin_threads: pin
        worker i to one physical core each (silently unpinned where not permitted). fast_bf16_dot:
        use vdpbf16ps for bf16 weights where the CPU has AVX-512-BF16 (None: TIDAL_CPU_FAST_BF16).
        isa: cap the instruction set ("generic", "avx2", "avx512", "avx512_bf16"; None:
        TIDAL_CPU_ISA or the best available). spin_us: idle spin before sleeping (None:
        TIDAL_CPU_SPIN_US or 200)."""
        self._handle = None
        lib = _load()
        if lib is None:
            raise RuntimeError(f"CPU expert kernel unavailable: {_lib_error}")
        self._lib = lib
        cpus, n_cores = physical_core_cpus()
        if num_threads is None:
            num_threads = n_cores
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ValueError(f"num_threads: expected a positive int, got {num_threads!r}")
        if fast_bf16_dot is None:
            fast_bf16_dot = os.environ.get("TIDAL_CPU_FAST_BF16", "0").strip().lower() in ("1", "true", "yes")
        best = lib.tidal_cpu_detect_isa()
        if isa is None:
            level = best
            cap = _env_isa_cap()
            if cap is not None:  # an environment cap never asks for more than the CPU has
                if cap not in ISA_NAMES:
                    raise ValueError(f"TIDAL_CPU_ISA (isa): expected one of {', '.join(ISA_NAMES)}, got {cap!r}")
                level = min(best, ISA_NAMES.index(cap))
        else:
            if isa not in ISA_NAMES:
                raise ValueError(f"isa: expected one of {', '.join(ISA_NAMES)}, got {isa!r}")
            level = ISA_NAMES.index(isa)
            if level > best:
                raise ValueError(f"isa: {isa} is not supported by this CPU (best: {ISA_NAMES[best]})")
        if spin_us is None:
            spin_us = int(os.environ.get("TIDAL_CPU_SPIN_US", _DEFAULT_SPIN_US))
        flags = 0 if os.environ.get("TIDAL_CPU_PREFETCH", "1").strip() not in ("0", "false") else _FLAG_NO_PREFETCH
        pin = cpus if pin_threads else []
        cpu_arr = (ctypes.c_int * max(1, len(pin)))(*pin)
        handle = ctypes.c_void_p()
        rc = lib.tidal_cpu_create(
            num_threads, cpu_arr, len(pin), level, int(bool(fast_bf16_dot)), max(0, int(spin_us)), flags,
            ctypes.byref(handle),
        )
        if rc != 0:
            raise RuntimeError(f"cannot create the CPU expert kernel (error {rc})")
        self._handle = handle.value
        self._epoch = _fork_epoch
        self._pending: CpuExpertJob | None = None
        self._lock = threading.Lock()
        self._job_id = ctypes.c_uint64()
        self._bad = ctypes.c_int64()
        self.num_threads: int = lib.tidal_cpu_num_threads(self._handle)
        self.isa: str = ISA_NAMES[lib.tidal_cpu_isa(self._handle)]
        self.fast_bf16_dot: bool = bool(lib.tidal_cpu_fast_bf16(self._handle))
        self.pinned_threads: int = lib.tidal_cpu_pinned_count(self._handle)
        _live_kernels.add(self)

    def __repr__(self) -> str:
        return (f"CpuExpertKernel(num_threads={self.num_threads}, isa={self.isa!r}, "
                f"fast_bf16_dot={self.fast_bf16_dot}, pinned={self.pinned_threads})")

    def _check_open(self) -> None:
        if self._handle is None:
            raise RuntimeError("CpuExpertKernel is closed")
        if self._epoch != _fork_epoch:
            raise RuntimeError("CpuExpertKernel was created in another process (fork): create a new one")

    def submit(self, x, token_idx, expert_ids, weights, gate_up, down, out) -> CpuExpertJob:
        """Starts out[token_idx[p]] += weights[p] * expert_{expert_ids[p]}(x[token_idx[p]]) for all p
        and returns at once. See the module docstring for shapes and rules."""
        self._check_open()
        T, H, I, E, N = _validate(x, token_idx, expert_ids, weights, gate_up, down, out)
        with self._lock:
            if self._pending is not None:
                self._pending.wait()
                self._pending = None
            if N == 0:
                return CpuExpertJob(None, 0, None)
            rc = self._lib.tidal_cpu_submit(
                self._handle, x.data_ptr(), T, H, I, E, token_idx.data_ptr(), expert_ids.data_ptr(),
                weights.data_ptr(), N, gate_up.data_ptr(), down.data_ptr(), _DTYPE_CODES[gate_up.dtype],
                out.data_ptr(), ctypes.byref(self._job_id), ctypes.byref(self._bad),
            )
            if rc != 0:
                bad = self._bad.value
                if rc == _E_TOKEN:
                    raise ValueError(f"token_idx[{bad}] = {int(token_idx[bad])} is out of range [0, {T})")
                if rc == _E_EXPERT:
                    raise ValueError(f"expert_ids[{bad}] = {int(expert_ids[bad])} is out of range [0, {E})")
                raise RuntimeError(f"CPU expert kernel submit failed (error {rc})")
            job = CpuExpertJob(self, self._job_id.value, (x, token_idx, expert_ids, weights, gate_up, down, out))
            self._pending = job
            return job

    def run(self, x, token_idx, expert_ids, weights, gate_up, down, out) -> None:
        """submit(...) then wait()."""
        self.submit(x, token_idx, expert_ids, weights, gate_up, down, out).wait()

    def last_job_stats(self) -> dict[str, float]:
        """Microseconds from the last job's submit to: the first / last worker starting (the last can
        start after the job is done), phase 1 complete, the job done (0: not reached)."""
        self._check_open()
        buf = (ctypes.c_int64 * 4)()
        self._lib.tidal_cpu_last_job_stats(self._handle, buf)
        return {"first_start_us": buf[0] / 1e3, "last_start_us": buf[1] / 1e3,
                "barrier_us": buf[3] / 1e3, "done_us": buf[2] / 1e3}

    def close(self) -> None:
        """Waits for a job in flight, then stops and joins the workers. Idempotent."""
        handle = self._handle
        if handle is None:
            return
        if self._epoch != _fork_epoch:
            self._handle = None  # a forked child has no workers to stop
            return
        pending = self._pending
        if pending is not None:
            pending.wait()
            self._pending = None
        self._handle = None
        self._lib.tidal_cpu_destroy(handle)

    def __enter__(self) -> "CpuExpertKernel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
