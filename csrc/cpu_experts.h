// Tidal CPU expert executor: plain C ABI (loaded from Python with ctypes, which drops the GIL
// for every call, so a blocking wait never stalls other Python threads).
//
// One kernel object owns a persistent pool of worker threads. A job computes, for every
// (token t, expert e, weight w) pair of its pair list, SwiGLU experts as in HF Qwen3MoeExperts:
//     gate_up = W_gu[e] @ x[t]                 W_gu[e]: [2I, H] (rows 0..I-1 gate, I..2I-1 up)
//     h       = silu(gate_up[:I]) * gate_up[I:]
//     out[t] += w * (W_d[e] @ h)               W_d[e]:  [H, I]
// with fp32 accumulation. Weights are bf16, fp16 or fp32; x, weights, out are fp32.
//
// Every function returns 0 or a negative TIDAL_CPU_E* code; none throws across the ABI.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TIDAL_CPU_ABI_VERSION 1

// ISA levels, ordered: a kernel may run any level <= the detected one.
#define TIDAL_ISA_GENERIC 0
#define TIDAL_ISA_AVX2 1         // avx2 + fma + f16c
#define TIDAL_ISA_AVX512 2       // avx512f + avx512bw + avx512vl
#define TIDAL_ISA_AVX512_BF16 3  // the above + avx512_bf16 (vdpbf16ps)

#define TIDAL_DTYPE_F32 0
#define TIDAL_DTYPE_BF16 1
#define TIDAL_DTYPE_F16 2

#define TIDAL_CPU_OK 0
#define TIDAL_CPU_EINVAL -1     // bad argument (null pointer, negative size, unknown dtype/isa)
#define TIDAL_CPU_ETOKEN -2     // token_idx[*bad_index] out of [0, T)
#define TIDAL_CPU_EEXPERT -3    // expert_ids[*bad_index] out of [0, E)
#define TIDAL_CPU_EISA -4       // requested ISA not supported by this CPU / build
#define TIDAL_CPU_ENOMEM -5
#define TIDAL_CPU_ETHREAD -6    // could not start worker threads
#define TIDAL_CPU_ECLOSED -7

__attribute__((visibility("default"))) int tidal_cpu_abi_version(void);
// Best ISA level of this CPU that this build can use.
__attribute__((visibility("default"))) int tidal_cpu_detect_isa(void);

// Creates a pool of num_threads workers. cpus (may be NULL, ncpus 0) lists CPU ids; worker i is
// pinned to cpus[i % ncpus] (pin failures are tolerated and counted). isa: -1 = detected best,
// else a TIDAL_ISA_* level <= the detected one. fast_bf16_dot != 0 uses vdpbf16ps (rounds the
// activations to bf16) for bf16 weights when the ISA has it. spin_us: how long an idle worker (and a
// waiter) spins before sleeping. flags: TIDAL_CPU_FLAG_* (tuning). On success *out_handle is set.
#define TIDAL_CPU_FLAG_NO_PREFETCH 1  // no software prefetch of the next weight rows
__attribute__((visibility("default"))) int tidal_cpu_create(int num_threads, const int* cpus, int ncpus,
                                                            int isa, int fast_bf16_dot, int spin_us,
                                                            int flags, void** out_handle);
// Stops and joins the workers (after waiting for a job in flight) and frees the kernel.
__attribute__((visibility("default"))) void tidal_cpu_destroy(void* handle);

// Queries of a created kernel.
__attribute__((visibility("default"))) int tidal_cpu_num_threads(void* handle);
__attribute__((visibility("default"))) int tidal_cpu_isa(void* handle);
__attribute__((visibility("default"))) int tidal_cpu_fast_bf16(void* handle);
__attribute__((visibility("default"))) int tidal_cpu_pinned_count(void* handle);

// Starts a job and returns at once with *out_job set (job ids increase from 1). If a previous job
// is still running, waits for it first (one job at a time per kernel; thread-safe). All buffers must stay alive
// and unchanged (out: untouched by others) until the job is done. Index errors are reported
// synchronously (no work starts) with *bad_index set. N == 0 completes at once.
__attribute__((visibility("default"))) int tidal_cpu_submit(
    void* handle, const float* x, int64_t T, int64_t H, int64_t I, int64_t E,
    const int32_t* token_idx, const int32_t* expert_ids, const float* weights, int64_t N,
    const void* gate_up, const void* down, int dtype, float* out, uint64_t* out_job,
    int64_t* bad_index);
// Blocks (spin briefly, then sleep) until job `job` is done. Idempotent.
__attribute__((visibility("default"))) int tidal_cpu_wait(void* handle, uint64_t job);
// 1 if job `job` is done, else 0.
__attribute__((visibility("default"))) int tidal_cpu_done(void* handle, uint64_t job);
// Timing of the last job, nanoseconds after its submit (0: not reached yet): out[0] first worker
// started, out[1] last worker started (can be after the job is done: late workers only
// acknowledge), out[2] job done (last output chunk complete), out[3] phase 1 complete.
__attribute__((visibility("default"))) int tidal_cpu_last_job_stats(void* handle, int64_t* out4);

#ifdef __cplusplus
}
#endif
