// The fused kernels on the GPU. RMSNorm: one block per row (the row's sum of squares reduced over the block); its
// backward's weight gradient summed per block over a grid-stride set of rows, then over the blocks. The gated units
// and soft-capping: elementwise, grid-stride. RoPE: elementwise too, each output from its element and the other of its
// rotation pair. Arithmetic in fp32, values rounded to the element type where the CPU
// versions round them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_kernels.h"

namespace trestle::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Element;
template <>
struct Element<float> {
  __device__ static float load(float v) { return v; }
  __device__ static float store(float v) { return v; }
};
template <>
struct Element<__nv_bfloat16> {
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16(v); }
};
template <>
struct Element<__half> {
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half(v); }
};

template <typename T>
__device__ float rounded(float v) {
  return Element<T>::load(Element<T>::store(v));
}

// The sum of v over the block (every thread gets it).
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0;
  const int warps = (blockDim.x + 31) / 32;
  for (int w = 0; w < warps; ++w) total += partial[w];
  return total;
}

template <typename T>
__global__ void rms_norm_forward_kernel(const T* x, const T* weight, T* y, float* inv_rms, std::int64_t cols,
                                        float eps, bool zero_centered) {
  const std::int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  float squares = 0;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = Element<T>::load(xr[c]);
    squares += v * v;
  }
  const float inv = 1.0f / sqrtf(block_sum(squares) / static_cast<float>(cols) + eps);
  if (threadIdx.x == 0) inv_rms[r] = inv;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float normed = Element<T>::load(xr[c]) * inv, w = Element<T>::load(weight[c]);
    yr[c] = Element<T>::store(zero_centered ? normed * (1.0f + w) : rounded<T>(normed) * w);
  }
}

template <typename T>
__global__ void rms_norm_backward_kernel(const T* dy, const T* x, const T* weight, const float* inv_rms, T* dx,
                                         float* partial, std::int64_t rows, std::int64_t cols, bool zero_centered) {
  float* dw = partial + static_cast<std::int64_t>(blockIdx.x) * cols;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) dw[c] = 0;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    const float inv = inv_rms[r];
    float dot = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float w = Element<T>::load(weight[c]);
      dot += Element<T>::load(dyr[c]) * (zero_centered ? w + 1.0f : w) * Element<T>::load(xr[c]) * inv;
    }
    const float mean = block_sum(dot) / static_cast<float>(cols);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float w = Element<T>::load(weight[c]), d = Element<T>::load(dyr[c]);
      const float normed = Element<T>::load(xr[c]) * inv;
      dx[r * cols + c] = Element<T>::store(inv * (d * (zero_centered ? w + 1.0f : w) - normed * mean));
      dw[c] += d * (zero_centered ? normed : rounded<T>(normed));
    }
  }
}

__global__ void sum_partials_kernel(const float* partial, float* dweight, std::int64_t blocks, std::int64_t cols) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float total = 0;
  for (std::int64_t b = 0; b < blocks; ++b) total += partial[b * cols + c];
  dweight[c] = total;
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

__device__ void activation(Glu glu, float g, float& act, float& slope) {
  if (glu == Glu::kSwiGlu) {
    const float sigma = 1.0f / (1.0f + expf(-g));
    act = g * sigma;
    slope = sigma * (1.0f + g * (1.0f - sigma));
    return;
  }
  const float t = tanhf(kSqrt2OverPi * (g + kGeluCubic * g * g * g));
  act = 0.5f * g * (1.0f + t);
  slope = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * g * g);
}

template <typename T>
__global__ void glu_forward_kernel(Glu glu, const T* in, T* out, std::int64_t rows, std::int64_t n) {
  const std::int64_t total = rows * n;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / n, k = i % n;
    float act, slope;
    activation(glu, Element<T>::load(in[r * 2 * n + k]), act, slope);
    out[i] = Element<T>::store(act * Element<T>::load(in[r * 2 * n + n + k]));
  }
}

template <typename T>
__global__ void glu_backward_kernel(Glu glu, const T* dy, const T* in, T* din, std::int64_t rows, std::int64_t n) {
  const std::int64_t total = rows * n;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / n, k = i % n;
    float act, slope;
    activation(glu, Element<T>::load(in[r * 2 * n + k]), act, slope);
    const float d = Element<T>::load(dy[i]), up = Element<T>::load(in[r * 2 * n + n + k]);
    din[r * 2 * n + k] = Element<T>::store(d * up * slope);
    din[r * 2 * n + n + k] = Element<T>::store(d * act);
  }
}

template <typename T>
__global__ void softcap_forward_kernel(const T* x, T* y, std::int64_t numel, float cap) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    y[i] = Element<T>::store(cap * tanhf(Element<T>::load(x[i]) / cap));
}

template <typename T>
__global__ void softcap_backward_kernel(const T* dy, const T* y, T* dx, std::int64_t numel, float cap) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float t = Element<T>::load(y[i]) / cap;
    dx[i] = Element<T>::store(Element<T>::load(dy[i]) * (1.0f - t * t));
  }
}

