// The fused kernels' element type (cpu::Dtype, which the CPU and CUDA versions take) of an ATen dtype.
#pragma once

#include <c10/core/ScalarType.h>

#include "kernels/cpu/cpu_kernels.h"

namespace trestle::kernels {

// float, bfloat16 or half; any other dtype is a c10::Error naming it.
cpu::Dtype dtype_of(at::ScalarType type);

}  // namespace trestle::kernels
