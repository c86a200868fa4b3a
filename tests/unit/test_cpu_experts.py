"""CPU expert executor (tidal/kernels/cpu_experts.py + csrc/) against independent torch references.

The independent reference below walks the pair list one pair at a time in float64 with F.linear and
F.silu: no grouping, no shared code with the kernel or with torch_reference_experts.
"""

import gc

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels import cpu_experts as ce

NATIVE = ce.kernel_available()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native CPU kernel unavailable: {ce.unavailable_reason()}")

# Every ISA level this CPU can run (a kernel can be capped to any of them).
ISAS = ce.supported_isas()

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}


# ---------------------------------------------------------------------------------------------
# helpers


def make_bank(E, H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    return gate_up, down


def make_pairs(T, E, topk, seed=1):
    """Each token routes to topk distinct experts (experts repeat across tokens)."""
    g = torch.Generator().manual_seed(seed)
    tok, eid = [], []
    for t in range(T):
        for e in torch.randperm(E, generator=g)[:topk].tolist():
            tok.append(t)
            eid.append(e)
    w = torch.rand(len(tok), generator=g) + 0.1
    return torch.tensor(tok, dtype=torch.int32), torch.tensor(eid, dtype=torch.int32), w


def independent_reference(x, tok, eid, w, gate_up, down, out_init):
    ref = out_init.double().clone()
    I = gate_up.shape[1] // 2
    cache = {}
    for p in range(tok.numel()):
        t, e = int(tok[p]), int(eid[p])
        if e not in cache:
            cache[e] = (gate_up[e].double(), down[e].double())
        w_gu, w_d = cache[e]
        gu = F.linear(x[t].double(), w_gu)
        h = F.silu(gu[:I]) * gu[I:]
        ref[t] += float(w[p]) * F.linear(h, w_d)
    return ref


def rel_err(out, ref, out_init):
    scale = (ref - out_init.double()).abs().max().clamp_min(1e-30)
    return float((out.double() - ref).abs().max() / scale)


_kernels: dict = {}


def kernel(threads=2, isa=None, fast=False):
    key = (threads, isa, fast)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = ce.CpuExpertKernel(threads, isa=isa, fast_bf16_dot=fast, spin_us=50)
    return k


@pytest.fixture(scope="module", autouse=True)
def _close_kernels():
    # torch's OpenMP threads spin after each op; on a 2-core runner they would fight the kernel's own
    # spinning workers (a serving process should keep torch at 1 CPU thread for the same reason).
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(torch_threads)
    for k in _kernels.values():
        k.close()
    _kernels.clear()
    _cases.clear()


_cases: dict = {}


def make_case(H, I, E, T, topk, dtype, seed):
    """Inputs and both references of one case, computed once (the same case runs on every ISA)."""
    key = (H, I, E, T, topk, dtype, seed)
    if key not in _cases:
        if len(_cases) >= 128 or H * I > 1 << 16:  # keep the cache small (big shapes are few)
            _cases.clear()
        gate_up, down = make_bank(E, H, I, dtype, seed)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 7))
        tok, eid, w = make_pairs(T, E, topk, seed + 3)
        out_init = torch.full((T, H), 0.5) + torch.arange(T * H, dtype=torch.float32).reshape(T, H) * 1e-3
        ref = independent_reference(x, tok, eid, w, gate_up, down, out_init)
        out_t = out_init.clone()
        ce.torch_reference_experts(x, tok, eid, w, gate_up, down, out_t)
        assert rel_err(out_t, ref, out_init) < TOL[dtype]
        _cases[key] = (gate_up, down, x, tok, eid, w, out_init, ref, out_t)
    return _cases[key]


def check_case(H, I, E, T, topk, dtype, threads=2, isa=None, seed=0):
    gate_up, down, x, tok, eid, w, out_init, ref, out_t = make_case(H, I, E, T, topk, dtype, seed)
    out = out_init.clone()
    kernel(threads, isa).run(x, tok, eid, w, gate_up, down, out)
    assert rel_err(out, ref, out_init) < TOL[dtype], (H, I, E, T, topk, dtype, isa)
    assert rel_err(out, out_t.double(), out_init) < TOL[dtype]
    return out


