#include "kernels/cpu_table.h"

#include <cstdlib>
#include <string>

namespace trestle::kernels {

namespace {

bool runs_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool runs_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

}  // namespace

const cpu::Table& cpu_table() {
  static const cpu::Table& table = []() -> const cpu::Table& {
    const char* env = std::getenv("ATEN_CPU_CAPABILITY");
    // As ATen reads it: "avx2" and "default" (exactly) cap the choice; any other value, "AVX512" included, is
    // ignored (ATen warns) and the best the CPU runs is taken.
    const std::string wanted = env ? env : "";
#if defined(TRESTLE_KERNELS_AVX512)
    if (runs_avx512() && wanted != "avx2" && wanted != "default") return cpu::table_avx512();
#endif
#if defined(TRESTLE_KERNELS_AVX2)
    if (runs_avx2() && wanted != "default") return cpu::table_avx2();
#endif
    (void)wanted;
    return cpu::table_default();
  }();
  return table;
}

std::vector<const cpu::Table*> runnable_cpu_tables() {
  std::vector<const cpu::Table*> out{&cpu::table_default()};
#if defined(TRESTLE_KERNELS_AVX2)
  if (runs_avx2()) out.push_back(&cpu::table_avx2());
#endif
#if defined(TRESTLE_KERNELS_AVX512)
  if (runs_avx512()) out.push_back(&cpu::table_avx512());
#endif
  return out;
}

}  // namespace trestle::kernels
