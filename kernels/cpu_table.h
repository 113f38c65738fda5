// The CPU build of the fused kernels this process runs (cpu/cpu_kernels.h): the best this CPU runs, or the one
// ATEN_CPU_CAPABILITY names (default, avx2, avx512), as ATen picks its own kernels. Chosen once, on the first call.
#pragma once

#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace trestle::kernels {

const cpu::Table& cpu_table();
// Every CPU build this CPU runs, portable first (the tests run each).
std::vector<const cpu::Table*> runnable_cpu_tables();

}  // namespace trestle::kernels
