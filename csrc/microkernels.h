// Internal interface between the job scheduler (pool.cpp) and the per-ISA dot-product kernels
// (kernels_*.cpp). Each ISA file is compiled with no global -march flag: its functions carry
// __attribute__((target(...))) and are only called after a run-time CPU check.
#pragma once
#include <stdint.h>
#include <string.h>

// x86-64 SIMD paths (AVX2, AVX-512) are compiled in on x86-64 only; elsewhere (aarch64, ...) the
// portable path alone is built. -DTIDAL_CPU_PORTABLE_ONLY forces that on x86-64 too (for tests).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(TIDAL_CPU_PORTABLE_ONLY)
#define TIDAL_CPU_X86 1
#else
#define TIDAL_CPU_X86 0
#endif

namespace tidal_cpu {

// A micro-kernel computes a block of dot products of R weight rows against TT activation vectors:
//     acc[r * kMaxTT + t] = sum_{k < K} w[r * ldw + k] * xs[t][k]      (r < R, t < TT)
// in fp32. The summation order for one (r, t) does not depend on R, TT or the thread, so results are
// bitwise reproducible for any thread count and blocking. With prefetch_next the kernel also
// prefetches rows R..2R-1 (the next row block of a sequential walk) while it reads rows 0..R-1.
constexpr int kMaxR = 4;
constexpr int kMaxTT = 4;

// w points to fp32, bf16 or fp16 weights depending on which slot of MicroKernels::dot it is.
using DotFn = void (*)(const void* w, int64_t ldw, int R, const float* const* xs, int TT, int64_t K,
                       float* acc, bool prefetch_next);
// bf16 x bf16 -> fp32 products (vdpbf16ps); activations already rounded to bf16.
using DotBf16Fn = void (*)(const uint16_t* w, int64_t ldw, int R, const uint16_t* const* xs, int TT,
                           int64_t K, float* acc, bool prefetch_next);

struct MicroKernels {
  DotFn dot[3] = {nullptr, nullptr, nullptr};  // indexed by TIDAL_DTYPE_*
  int max_r = 1;                                // rows per block the kernels are tuned for
  int max_tt = 1;                               // activation vectors per block (<= kMaxTT)
  DotBf16Fn dot_bf16 = nullptr;                 // only on AVX512_BF16
};

// Best TIDAL_ISA_* level of this CPU that this build has (isa.cpp).
int detected_isa();
// Fills *mk with the micro-kernels of `isa`; false if this build lacks that level.
bool load_kernels(int isa, MicroKernels* mk);

void get_generic_kernels(MicroKernels* mk);
#if TIDAL_CPU_X86
void get_avx2_kernels(MicroKernels* mk);
void get_avx512_kernels(MicroKernels* mk);
void get_avx512_bf16_kernels(MicroKernels* mk);  // adds dot_bf16 on top of the avx512 set
#endif

// ---- scalar conversions (exact; shared by all paths for tails) ----
static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal half: mant * 2^-24, exact in fp32
      float f = float(mant) * 5.9604644775390625e-8f;
      memcpy(&u, &f, 4);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / nan (payload kept)
  } else {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN stays NaN (quiet).
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <typename W>
static inline float to_f32(W v);
template <>
inline float to_f32<float>(float v) {
  return v;
}

// Tag types so templates can tell bf16 from fp16 (both are uint16_t in memory).
struct bf16_t {
  uint16_t v;
};
struct f16_t {
  uint16_t v;
};
template <>
inline float to_f32<bf16_t>(bf16_t v) {
  return bf16_to_f32(v.v);
}
template <>
inline float to_f32<f16_t>(f16_t v) {
  return f16_to_f32(v.v);
}

}  // namespace tidal_cpu