# ---------------------------------------------------------------------------------------------
# torch fallback (always runs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,I,E", [(72, 40, 5), (257, 131, 6)])
def test_torch_reference_matches_independent(H, I, E, dtype):
    gate_up, down = make_bank(E, H, I, dtype)
    x = torch.randn(17, H)
    tok, eid, w = make_pairs(17, E, 3)
    out_init = torch.randn(17, H)
    ref = independent_reference(x, tok, eid, w, gate_up, down, out_init)
    out = out_init.clone()
    ce.torch_reference_experts(x, tok, eid, w, gate_up, down, out)
    assert rel_err(out, ref, out_init) < TOL[dtype]


def test_detected_isa_names():
    isa = ce.detected_isa()
    assert isa in ce.ISA_NAMES + ("none",)
    assert (isa == "none") == (not NATIVE)


def test_physical_core_cpus():
    cpus, n_cores = ce.physical_core_cpus()
    assert 1 <= n_cores <= len(cpus)
    assert len(set(cpus)) == len(cpus)


# ---------------------------------------------------------------------------------------------
# native kernel: numerics


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("H,I,E", [(72, 40, 5), (257, 131, 6)])
def test_odd_shapes(H, I, E, T, dtype, isa):
    for topk in (1, 2, 3, 4):
        check_case(H, I, E, T, topk, dtype, isa=isa, seed=topk)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qwen3_30b_a3b_shape(dtype):
    for isa in ISAS:
        check_case(2048, 768, 3, 3, 2, dtype, isa=isa)
    check_case(2048, 768, 3, 17, 2, dtype)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_many_tokens_per_expert(isa):
    # > 32 tokens per expert exercises the kernel's token blocking (L2 tiles).
    check_case(72, 40, 3, 70, 2, torch.bfloat16, isa=isa)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_thread_counts_bitwise_identical(threads):
    # Each output element is summed in a fixed order, whatever the thread count or chunking.
    base = check_case(257, 131, 6, 17, 4, torch.bfloat16, threads=1)
    out = check_case(257, 131, 6, 17, 4, torch.bfloat16, threads=threads)
    assert torch.equal(out, base)


@needs_native
def test_pairs_sharing_tokens_and_duplicates():
    H, I, E = 72, 40, 4
    gate_up, down = make_bank(E, H, I, torch.float32)
    x = torch.randn(3, H)
    # token 0 four times (expert 2 twice: duplicated pair), token 2 twice, token 1 never.
    tok = torch.tensor([0, 0, 2, 0, 2, 0], dtype=torch.int32)
    eid = torch.tensor([2, 1, 2, 2, 3, 0], dtype=torch.int32)
    w = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5, 3.0])
    out_init = torch.randn(3, H)
    ref = independent_reference(x, tok, eid, w, gate_up, down, out_init)
    out = out_init.clone()
    kernel().run(x, tok, eid, w, gate_up, down, out)
    assert rel_err(out, ref, out_init) < 1e-5
    assert torch.equal(out[1], out_init[1])  # untouched row


@needs_native
def test_accumulates_into_out():
    H, I, E = 72, 40, 3
    gate_up, down = make_bank(E, H, I, torch.float32)
    x = torch.randn(2, H)
    tok, eid, w = make_pairs(2, E, 2)
    zero = torch.zeros(2, H)
    delta = zero.clone()
    kernel().run(x, tok, eid, w, gate_up, down, delta)
    out = torch.full((2, H), 3.0)
    kernel().run(x, tok, eid, w, gate_up, down, out)
    torch.testing.assert_close(out, delta + 3.0, rtol=0, atol=1e-6)
    assert delta.abs().max() > 0.1


