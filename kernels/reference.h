// The plain references of the fused kernels: a Table (cpu/cpu_kernels.h) of scalar loops on one thread with double
// arithmetic, rounding to the element type exactly where the kernels round. What the tests hold every CPU build and the
// CUDA kernels to.
#pragma once

#include "kernels/cpu/cpu_kernels.h"

namespace trestle::kernels {

const cpu::Table& reference_table();

}  // namespace trestle::kernels
