// Run-time choice of the instruction set: what the CPU (and the OS) supports, and the micro-kernel
// table of each level.
#include "cpu_experts.h"
#include "microkernels.h"

#if TIDAL_CPU_X86
#include <cpuid.h>
#endif

namespace tidal_cpu {
namespace {

#if TIDAL_CPU_X86
// cpuid + xgetbv rather than __builtin_cpu_supports: same information (CPU flags AND the OS saving the
// ymm/zmm state), but it builds with any GCC/Clang version, including ones that predate avx512bf16
// in their builtin's feature table.
int detect_isa_impl() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return TIDAL_ISA_GENERIC;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29);
  if (!osxsave || !avx) return TIDAL_ISA_GENERIC;
  unsigned xlo, xhi;
  __asm__ __volatile__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const uint64_t xcr0 = (uint64_t(xhi) << 32) | xlo;
  const bool ymm_ok = (xcr0 & 0x6) == 0x6;     // SSE + AVX state
  const bool zmm_ok = (xcr0 & 0xe6) == 0xe6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return TIDAL_ISA_GENERIC;
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30),
             avx512vl = b & (1u << 31);
  const unsigned max_sub = a;
  bool avx512bf16 = false;
  if (max_sub >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) avx512bf16 = a & (1u << 5);
  if (!(ymm_ok && avx2 && fma && f16c)) return TIDAL_ISA_GENERIC;
  if (!(zmm_ok && avx512f && avx512bw && avx512vl)) return TIDAL_ISA_AVX2;
  return avx512bf16 ? TIDAL_ISA_AVX512_BF16 : TIDAL_ISA_AVX512;
}
#else
int detect_isa_impl() { return TIDAL_ISA_GENERIC; }
#endif

}  // namespace

int detected_isa() {
  static const int isa = detect_isa_impl();
  return isa;
}

bool load_kernels(int isa, MicroKernels* mk) {
  switch (isa) {
    case TIDAL_ISA_GENERIC: get_generic_kernels(mk); return true;
#if TIDAL_CPU_X86
    case TIDAL_ISA_AVX2: get_avx2_kernels(mk); return true;
    case TIDAL_ISA_AVX512: get_avx512_kernels(mk); return true;
    case TIDAL_ISA_AVX512_BF16: get_avx512_bf16_kernels(mk); return true;
#endif
    default: return false;
  }
}

}  // namespace tidal_cpu