@needs_native
def test_empty_pair_list_is_noop():
    H, I, E = 72, 40, 3
    gate_up, down = make_bank(E, H, I, torch.bfloat16)
    x = torch.randn(2, H)
    out = torch.randn(2, H)
    before = out.clone()
    empty_i = torch.empty(0, dtype=torch.int32)
    job = kernel().submit(x, empty_i, empty_i, torch.empty(0), gate_up, down, out)
    assert job.done()
    job.wait()
    assert torch.equal(out, before)
    ce.torch_reference_experts(x, empty_i, empty_i, torch.empty(0), gate_up, down, out)
    assert torch.equal(out, before)


@needs_native
def test_fast_bf16_dot():
    H, I, E = 257, 131, 4
    k = kernel(2, None, True)
    gate_up, down = make_bank(E, H, I, torch.bfloat16)
    x = torch.randn(5, H)
    tok, eid, w = make_pairs(5, E, 2)
    out_init = torch.zeros(5, H)
    ref = independent_reference(x, tok, eid, w, gate_up, down, out_init)
    out = out_init.clone()
    k.run(x, tok, eid, w, gate_up, down, out)
    if k.fast_bf16_dot:
        assert k.isa == "avx512_bf16"
        assert rel_err(out, ref, out_init) < 3e-2  # activations rounded to bf16
    else:
        assert rel_err(out, ref, out_init) < 1e-4  # no vdpbf16ps on this CPU: exact path
    # fp32 weights never take the bf16 shortcut.
    gate_up32, down32 = make_bank(E, H, I, torch.float32)
    ref32 = independent_reference(x, tok, eid, w, gate_up32, down32, out_init)
    out32 = out_init.clone()
    k.run(x, tok, eid, w, gate_up32, down32, out32)
    assert rel_err(out32, ref32, out_init) < 1e-5


# ---------------------------------------------------------------------------------------------
# native kernel: asynchrony and lifetime


@needs_native
def test_submit_then_work_then_wait():
    H, I, E, T = 2048, 768, 3, 4
    gate_up, down = make_bank(E, H, I, torch.bfloat16)
    x = torch.randn(T, H)
    tok, eid, w = make_pairs(T, E, 2)
    out_init = torch.randn(T, H)
    ref = independent_reference(x, tok, eid, w, gate_up, down, out_init)
    out = out_init.clone()
    k = kernel()
    job = k.submit(x, tok, eid, w, gate_up, down, out)
    a = torch.randn(256, 256)
    busy = (a @ a).sum()  # Python/torch keep working while the pool computes
    job.wait()
    assert job.done()
    job.wait()  # idempotent
    assert torch.isfinite(busy)
    assert rel_err(out, ref, out_init) < 1e-4


@needs_native
def test_job_keeps_inputs_alive():
    H, I, E, T = 257, 131, 4, 3
    gate_up, down = make_bank(E, H, I, torch.float32)
    x = torch.randn(T, H)
    tok, eid, w = make_pairs(T, E, 2)
    out_init = torch.zeros(T, H)
    ref = independent_reference(x, tok, eid, w, gate_up, down, out_init)
    out = out_init.clone()
    job = kernel().submit(x.clone(), tok.clone(), eid.clone(), w.clone(), gate_up.clone(), down.clone(), out)
    gc.collect()
    job.wait()
    assert rel_err(out, ref, out_init) < 1e-5


@needs_native
def test_second_submit_waits_for_first():
    H, I, E, T = 257, 131, 4, 3
    gate_up, down = make_bank(E, H, I, torch.float32)
    x = torch.randn(T, H)
    tok, eid, w = make_pairs(T, E, 2)
    out1, out2 = torch.zeros(T, H), torch.zeros(T, H)
    k = kernel()
    j1 = k.submit(x, tok, eid, w, gate_up, down, out1)
    j2 = k.submit(x, tok, eid, w, gate_up, down, out2)
    assert j1.done()
    j2.wait()
    assert torch.equal(out1, out2)


