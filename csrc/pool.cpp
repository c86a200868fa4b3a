// CPU expert executor: persistent worker pool + job scheduling (see cpu_experts.h for the contract).
//
// A job runs in two phases:
//   phase 1  h[p] = silu(W_g[e] x[t]) * (W_u[e] x[t]) for every pair p = (t, e, w), pairs grouped by
//            expert so each weight row is read once for all tokens routed to that expert. The work is
//            the flat list of (expert, row range) chunks of all experts of the job, taken dynamically
//            by the workers, so a job with one expert still uses every core.
//   phase 2  out[t] += w * W_d[e] h[p]. Chunks are ranges of output rows [r0, r1) of H covering ALL
//            experts, so exactly one worker ever writes a given out[:, r]: no atomics, no races, and
//            the per-row sum over experts always runs in the same order (bitwise reproducible for any
//            thread count).
// With the fast bf16 path a phase 0 first rounds x to bf16 (and phase 1 stores h in bf16 too).
//
// Phases are separated by completion counters, not by a barrier of all threads: a phase starts once
// every chunk of the previous one is complete, whoever did them, and the job is done when its last
// phase-2 chunk is. A worker that wakes late (its core was busy with the Python thread, say) finds
// the chunks taken and leaves, so a straggler never delays the job it missed nor the next submit.
// Publication is seqlock-like: `gen` is 2*job when job is published and odd while the submitter
// rewrites the job and its scratch; a worker enters a job by incrementing `active` and re-reading
// `gen` (both seq_cst), the submitter marks gen odd and then waits for active == 0 (Dekker), so no
// worker ever reads a job that is being rewritten.
//
// Workers spin for spin_us after a job (decode submits come back within ~1 ms), then sleep on a
// condition variable; the submitting thread never computes, it goes back to driving the GPU.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "cpu_experts.h"
#include "microkernels.h"

#if defined(__linux__)
#include <sched.h>
#endif
#if TIDAL_CPU_X86
#include <immintrin.h>
#endif

