// RMSNorm forward, y = x / sqrt(mean(x^2) + eps) * weight over the last dimension: a CPU reference and, when built
// with CUDA, the GPU kernel (one block per row). Both take float32 row-major [rows, cols].
#pragma once

#include <cstdint>

namespace trestle::kernels {

void rmsnorm_forward_reference(const float* x, const float* weight, float* y, std::int64_t rows, std::int64_t cols,
                               float eps);

#if defined(TRESTLE_HAVE_CUDA)
// Launches on `stream` (a cudaStream_t); pointers are device memory.
void rmsnorm_forward_cuda(const float* x, const float* weight, float* y, std::int64_t rows, std::int64_t cols,
                          float eps, void* stream);
#endif

}  // namespace trestle::kernels