// Each element of x [rows, heads, head_dim]: rotated with its pair partner by the row's tables (the transpose when
// `transpose`: sin negated and, plain, taken at the partner's index), or copied past rot_dim.
template <typename T>
__global__ void rope_kernel(const T* x, const float* cos, const float* sin, T* y, std::int64_t rows, std::int64_t heads,
                            std::int64_t head_dim, std::int64_t rot, bool interleaved, bool transpose) {
  const std::int64_t total = rows * heads * head_dim, h = rot / 2;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t d = i % head_dim, head = i - d, r = i / (heads * head_dim);
    if (d >= rot) {
      y[i] = x[i];
      continue;
    }
    const float v = Element<T>::load(x[i]);
    const float* c = cos + r * rot;
    const float* s = sin + r * rot;
    float out;
    if (interleaved) {
      const std::int64_t pair = d / 2;
      const float sine = transpose ? -s[pair] : s[pair];
      out = d % 2 == 0 ? v * c[pair] - Element<T>::load(x[head + d + 1]) * sine
                       : v * c[pair] + Element<T>::load(x[head + d - 1]) * sine;
    } else if (d < h) {  // v·cos[d] - x[d+h]·(sin[d], or the transpose's -sin[d+h])
      out = v * c[d] - Element<T>::load(x[head + d + h]) * (transpose ? -s[d + h] : s[d]);
    } else {  // v·cos[d] + x[d-h]·(sin[d], or the transpose's -sin[d-h])
      out = v * c[d] + Element<T>::load(x[head + d - h]) * (transpose ? -s[d - h] : s[d]);
    }
    y[i] = Element<T>::store(out);
  }
}

unsigned elementwise_blocks(std::int64_t n) {
  return static_cast<unsigned>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 65535));
}

std::string launched() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

template <typename F>
std::string typed(Dtype type, F f) {
  switch (type) {
    case Dtype::kFloat:
      f(static_cast<float*>(nullptr));
      break;
    case Dtype::kBFloat16:
      f(static_cast<__nv_bfloat16*>(nullptr));
      break;
    case Dtype::kHalf:
      f(static_cast<__half*>(nullptr));
      break;
  }
  return launched();
}

int row_threads(std::int64_t cols) {
  return static_cast<int>(std::min<std::int64_t>(1024, std::max<std::int64_t>(32, (cols + 31) / 32 * 32 / 4)));
}

std::string rope(Dtype type, const void* x, const float* cos, const float* sin, void* y, std::int64_t rows,
                 std::int64_t heads, std::int64_t head_dim, std::int64_t rot_dim, bool interleaved, bool transpose,
                 void* stream) {
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_kernel<T><<<elementwise_blocks(rows * heads * head_dim), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), cos, sin, static_cast<T*>(y), rows, heads, head_dim, rot_dim, interleaved, transpose);
  });
}

}  // namespace

std::int64_t partial_rows(std::int64_t rows) { return std::min<std::int64_t>(std::max<std::int64_t>(rows, 1), 512); }

std::string rms_norm_forward(Dtype type, const void* x, const void* weight, void* y, float* inv_rms,
                             std::int64_t rows, std::int64_t cols, float eps, bool zero_centered, void* stream) {
  if (rows > 2147483647) return "too many rows for one launch";
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_forward_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<T*>(y), inv_rms, cols, eps,
        zero_centered);
  });
}

std::string rms_norm_backward(Dtype type, const void* dy, const void* x, const void* weight, const float* inv_rms,
                              void* dx, float* dweight, float* partial, std::int64_t rows, std::int64_t cols,
                              bool zero_centered, void* stream) {
  const std::int64_t blocks = partial_rows(rows);
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto s = static_cast<cudaStream_t>(stream);
    rms_norm_backward_kernel<T><<<static_cast<unsigned>(blocks), row_threads(cols), 0, s>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(weight), inv_rms,
        static_cast<T*>(dx), partial, rows, cols, zero_centered);
    sum_partials_kernel<<<static_cast<unsigned>((cols + kThreads - 1) / kThreads), kThreads, 0, s>>>(partial, dweight,
                                                                                                   blocks, cols);
  });
}

std::string glu_forward(Dtype type, Glu glu, const void* in, void* out, std::int64_t rows, std::int64_t n,
                        void* stream) {
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    glu_forward_kernel<T><<<elementwise_blocks(rows * n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        glu, static_cast<const T*>(in), static_cast<T*>(out), rows, n);
  });
}

std::string glu_backward(Dtype type, Glu glu, const void* dy, const void* in, void* din, std::int64_t rows,
                         std::int64_t n, void* stream) {
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    glu_backward_kernel<T><<<elementwise_blocks(rows * n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        glu, static_cast<const T*>(dy), static_cast<const T*>(in), static_cast<T*>(din), rows, n);
  });
}

std::string softcap_forward(Dtype type, const void* x, void* y, std::int64_t numel, float cap, void* stream) {
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softcap_forward_kernel<T><<<elementwise_blocks(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<T*>(y), numel, cap);
  });
}

std::string softcap_backward(Dtype type, const void* dy, const void* y, void* dx, std::int64_t numel, float cap,
                             void* stream) {
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    softcap_backward_kernel<T><<<elementwise_blocks(numel), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx), numel, cap);
  });
}

std::string rope_forward(Dtype type, const void* x, const float* cos, const float* sin, void* y, std::int64_t rows,
                         std::int64_t heads, std::int64_t head_dim, std::int64_t rot_dim, bool interleaved,
                         void* stream) {
  return rope(type, x, cos, sin, y, rows, heads, head_dim, rot_dim, interleaved, /*transpose=*/false, stream);
}

std::string rope_backward(Dtype type, const void* dy, const float* cos, const float* sin, void* dx, std::int64_t rows,
                          std::int64_t heads, std::int64_t head_dim, std::int64_t rot_dim, bool interleaved,
                          void* stream) {
  return rope(type, dy, cos, sin, dx, rows, heads, head_dim, rot_dim, interleaved, /*transpose=*/true, stream);
}

}  // namespace trestle::kernels::cuda
