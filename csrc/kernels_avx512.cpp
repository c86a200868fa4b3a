// AVX-512 micro-kernels (Skylake-SP and later, Zen 4).
//
// Exact path (default, all weight dtypes): weights are widened to fp32 in registers (bf16: vpmovzxwd +
// vpslld 16, exact; fp16: vcvtph2ps, exact) and FMA'd with the fp32 activations.
// Fast path (bf16 weights, AVX512_BF16 only, opt-in): vdpbf16ps against activations rounded to bf16
// once per job; it halves the activation bytes and the uops per weight but changes the result by the
// activation rounding (relative ~2^-9 per product), so it is not the default.
// Tails use masked loads, so any K works without padding.
//
// AMX (tdpbf16ps, Sapphire Rapids) would only pay off for prefill-sized token tiles, where the CPU is
// compute-bound; decode at batch 1 is bound by DRAM and is served by the paths below.
#include "microkernels.h"

#if TIDAL_CPU_X86
// GCC 12's AVX-512 headers use self-initialised "undefined" vectors that -Wall reports when inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#define TIDAL_TGT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define TIDAL_TGT_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

namespace tidal_cpu {
namespace {

template <typename W>
struct Ld;
template <>
struct Ld<float> {
  TIDAL_TGT_AVX512 static inline __m512 v16(const float* p) { return _mm512_loadu_ps(p); }
  TIDAL_TGT_AVX512 static inline __m512 m16(const float* p, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, p);
  }
};
template <>
struct Ld<bf16_t> {
  TIDAL_TGT_AVX512 static inline __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  TIDAL_TGT_AVX512 static inline __m512 v16(const bf16_t* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  TIDAL_TGT_AVX512 static inline __m512 m16(const bf16_t* p, __mmask16 m) {
    return widen(_mm256_maskz_loadu_epi16(m, p));
  }
};
template <>
struct Ld<f16_t> {
  TIDAL_TGT_AVX512 static inline __m512 v16(const f16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  TIDAL_TGT_AVX512 static inline __m512 m16(const f16_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
};

// Horizontal sum in a fixed order.
TIDAL_TGT_AVX512 static inline float hsum16(__m512 v) {
  __m512 s = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  __m128 q = _mm512_castps512_ps128(s);
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// 32 elements per main-loop step: one 64-byte line of a 16-bit weight row (two for fp32).
constexpr int64_t kStep = 32;

template <typename W, int R, int TT>
TIDAL_TGT_AVX512 void dot_avx512(const W* w, int64_t ldw, const float* const* xs, int64_t K,
                                 float* acc, bool pf) {
  __m512 a[R][TT];
  const float* x[TT];
  for (int t = 0; t < TT; ++t) x[t] = xs[t];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) a[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    if (pf) {
      for (int r = 0; r < R; ++r) {
        const char* p = reinterpret_cast<const char*>(w + (R + r) * ldw + k);
        for (int b = 0; b < int(kStep * sizeof(W)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 2
    for (int s = 0; s < kStep; s += 16) {
      __m512 xv[TT];
      for (int t = 0; t < TT; ++t) xv[t] = _mm512_loadu_ps(x[t] + k + s);
      for (int r = 0; r < R; ++r) {
        __m512 wv = Ld<W>::v16(w + r * ldw + k + s);
        for (int t = 0; t < TT; ++t) a[r][t] = _mm512_fmadd_ps(wv, xv[t], a[r][t]);
      }
    }
  }
  for (; k < K; k += 16) {
    int64_t left = K - k;
    __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
    __m512 xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = _mm512_maskz_loadu_ps(m, x[t] + k);
    for (int r = 0; r < R; ++r) {
      __m512 wv = Ld<W>::m16(w + r * ldw + k, m);
      for (int t = 0; t < TT; ++t) a[r][t] = _mm512_fmadd_ps(wv, xv[t], a[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r * kMaxTT + t] = hsum16(a[r][t]);
}

// 4 rows x 4 vectors = 16 accumulators + 4 activations + 1 weight: fits the 32 zmm registers.
constexpr int kAvx512MaxR = 4;
constexpr int kAvx512MaxTT = 4;

template <typename W>
TIDAL_TGT_AVX512 void dispatch(const void* wv, int64_t ldw, int R, const float* const* xs, int TT,
                               int64_t K, float* acc, bool pf) {
  const W* w = static_cast<const W*>(wv);
  if (R == 4) {
    switch (TT) {
      case 4: return dot_avx512<W, 4, 4>(w, ldw, xs, K, acc, pf);
      case 3: return dot_avx512<W, 4, 3>(w, ldw, xs, K, acc, pf);
      case 2: return dot_avx512<W, 4, 2>(w, ldw, xs, K, acc, pf);
      default: return dot_avx512<W, 4, 1>(w, ldw, xs, K, acc, pf);
    }
  }
  for (int r = 0; r < R; ++r) {
    const W* wr = w + r * ldw;
    float* ar = acc + r * kMaxTT;
    switch (TT) {
      case 4: dot_avx512<W, 1, 4>(wr, ldw, xs, K, ar, pf); break;
      case 3: dot_avx512<W, 1, 3>(wr, ldw, xs, K, ar, pf); break;
      case 2: dot_avx512<W, 1, 2>(wr, ldw, xs, K, ar, pf); break;
      default: dot_avx512<W, 1, 1>(wr, ldw, xs, K, ar, pf); break;
    }
  }
}

// ---- vdpbf16ps path: 32 bf16 pairs per instruction, fp32 accumulators ----
TIDAL_TGT_AVX512BF16 static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

template <int R, int TT>
TIDAL_TGT_AVX512BF16 void dot_dpbf16(const uint16_t* w, int64_t ldw, const uint16_t* const* xs,
                                     int64_t K, float* acc, bool pf) {
  __m512 a[R][TT];
  const uint16_t* x[TT];
  for (int t = 0; t < TT; ++t) x[t] = xs[t];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) a[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (pf) {
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * ldw + k), _MM_HINT_T0);
    }
    __m512bh xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = as_bh(_mm512_loadu_si512(x[t] + k));
    for (int r = 0; r < R; ++r) {
      __m512bh wv = as_bh(_mm512_loadu_si512(w + r * ldw + k));
      for (int t = 0; t < TT; ++t) a[r][t] = _mm512_dpbf16_ps(a[r][t], wv, xv[t]);
    }
  }
  if (k < K) {
    __mmask32 m = __mmask32((1ull << (K - k)) - 1ull);
    __m512bh xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = as_bh(_mm512_maskz_loadu_epi16(m, x[t] + k));
    for (int r = 0; r < R; ++r) {
      __m512bh wv = as_bh(_mm512_maskz_loadu_epi16(m, w + r * ldw + k));
      for (int t = 0; t < TT; ++t) a[r][t] = _mm512_dpbf16_ps(a[r][t], wv, xv[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r * kMaxTT + t] = hsum16(a[r][t]);
}

TIDAL_TGT_AVX512BF16 void dispatch_dpbf16(const uint16_t* w, int64_t ldw, int R,
                                          const uint16_t* const* xs, int TT, int64_t K, float* acc,
                                          bool pf) {
  if (R == 4) {
    switch (TT) {
      case 4: return dot_dpbf16<4, 4>(w, ldw, xs, K, acc, pf);
      case 3: return dot_dpbf16<4, 3>(w, ldw, xs, K, acc, pf);
      case 2: return dot_dpbf16<4, 2>(w, ldw, xs, K, acc, pf);
      default: return dot_dpbf16<4, 1>(w, ldw, xs, K, acc, pf);
    }
  }
  for (int r = 0; r < R; ++r) {
    const uint16_t* wr = w + r * ldw;
    float* ar = acc + r * kMaxTT;
    switch (TT) {
      case 4: dot_dpbf16<1, 4>(wr, ldw, xs, K, ar, pf); break;
      case 3: dot_dpbf16<1, 3>(wr, ldw, xs, K, ar, pf); break;
      case 2: dot_dpbf16<1, 2>(wr, ldw, xs, K, ar, pf); break;
      default: dot_dpbf16<1, 1>(wr, ldw, xs, K, ar, pf); break;
    }
  }
}

}  // namespace

void get_avx512_kernels(MicroKernels* mk) {
  mk->dot[0] = dispatch<float>;
  mk->dot[1] = dispatch<bf16_t>;
  mk->dot[2] = dispatch<f16_t>;
  mk->max_r = kAvx512MaxR;
  mk->max_tt = kAvx512MaxTT;
  mk->dot_bf16 = nullptr;
}

void get_avx512_bf16_kernels(MicroKernels* mk) {
  get_avx512_kernels(mk);
  mk->dot_bf16 = dispatch_dpbf16;
}

}  // namespace tidal_cpu

#endif  // x86-64
