// AVX2 + FMA + F16C micro-kernels (Haswell and later, Zen). Weights are widened to fp32 in registers
// (bf16: zero-extend to 32 bits and shift left 16, which is exact; fp16: vcvtph2ps) and multiplied with
// the fp32 activations, so the result is the fp32 dot product up to summation order.
#include "microkernels.h"

#if TIDAL_CPU_X86
#include <immintrin.h>

#define TIDAL_TGT_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace tidal_cpu {
namespace {

template <typename W>
struct Ld;
template <>
struct Ld<float> {
  TIDAL_TGT_AVX2 static inline __m256 v8(const float* p) { return _mm256_loadu_ps(p); }
};
template <>
struct Ld<bf16_t> {
  TIDAL_TGT_AVX2 static inline __m256 v8(const bf16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
template <>
struct Ld<f16_t> {
  TIDAL_TGT_AVX2 static inline __m256 v8(const f16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

TIDAL_TGT_AVX2 static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// 32 elements per main-loop step: one 64-byte line of a 16-bit weight row (two for fp32).
constexpr int64_t kStep = 32;

template <typename W, int R, int TT>
TIDAL_TGT_AVX2 void dot_avx2(const W* w, int64_t ldw, const float* const* xs, int64_t K, float* acc,
                             bool pf) {
  __m256 a[R][TT];
  const float* x[TT];
  for (int t = 0; t < TT; ++t) x[t] = xs[t];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) a[r][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    if (pf) {
      for (int r = 0; r < R; ++r) {
        const char* p = reinterpret_cast<const char*>(w + (R + r) * ldw + k);
        for (int b = 0; b < int(kStep * sizeof(W)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 4
    for (int s = 0; s < kStep; s += 8) {
      __m256 xv[TT];
      for (int t = 0; t < TT; ++t) xv[t] = _mm256_loadu_ps(x[t] + k + s);
      for (int r = 0; r < R; ++r) {
        __m256 wv = Ld<W>::v8(w + r * ldw + k + s);
        for (int t = 0; t < TT; ++t) a[r][t] = _mm256_fmadd_ps(wv, xv[t], a[r][t]);
      }
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = _mm256_loadu_ps(x[t] + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = Ld<W>::v8(w + r * ldw + k);
      for (int t = 0; t < TT; ++t) a[r][t] = _mm256_fmadd_ps(wv, xv[t], a[r][t]);
    }
  }
  float tail[R][TT] = {};
  for (; k < K; ++k) {
    for (int r = 0; r < R; ++r) {
      float wv = to_f32<W>(w[r * ldw + k]);
      for (int t = 0; t < TT; ++t) tail[r][t] += wv * x[t][k];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r * kMaxTT + t] = hsum8(a[r][t]) + tail[r][t];
}

// 4 rows x 2 vectors = 8 accumulators + 2 activations + 1 weight: fits the 16 ymm registers.
constexpr int kAvx2MaxR = 4;
constexpr int kAvx2MaxTT = 2;

template <typename W>
TIDAL_TGT_AVX2 void dispatch(const void* wv, int64_t ldw, int R, const float* const* xs, int TT,
                             int64_t K, float* acc, bool pf) {
  const W* w = static_cast<const W*>(wv);
  if (R == 4) {
    if (TT == 2) return dot_avx2<W, 4, 2>(w, ldw, xs, K, acc, pf);
    return dot_avx2<W, 4, 1>(w, ldw, xs, K, acc, pf);
  }
  for (int r = 0; r < R; ++r) {
    if (TT == 2)
      dot_avx2<W, 1, 2>(w + r * ldw, ldw, xs, K, acc + r * kMaxTT, pf);
    else
      dot_avx2<W, 1, 1>(w + r * ldw, ldw, xs, K, acc + r * kMaxTT, pf);
  }
}

}  // namespace

void get_avx2_kernels(MicroKernels* mk) {
  mk->dot[0] = dispatch<float>;
  mk->dot[1] = dispatch<bf16_t>;
  mk->dot[2] = dispatch<f16_t>;
  mk->max_r = kAvx2MaxR;
  mk->max_tt = kAvx2MaxTT;
  mk->dot_bf16 = nullptr;
}

}  // namespace tidal_cpu

#endif  // x86-64