namespace tidal_cpu {
namespace {

inline void cpu_relax() {
#if TIDAL_CPU_X86
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Spin-wait step: pause, and once per kYieldNs of spinning give the core away (sched_yield) so a
// thread sharing this core (the Python thread, or a worker when oversubscribed) still runs, without
// a syscall every few pauses (syscalls are slow in sandboxes such as gVisor).
constexpr int64_t kYieldNs = 20000;

class Spinner {
 public:
  Spinner() : start_(now_ns()), last_yield_(start_) {}
  // Returns the nanoseconds spun so far (updated every 64 steps).
  int64_t step() {
    cpu_relax();
    if ((++it_ & 63) == 0) {
      const int64_t t = now_ns();
      elapsed_ = t - start_;
      if (t - last_yield_ > kYieldNs) {
        std::this_thread::yield();
        last_yield_ = now_ns();
      }
    }
    return elapsed_;
  }

 private:
  const int64_t start_;
  int64_t last_yield_;
  int64_t elapsed_ = 0;
  uint32_t it_ = 0;
};

template <class Pred>
void spin_until(Pred pred) {
  Spinner spinner;
  while (!pred()) spinner.step();
}

struct Group {
  int32_t expert;
  int64_t off;  // first pair of this expert in sorted order
  int64_t n;    // number of pairs
};

struct Chunk1 {
  int32_t group;
  int32_t i0, i1;  // intermediate rows [i0, i1) of gate and up
};

constexpr int64_t kTokenBlock = 32;      // tokens per L2 block (activations stay cache-resident)
constexpr int64_t kRowCostTokens = 16;   // reading a weight row ~ this many token passes over it

struct Job {
  const float* x = nullptr;
  int64_t T = 0, H = 0, I = 0;
  const char* gate_up = nullptr;
  const char* down = nullptr;
  int dtype = 0;
  int64_t wbytes = 4;
  float* out = nullptr;
  bool fast = false;
  int64_t n_chunks0 = 0, rows0 = 0;  // phase 0: x -> bf16, rows of x per chunk
  int64_t n_chunks1 = 0;
  int64_t n_chunks2 = 0, rows2 = 0;  // phase 2: output rows per chunk
};

struct Kernel {
  int nthreads = 0;
  int isa = 0;
  bool fast_bf16 = false;
  bool prefetch = true;
  int64_t spin_ns = 0;
  MicroKernels mk;
  std::vector<int> cpus;
  std::vector<std::thread> threads;
  std::atomic<int> pinned{0};
  std::atomic<int> ready{0};

  // Job publication: the submitter fills `job` and the scratch below, then bumps `gen` under `mu`.
  std::mutex mu;
  std::condition_variable cv_work, cv_done;
  int sleepers = 0;  // guarded by mu
  bool stop = false; // guarded by mu (read racily only as a hint via stop_hint)
  std::atomic<bool> stop_hint{false};
  alignas(64) std::atomic<uint64_t> gen{0};       // 2 * current job id; odd while preparing one
  alignas(64) std::atomic<uint64_t> done_seq{0};  // id of the last finished job
  alignas(64) std::atomic<int> active{0};         // workers inside a job
  alignas(64) std::atomic<int> started{0};
  alignas(64) std::atomic<int64_t> next_chunk[3];  // per phase: next chunk to claim
  alignas(64) std::atomic<int64_t> done_chunk[3];  // per phase: chunks completed
  std::mutex submit_mu;  // one submitter at a time

  Job job;
  std::vector<int32_t> sorted_tok;  // [N] token of each pair, grouped by expert
  std::vector<float> sorted_w;      // [N]
  std::vector<Group> groups;
  std::vector<Chunk1> chunks1;
  std::vector<int64_t> counts;
  std::vector<float> h;        // [N, I] fp32
  std::vector<uint16_t> hb;    // [N, I] bf16 (fast path)
  std::vector<uint16_t> xb;    // [T, H] bf16 (fast path)

  // Stats of the current/last job (ns since its submit).
  int64_t t_submit = 0;
  std::atomic<int64_t> t_first{0}, t_last{0}, t_barrier{0}, t_done{0};

  explicit Kernel(int n) : nthreads(n) {
    for (auto& c : next_chunk) c.store(0);
    for (auto& c : done_chunk) c.store(0);
  }

  void worker(int tid);
  bool wait_for_work(uint64_t seen);
  void run_job(uint64_t id);
  void complete(uint64_t id);
  void phase0_chunk(int64_t c);
  void phase1_chunk(const Chunk1& c);
  void phase2_chunk(int64_t c);
  void wait_done(uint64_t id);
};

// True once a job other than `seen` is published (gen even and != seen); false on stop.
bool Kernel::wait_for_work(uint64_t seen) {
  auto fresh = [&] {
    const uint64_t g = gen.load(std::memory_order_acquire);
    return g != seen && (g & 1) == 0;
  };
  Spinner spinner;
  while (!fresh()) {
    if (stop_hint.load(std::memory_order_relaxed) || spinner.step() > spin_ns) break;
  }
  if (fresh()) return true;
  std::unique_lock<std::mutex> lk(mu);
  ++sleepers;
  cv_work.wait(lk, [&] { return stop || fresh(); });
  --sleepers;
  return !stop;
}

void Kernel::worker(int tid) {
#if defined(__linux__)
  if (!cpus.empty()) {
    const int cpu = cpus[size_t(tid) % cpus.size()];
    if (cpu >= 0 && cpu < CPU_SETSIZE) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) pinned.fetch_add(1);
    }
  }
#endif
  ready.fetch_add(1);
  uint64_t seen = 0;
  for (;;) {
    if (!wait_for_work(seen)) break;
    const uint64_t g = gen.load(std::memory_order_seq_cst);
    active.fetch_add(1, std::memory_order_seq_cst);
    if ((g & 1) != 0 || gen.load(std::memory_order_seq_cst) != g) {
      active.fetch_sub(1, std::memory_order_release);  // a new job is being prepared: look again
      continue;
    }
    seen = g;
    const int order = started.fetch_add(1, std::memory_order_relaxed);
    if (order == 0) t_first.store(now_ns() - t_submit, std::memory_order_relaxed);
    if (order == nthreads - 1) t_last.store(now_ns() - t_submit, std::memory_order_relaxed);
    run_job(g / 2);
    active.fetch_sub(1, std::memory_order_release);
  }
}

void Kernel::complete(uint64_t id) {
  t_done.store(now_ns() - t_submit, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu);
    done_seq.store(id, std::memory_order_release);
  }
  cv_done.notify_all();
}

