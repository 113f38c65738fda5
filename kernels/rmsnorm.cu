#include <cuda_runtime.h>

#include "kernels/rmsnorm.h"

namespace trestle::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void rmsnorm_forward_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                                       float* __restrict__ y, std::int64_t cols, float eps) {
  const float* row = x + blockIdx.x * cols;
  float* out = y + blockIdx.x * cols;
  float partial = 0.f;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) partial += row[c] * row[c];
  for (int offset = 16; offset > 0; offset /= 2) partial += __shfl_xor_sync(0xffffffff, partial, offset);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = partial;
  __syncthreads();
  __shared__ float inv_rms;
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    inv_rms = rsqrtf(total / static_cast<float>(cols) + eps);
  }
  __syncthreads();
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[c] = row[c] * inv_rms * weight[c];
}

}  // namespace

void rmsnorm_forward_cuda(const float* x, const float* weight, float* y, std::int64_t rows, std::int64_t cols,
                          float eps, void* stream) {
  if (rows == 0) return;
  rmsnorm_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, weight, y,
                                                                                                          cols, eps);
}

}  // namespace trestle::kernels