@needs_native
def test_close_and_reuse_errors():
    k = ce.CpuExpertKernel(2, pin_threads=False)
    assert k.num_threads == 2 and k.isa in ISAS and k.pinned_threads == 0
    H, I, E = 72, 40, 2
    gate_up, down = make_bank(E, H, I, torch.float32)
    x, out = torch.randn(1, H), torch.zeros(1, H)
    tok, eid, w = make_pairs(1, E, 1)
    job = k.submit(x, tok, eid, w, gate_up, down, out)
    k.close()  # waits for the job first
    assert job.done()
    assert out.abs().max() > 0
    k.close()  # idempotent
    with pytest.raises(RuntimeError):
        k.submit(x, tok, eid, w, gate_up, down, out)
    with ce.CpuExpertKernel(1) as k2:
        assert k2.num_threads == 1


@needs_native
def test_default_threads_and_isa_env(monkeypatch):
    k = ce.CpuExpertKernel()
    try:
        assert k.num_threads == ce.physical_core_cpus()[1]
        assert k.isa == ce.detected_isa()
    finally:
        k.close()
    monkeypatch.setenv("TIDAL_CPU_ISA", "generic")
    assert ce.detected_isa() == "generic"
    k = ce.CpuExpertKernel(1)
    try:
        assert k.isa == "generic"
    finally:
        k.close()


# ---------------------------------------------------------------------------------------------
# argument validation (native kernel and torch fallback raise the same ValueErrors)


def _good_args():
    H, I, E, T = 72, 40, 3, 2
    gate_up, down = make_bank(E, H, I, torch.bfloat16)
    tok, eid, w = make_pairs(T, E, 2)
    return dict(x=torch.randn(T, H), token_idx=tok, expert_ids=eid, weights=w, gate_up=gate_up, down=down,
                out=torch.zeros(T, H))


_BAD = [
    ("x", lambda a: a["x"].double()),
    ("x", lambda a: torch.randn(2, 144)[:, ::2]),
    ("x", lambda a: torch.empty(2, 72, device="meta")),
    ("x", lambda a: a["x"].numpy()),
    ("token_idx", lambda a: a["token_idx"].long()),
    ("token_idx", lambda a: torch.tensor([0, 1, 2, 0], dtype=torch.int32)),  # 2 >= T
    ("token_idx", lambda a: torch.tensor([0, 1, -1, 0], dtype=torch.int32)),
    ("expert_ids", lambda a: torch.tensor([0, 1, 3, 0], dtype=torch.int32)),  # 3 >= E
    ("expert_ids", lambda a: a["expert_ids"][:3]),
    ("weights", lambda a: a["weights"].half()),
    ("weights", lambda a: a["weights"][:2]),
    ("gate_up", lambda a: a["gate_up"].transpose(1, 2).contiguous()),
    ("gate_up", lambda a: a["gate_up"].transpose(1, 2)),
    ("gate_up", lambda a: a["gate_up"].to(torch.float64)),
    ("gate_up", lambda a: a["gate_up"][:, :79]),
    ("down", lambda a: a["down"].float()),
    ("down", lambda a: a["down"][:, :, :39].contiguous()),
    ("out", lambda a: torch.zeros(3, 72)),
    ("out", lambda a: torch.zeros(2, 72, dtype=torch.bfloat16)),
    ("out", lambda a: a["x"]),
]


@pytest.mark.parametrize("name,make_bad", _BAD)
@pytest.mark.parametrize("impl", ["native", "torch"])
def test_validation_errors(impl, name, make_bad):
    if impl == "native" and not NATIVE:
        pytest.skip("native CPU kernel unavailable")
    args = _good_args()
    args[name] = make_bad(args)
    fn = kernel().run if impl == "native" else ce.torch_reference_experts
    with pytest.raises(ValueError, match=name):
        fn(**args)


@needs_native
def test_constructor_validation():
    with pytest.raises(ValueError, match="num_threads"):
        ce.CpuExpertKernel(0)
    with pytest.raises(ValueError, match="isa"):
        ce.CpuExpertKernel(1, isa="sse9")