void Kernel::run_job(uint64_t id) {
  const Job& j = job;
  // Chunk completions are acq_rel RMWs on one counter, so a thread that reads the final count has
  // seen every write made by the chunks (h, xb, out).
  if (j.fast) {
    for (int64_t c; (c = next_chunk[0].fetch_add(1, std::memory_order_relaxed)) < j.n_chunks0;) {
      phase0_chunk(c);
      done_chunk[0].fetch_add(1, std::memory_order_acq_rel);
    }
    spin_until([&] { return done_chunk[0].load(std::memory_order_acquire) == j.n_chunks0; });
  }
  for (int64_t c; (c = next_chunk[1].fetch_add(1, std::memory_order_relaxed)) < j.n_chunks1;) {
    phase1_chunk(chunks1[size_t(c)]);
    if (done_chunk[1].fetch_add(1, std::memory_order_acq_rel) + 1 == j.n_chunks1)
      t_barrier.store(now_ns() - t_submit, std::memory_order_relaxed);
  }
  spin_until([&] { return done_chunk[1].load(std::memory_order_acquire) == j.n_chunks1; });
  for (int64_t c; (c = next_chunk[2].fetch_add(1, std::memory_order_relaxed)) < j.n_chunks2;) {
    phase2_chunk(c);
    if (done_chunk[2].fetch_add(1, std::memory_order_acq_rel) + 1 == j.n_chunks2) complete(id);
  }
}

