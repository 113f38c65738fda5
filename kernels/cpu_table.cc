#include "kernels/cpu_table.h"

#include <cstdlib>
#include <string>

namespace trestle::kernels {

const cpu::Table& cpu_table() {
  static const cpu::Table& table = []() -> const cpu::Table& {
    const char* env = std::getenv("ATEN_CPU_CAPABILITY");
    const std::string wanted = env ? env : "";
#if defined(TRESTLE_KERNELS_AVX512)
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (avx512 && (wanted.empty() || wanted == "avx512")) return cpu::table_avx512();
#endif
#if defined(TRESTLE_KERNELS_AVX2)
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2 && wanted != "default") return cpu::table_avx2();
#endif
    (void)wanted;
    return cpu::table_default();
  }();
  return table;
}

}  // namespace trestle::kernels
