// Portable micro-kernels: plain loops over 8 independent lanes so the compiler can vectorise them for
// the baseline ISA of any target (SSE2 on x86-64, NEON on aarch64) without -ffast-math.
#include "microkernels.h"

namespace tidal_cpu {
namespace {

constexpr int kLanes = 8;

template <typename W, int R, int TT>
void dot_generic(const W* w, int64_t ldw, const float* const* xs, int64_t K, float* acc, bool pf) {
  float a[R][TT][kLanes] = {};
  const float* x[TT];
  for (int t = 0; t < TT; ++t) x[t] = xs[t];
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (pf && ((k * int64_t(sizeof(W))) % 64) == 0) {
      for (int r = 0; r < R; ++r) __builtin_prefetch(w + (R + r) * ldw + k, 0, 2);
    }
    for (int r = 0; r < R; ++r) {
      float wv[kLanes];
      for (int l = 0; l < kLanes; ++l) wv[l] = to_f32<W>(w[r * ldw + k + l]);
      for (int t = 0; t < TT; ++t)
        for (int l = 0; l < kLanes; ++l) a[r][t][l] += wv[l] * x[t][k + l];
    }
  }
  for (; k < K; ++k) {
    for (int r = 0; r < R; ++r) {
      float wv = to_f32<W>(w[r * ldw + k]);
      for (int t = 0; t < TT; ++t) a[r][t][0] += wv * x[t][k];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      float s = 0.f;
      for (int l = 0; l < kLanes; ++l) s += a[r][t][l];
      acc[r * kMaxTT + t] = s;
    }
}

constexpr int kGenericMaxR = 2;
constexpr int kGenericMaxTT = 2;

template <typename W>
void dispatch(const void* wv, int64_t ldw, int R, const float* const* xs, int TT, int64_t K, float* acc,
              bool pf) {
  const W* w = static_cast<const W*>(wv);
  if (R == 2) {
    if (TT == 2) return dot_generic<W, 2, 2>(w, ldw, xs, K, acc, pf);
    return dot_generic<W, 2, 1>(w, ldw, xs, K, acc, pf);
  }
  for (int r = 0; r < R; ++r) {
    if (TT == 2)
      dot_generic<W, 1, 2>(w + r * ldw, ldw, xs, K, acc + r * kMaxTT, pf);
    else
      dot_generic<W, 1, 1>(w + r * ldw, ldw, xs, K, acc + r * kMaxTT, pf);
  }
}

}  // namespace

void get_generic_kernels(MicroKernels* mk) {
  mk->dot[0] = dispatch<float>;
  mk->dot[1] = dispatch<bf16_t>;
  mk->dot[2] = dispatch<f16_t>;
  mk->max_r = kGenericMaxR;
  mk->max_tt = kGenericMaxTT;
  mk->dot_bf16 = nullptr;
}

}  // namespace tidal_cpu