void Kernel::phase0_chunk(int64_t c) {
  const Job& j = job;
  const int64_t t0 = c * j.rows0, t1 = std::min(j.T, t0 + j.rows0);
  const float* src = j.x + t0 * j.H;
  uint16_t* dst = xb.data() + t0 * j.H;
  const int64_t n = (t1 - t0) * j.H;
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

void Kernel::phase1_chunk(const Chunk1& c) {
  const Job& j = job;
  const Group& g = groups[size_t(c.group)];
  const int64_t H = j.H, I = j.I;
  const int max_r = mk.max_r, max_tt = mk.max_tt;
  const char* wg = j.gate_up + size_t(g.expert) * size_t(2 * I * H) * size_t(j.wbytes);
  const char* wu = wg + size_t(I * H) * size_t(j.wbytes);
  const int32_t* tok = sorted_tok.data() + g.off;
  float accg[kMaxR * kMaxTT], accu[kMaxR * kMaxTT];
  const float* xs[kMaxTT];
  const uint16_t* xsb[kMaxTT];
  for (int64_t tb0 = 0; tb0 < g.n; tb0 += kTokenBlock) {
    const int64_t tb1 = std::min(g.n, tb0 + kTokenBlock);
    for (int64_t i = c.i0; i < c.i1; i += max_r) {
      const int R = int(std::min<int64_t>(max_r, c.i1 - i));
      for (int64_t t0 = tb0; t0 < tb1; t0 += max_tt) {
        const int TT = int(std::min<int64_t>(max_tt, tb1 - t0));
        // Prefetch the next rows only on the first pass over these rows (later passes hit cache)
        // and not past the chunk (the next chunk likely belongs to another core).
        const bool pf = prefetch && t0 == 0 && i + R < c.i1;
        if (j.fast) {
          for (int t = 0; t < TT; ++t) xsb[t] = xb.data() + int64_t(tok[t0 + t]) * H;
          const uint16_t* g16 = reinterpret_cast<const uint16_t*>(wg) + i * H;
          const uint16_t* u16 = reinterpret_cast<const uint16_t*>(wu) + i * H;
          mk.dot_bf16(g16, H, R, xsb, TT, H, accg, pf);
          mk.dot_bf16(u16, H, R, xsb, TT, H, accu, pf);
        } else {
          for (int t = 0; t < TT; ++t) xs[t] = j.x + int64_t(tok[t0 + t]) * H;
          const DotFn dot = mk.dot[j.dtype];
          dot(wg + size_t(i * H) * size_t(j.wbytes), H, R, xs, TT, H, accg, pf);
          dot(wu + size_t(i * H) * size_t(j.wbytes), H, R, xs, TT, H, accu, pf);
        }
        for (int t = 0; t < TT; ++t) {
          float* hrow = h.data() + (g.off + t0 + t) * I + i;
          for (int r = 0; r < R; ++r) hrow[r] = silu_mul(accg[r * kMaxTT + t], accu[r * kMaxTT + t]);
          if (j.fast) {
            uint16_t* hbrow = hb.data() + (g.off + t0 + t) * I + i;
            for (int r = 0; r < R; ++r) hbrow[r] = f32_to_bf16(hrow[r]);
          }
        }
      }
    }
  }
}

void Kernel::phase2_chunk(int64_t c) {
  const Job& j = job;
  const int64_t H = j.H, I = j.I;
  const int64_t r0 = c * j.rows2, r1 = std::min(H, r0 + j.rows2);
  const int max_r = mk.max_r, max_tt = mk.max_tt;
  float acc[kMaxR * kMaxTT];
  const float* hs[kMaxTT];
  const uint16_t* hsb[kMaxTT];
  for (const Group& g : groups) {
    const char* wd = j.down + size_t(g.expert) * size_t(H * I) * size_t(j.wbytes);
    const int32_t* tok = sorted_tok.data() + g.off;
    const float* wt = sorted_w.data() + g.off;
    for (int64_t tb0 = 0; tb0 < g.n; tb0 += kTokenBlock) {
      const int64_t tb1 = std::min(g.n, tb0 + kTokenBlock);
      for (int64_t r = r0; r < r1; r += max_r) {
        const int R = int(std::min<int64_t>(max_r, r1 - r));
        for (int64_t t0 = tb0; t0 < tb1; t0 += max_tt) {
          const int TT = int(std::min<int64_t>(max_tt, tb1 - t0));
          const bool pf = prefetch && t0 == 0 && r + R < r1;
          if (j.fast) {
            for (int t = 0; t < TT; ++t) hsb[t] = hb.data() + (g.off + t0 + t) * I;
            mk.dot_bf16(reinterpret_cast<const uint16_t*>(wd) + r * I, I, R, hsb, TT, I, acc, pf);
          } else {
            for (int t = 0; t < TT; ++t) hs[t] = h.data() + (g.off + t0 + t) * I;
            mk.dot[j.dtype](wd + size_t(r * I) * size_t(j.wbytes), I, R, hs, TT, I, acc, pf);
          }
          for (int t = 0; t < TT; ++t) {
            float* o = j.out + int64_t(tok[t0 + t]) * H + r;
            const float w = wt[t0 + t];
            for (int rr = 0; rr < R; ++rr) o[rr] += w * acc[rr * kMaxTT + t];
          }
        }
      }
    }
  }
}

void Kernel::wait_done(uint64_t id) {
  if (done_seq.load(std::memory_order_acquire) >= id) return;
  // (Spinner yields now and then: a worker pinned to this core may be runnable.)
  Spinner spinner;
  while (done_seq.load(std::memory_order_acquire) < id) {
    if (spinner.step() > spin_ns) break;
  }
  if (done_seq.load(std::memory_order_acquire) >= id) return;
  std::unique_lock<std::mutex> lk(mu);
  cv_done.wait(lk, [&] { return done_seq.load(std::memory_order_relaxed) >= id; });
}


int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

int submit_impl(Kernel* k, const float* x, int64_t T, int64_t H, int64_t I, int64_t E,
                const int32_t* token_idx, const int32_t* expert_ids, const float* weights, int64_t N,
                const void* gate_up, const void* down, int dtype, float* out, uint64_t* out_job,
                int64_t* bad_index) {
  if (!out_job || T < 0 || H < 0 || I < 0 || E < 0 || N < 0) return TIDAL_CPU_EINVAL;
  if (dtype < TIDAL_DTYPE_F32 || dtype > TIDAL_DTYPE_F16) return TIDAL_CPU_EINVAL;
  if (N > 0 && (!x || !token_idx || !expert_ids || !weights || !gate_up || !down || !out))
    return TIDAL_CPU_EINVAL;
  if (N > INT32_MAX || I > INT32_MAX) return TIDAL_CPU_EINVAL;
  std::lock_guard<std::mutex> slk(k->submit_mu);
  if (k->stop_hint.load()) return TIDAL_CPU_ECLOSED;
  // One job at a time: the previous one must be done (its output complete) first.
  const uint64_t g0 = k->gen.load(std::memory_order_relaxed);  // even: only submitters change it
  k->wait_done(g0 / 2);
  for (int64_t p = 0; p < N; ++p) {
    if (token_idx[p] < 0 || token_idx[p] >= T) {
      if (bad_index) *bad_index = p;
      return TIDAL_CPU_ETOKEN;
    }
    if (expert_ids[p] < 0 || expert_ids[p] >= E) {
      if (bad_index) *bad_index = p;
      return TIDAL_CPU_EEXPERT;
    }
  }
  if (N == 0 || H == 0 || I == 0) {  // nothing to add
    *out_job = g0 / 2;
    return TIDAL_CPU_OK;
  }
  const bool fast = k->fast_bf16 && dtype == TIDAL_DTYPE_BF16 && k->mk.dot_bf16 != nullptr;
  // Close the previous job to late workers, then wait until none is inside it.
  k->gen.store(g0 + 1, std::memory_order_seq_cst);
  spin_until([&] { return k->active.load(std::memory_order_seq_cst) == 0; });
  try {
    // Group pairs by expert (stable counting sort: pair order inside an expert is kept).
    k->counts.assign(size_t(E) + 1, 0);
    for (int64_t p = 0; p < N; ++p) k->counts[size_t(expert_ids[p]) + 1]++;
    k->groups.clear();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = k->counts[size_t(e) + 1];
      if (n) k->groups.push_back(Group{int32_t(e), k->counts[size_t(e)], n});
      k->counts[size_t(e) + 1] += k->counts[size_t(e)];
    }
    k->sorted_tok.resize(size_t(N));
    k->sorted_w.resize(size_t(N));
    for (int64_t p = 0; p < N; ++p) {
      const int64_t dst = k->counts[size_t(expert_ids[p])]++;
      k->sorted_tok[size_t(dst)] = token_idx[p];
      k->sorted_w[size_t(dst)] = weights[p];
    }
    k->h.resize(size_t(N * I));
    if (fast) {
      k->hb.resize(size_t(N * I));
      k->xb.resize(size_t(T * H));
    }

    Job& j = k->job;
    j = Job{};
    j.x = x;
    j.T = T;
    j.H = H;
    j.I = I;
    j.gate_up = static_cast<const char*>(gate_up);
    j.down = static_cast<const char*>(down);
    j.dtype = dtype;
    j.wbytes = dtype == TIDAL_DTYPE_F32 ? 4 : 2;
    j.out = out;
    j.fast = fast;
    const int64_t P = k->nthreads;
    const int64_t max_r = k->mk.max_r;

    if (fast) {
      j.rows0 = std::max<int64_t>(1, (T + 2 * P - 1) / (2 * P));
      j.n_chunks0 = (T + j.rows0 - 1) / j.rows0;
    }

    // Phase 1 chunks: about 8 per thread, sized by cost (row reads + per-token work), whole row
    // blocks, and small enough (<= 512 KiB of gate+up weights) to stay in L2 across token blocks.
    double total = 0;
    for (const Group& g : k->groups) total += double(I) * double(kRowCostTokens + g.n);
    const double target = total / double(8 * P);
    const int64_t l2_rows =
        std::max<int64_t>(max_r, (512 << 10) / std::max<int64_t>(1, 2 * H * j.wbytes) / max_r * max_r);
    k->chunks1.clear();
    for (size_t gi = 0; gi < k->groups.size(); ++gi) {
      const Group& g = k->groups[gi];
      int64_t rows = int64_t(target / double(kRowCostTokens + g.n));
      rows = std::min(round_up(std::max<int64_t>(rows, 1), max_r), l2_rows);
      rows = std::max<int64_t>(std::min(rows, I), 1);
      for (int64_t i0 = 0; i0 < I; i0 += rows)
        k->chunks1.push_back(Chunk1{int32_t(gi), int32_t(i0), int32_t(std::min(I, i0 + rows))});
    }
    j.n_chunks1 = int64_t(k->chunks1.size());

    // Phase 2 chunks: output rows, multiples of 16 floats (one cache line of out) so two workers
    // never write the same line of out; about 8 per thread so a slowed worker (sharing its core)
    // does not hold the job back.
    j.rows2 = std::max<int64_t>(16, round_up((H + 8 * P - 1) / (8 * P), 16));
    j.n_chunks2 = (H + j.rows2 - 1) / j.rows2;
  } catch (const std::bad_alloc&) {
    k->gen.store(g0, std::memory_order_seq_cst);  // no new job
    return TIDAL_CPU_ENOMEM;
  }

  for (int ph = 0; ph < 3; ++ph) {
    k->next_chunk[ph].store(0, std::memory_order_relaxed);
    k->done_chunk[ph].store(0, std::memory_order_relaxed);
  }
  k->started.store(0, std::memory_order_relaxed);
  for (auto* t : {&k->t_first, &k->t_last, &k->t_barrier, &k->t_done}) t->store(0, std::memory_order_relaxed);
  const uint64_t id = g0 / 2 + 1;
  bool wake;
  {
    std::lock_guard<std::mutex> lk(k->mu);
    k->t_submit = now_ns();
    k->gen.store(2 * id, std::memory_order_release);
    wake = k->sleepers > 0;
  }
  if (wake) k->cv_work.notify_all();
  *out_job = id;
  return TIDAL_CPU_OK;
}

void destroy_impl(Kernel* k) {
  {
    std::lock_guard<std::mutex> slk(k->submit_mu);
    k->wait_done(k->gen.load(std::memory_order_relaxed) / 2);
    {
      std::lock_guard<std::mutex> lk(k->mu);
      k->stop = true;
      k->stop_hint.store(true);
    }
    k->cv_work.notify_all();
  }
  for (auto& t : k->threads)
    if (t.joinable()) t.join();
  delete k;
}

}  // namespace
}  // namespace tidal_cpu

using tidal_cpu::Kernel;

extern "C" {

int tidal_cpu_abi_version(void) { return TIDAL_CPU_ABI_VERSION; }

int tidal_cpu_detect_isa(void) { return tidal_cpu::detected_isa(); }

int tidal_cpu_create(int num_threads, const int* cpus, int ncpus, int isa, int fast_bf16_dot,
                     int spin_us, int flags, void** out_handle) {
  if (!out_handle || num_threads < 1 || num_threads > 4096 || ncpus < 0 || (ncpus > 0 && !cpus))
    return TIDAL_CPU_EINVAL;
  const int best = tidal_cpu::detected_isa();
  if (isa < 0) isa = best;
  if (isa > TIDAL_ISA_AVX512_BF16) return TIDAL_CPU_EINVAL;
  if (isa > best) return TIDAL_CPU_EISA;
  Kernel* k = nullptr;
  try {
    k = new Kernel(num_threads);
    if (!tidal_cpu::load_kernels(isa, &k->mk)) {
      delete k;
      return TIDAL_CPU_EISA;
    }
    k->isa = isa;
    k->fast_bf16 = fast_bf16_dot != 0 && k->mk.dot_bf16 != nullptr;
    k->prefetch = (flags & TIDAL_CPU_FLAG_NO_PREFETCH) == 0;
    k->spin_ns = int64_t(std::max(0, spin_us)) * 1000;
    k->cpus.assign(cpus, cpus + ncpus);
    k->threads.reserve(size_t(num_threads));
    for (int i = 0; i < num_threads; ++i) k->threads.emplace_back([k, i] { k->worker(i); });
  } catch (const std::bad_alloc&) {
    if (k) tidal_cpu::destroy_impl(k);
    return TIDAL_CPU_ENOMEM;
  } catch (...) {
    if (k) tidal_cpu::destroy_impl(k);
    return TIDAL_CPU_ETHREAD;
  }
  while (k->ready.load() < num_threads) std::this_thread::yield();
  *out_handle = k;
  return TIDAL_CPU_OK;
}

void tidal_cpu_destroy(void* handle) {
  if (handle) tidal_cpu::destroy_impl(static_cast<Kernel*>(handle));
}

int tidal_cpu_num_threads(void* handle) { return handle ? static_cast<Kernel*>(handle)->nthreads : 0; }
int tidal_cpu_isa(void* handle) { return handle ? static_cast<Kernel*>(handle)->isa : -1; }
int tidal_cpu_fast_bf16(void* handle) { return handle ? int(static_cast<Kernel*>(handle)->fast_bf16) : 0; }
int tidal_cpu_pinned_count(void* handle) {
  return handle ? static_cast<Kernel*>(handle)->pinned.load() : 0;
}

int tidal_cpu_submit(void* handle, const float* x, int64_t T, int64_t H, int64_t I, int64_t E,
                     const int32_t* token_idx, const int32_t* expert_ids, const float* weights,
                     int64_t N, const void* gate_up, const void* down, int dtype, float* out,
                     uint64_t* out_job, int64_t* bad_index) {
  if (!handle) return TIDAL_CPU_EINVAL;
  try {
    return tidal_cpu::submit_impl(static_cast<Kernel*>(handle), x, T, H, I, E, token_idx, expert_ids,
                                  weights, N, gate_up, down, dtype, out, out_job, bad_index);
  } catch (...) {
    return TIDAL_CPU_ENOMEM;
  }
}

int tidal_cpu_wait(void* handle, uint64_t job) {
  if (!handle) return TIDAL_CPU_EINVAL;
  try {
    static_cast<Kernel*>(handle)->wait_done(job);
  } catch (...) {
    return TIDAL_CPU_EINVAL;
  }
  return TIDAL_CPU_OK;
}

int tidal_cpu_done(void* handle, uint64_t job) {
  if (!handle) return 1;
  return static_cast<Kernel*>(handle)->done_seq.load(std::memory_order_acquire) >= job ? 1 : 0;
}

int tidal_cpu_last_job_stats(void* handle, int64_t* out4) {
  if (!handle || !out4) return TIDAL_CPU_EINVAL;
  Kernel* k = static_cast<Kernel*>(handle);
  out4[0] = k->t_first.load(std::memory_order_relaxed);
  out4[1] = k->t_last.load(std::memory_order_relaxed);
  out4[2] = k->t_done.load(std::memory_order_relaxed);
  out4[3] = k->t_barrier.load(std::memory_order_relaxed);
  return TIDAL_CPU_OK;
}

// Lets setuptools build this as a regular "extension" (it lands next to cpu_experts.py, in place for
// editable installs). It is loaded with ctypes, never imported: importing it fails cleanly.
__attribute__((visibility("default"))) void* PyInit__cpu_experts(void) { return nullptr; }

}  // extern "C"
