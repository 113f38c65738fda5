// The fused kernels on the GPU. Each thread's arithmetic lives in a header the CPU tests run too (rms_norm_share.h,
// glu_pack.h, softcap_pack.h, rope_slot.h); here are the launches and the block-wide sums. Rows and weights whose
// sizes and addresses allow it are read and written 16 bytes at a time (8 bf16 / half or 4 fp32), otherwise one
// element at a time. RMSNorm: a warp per row where a row fits in its lanes' registers (no block-wide step: the row's
// sums by shuffles; the backward's warps take grid-stride rows, each lane summing its columns' weight gradient in
// registers, then the block's warps in shared memory), else a block per row, two passes over it with the thread's
// packs held in registers, the row's sum of squares reduced over the block; that backward takes a grid-stride set of
// rows per block, each row read while the block reduces the one before, and sums the weight gradient per block (in
// shared memory when a row of it fits). Either backward then sums the blocks' weight gradients. The gated units: rows
// over the grid's y, each row's packs over x. Soft-capping: packs, grid-stride. The cross-entropy's gradient reads a
// thread's packs before writing any. RoPE: (row, head, pack) grid-stride where a head splits into packs (rope_pack),
// else a block per row, its threads over (slot, head).
// Arithmetic in fp32, values rounded to the element type where the CPU versions round them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/cpu/cross_entropy_logit.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/glu_pack.h"
#include "kernels/cuda/rms_norm_share.h"
#include "kernels/cuda/rope_slot.h"
#include "kernels/cuda/softcap_pack.h"

namespace trestle::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Element;
template <>
struct Element<float> {
  __host__ __device__ static float load(float v) { return v; }
  __host__ __device__ static float store(float v) { return v; }
};
template <>
struct Element<__nv_bfloat16> {
  __host__ __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __host__ __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16(v); }
};
template <>
struct Element<__half> {
  __host__ __device__ static float load(__half v) { return __half2float(v); }
  __host__ __device__ static __half store(float v) { return __float2half(v); }
};

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

// The largest v over the block (every thread gets it); NaN is passed over, as fmaxf does.
__device__ float block_max(float v) {
  __shared__ float partial[32];
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = -INFINITY;
  const int warps = (blockDim.x + 31) / 32;
  for (int w = 0; w < warps; ++w) total = fmaxf(total, partial[w]);
  return total;
}

// The sum of v over the warp (every lane gets it), by the same butterfly as block_sum's first step.
__device__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Elements per 16-byte pack, and the packs a thread keeps in registers between a row's two passes (the launches give
// a thread about two packs; backward holds x and dy).
template <typename T>
constexpr int kPack = 16 / static_cast<int>(sizeof(T));
constexpr int kForwardCached = 4, kBackwardCached = 2;

// A block per row (blockIdx.x < 2^31): inv_rms[r] and y's row.
template <typename T, int V>
__global__ void rms_norm_forward_kernel(const T* x, const T* residual, T* sum, const T* weight, T* y, float* inv_rms,
                                        int cols, float eps, bool zero_centered) {
  const std::int64_t r = blockIdx.x;
  const int packs = cols / V;
  const T* residual_row = residual ? residual + r * cols : nullptr;
  T* sum_row = residual ? sum + r * cols : nullptr;
  RmsNormForwardShare<T, Element<T>, V, kForwardCached> share;
  const float inv = rms_inverse(
      block_sum(share.squares(x + r * cols, residual_row, sum_row, packs, threadIdx.x, blockDim.x)), cols, eps);
  if (threadIdx.x == 0) inv_rms[r] = inv;
  share.normalize(residual ? sum_row : x + r * cols, weight, y + r * cols, packs, threadIdx.x, blockDim.x, inv,
                  zero_centered);
}

// dx's rows, and the block's weight-gradient sums over its rows (blockIdx.x, + gridDim.x, ...) in its row of
// `partial`. They accumulate in shared memory when `shared_partials` (the launch gave it cols floats), else in that row
// itself; each thread owns its packs' columns, so none reads another's sums.
template <typename T, int V>
__global__ void rms_norm_backward_kernel(const T* dy, const T* x, const T* weight, const float* inv_rms,
                                         const T* residual_grad, T* dx, float* partial, std::int64_t rows, int cols,
                                         bool zero_centered, bool shared_partials) {
  extern __shared__ float shared_dw[];
  float* block_partial = partial + static_cast<std::int64_t>(blockIdx.x) * cols;
  float* dw = shared_partials ? shared_dw : block_partial;
  const int packs = cols / V, t = threadIdx.x, n = blockDim.x;
  for (int p = t; p < packs; p += n)
    for (int i = 0; i < V; ++i) dw[p * V + i] = 0;
  RmsNormBackwardShare<T, Element<T>, V, kBackwardCached> share;
  if (blockIdx.x < rows)
    share.read_ahead(x + blockIdx.x * std::int64_t{cols}, dy + blockIdx.x * std::int64_t{cols}, packs, t, n);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    share.advance();
    const std::int64_t next = r + gridDim.x;
    if (next < rows) share.read_ahead(x + next * cols, dy + next * cols, packs, t, n);
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    const float inv = inv_rms[r];
    const float mean =
        block_sum(share.dot(xr, dyr, weight, packs, t, n, inv, zero_centered)) / static_cast<float>(cols);
    share.gradients(xr, dyr, weight, residual_grad ? residual_grad + r * cols : nullptr, dx + r * cols, dw, packs, t, n,
                    inv, mean, zero_centered);
  }
  share.add_weight_sums(dw, packs, t, n);
  if (shared_partials)
    for (int p = t; p < packs; p += n)
      for (int i = 0; i < V; ++i) block_partial[p * V + i] = dw[p * V + i];
}

// A warp per row (row = blockIdx.x · kRowWarps + warp), L packs a lane: inv_rms[r] and y's row; no block-wide step.
template <typename T, int V, int L>
__global__ void rms_norm_forward_warp_kernel(const T* x, const T* residual, T* sum, const T* weight, T* y,
                                             float* inv_rms, std::int64_t rows, int cols, float eps,
                                             bool zero_centered) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarpLanes;
  if (r >= rows) return;  // the warp's lanes alike
  const int lane = threadIdx.x % kWarpLanes, packs = cols / V;
  const T* residual_row = residual ? residual + r * cols : nullptr;
  T* sum_row = residual ? sum + r * cols : nullptr;
  RmsNormForwardShare<T, Element<T>, V, L> share;
  const float inv =
      rms_inverse(warp_sum(share.squares(x + r * cols, residual_row, sum_row, packs, lane, kWarpLanes)), cols, eps);
  if (lane == 0) inv_rms[r] = inv;
  share.normalize(residual ? sum_row : x + r * cols, weight, y + r * cols, packs, lane, kWarpLanes, inv, zero_centered);
}

// dx's rows a warp each, L packs a lane, the warps of the grid taking rows warp, warp + all warps, ... (warp =
// blockIdx.x · kRowWarps + the block's warp); each lane sums the weight gradient of its packs' columns over its rows in
// registers, then the block's warps add theirs, one warp after another, into shared memory (cols floats), which
// becomes the block's row of `partial`.
template <typename T, int V, int L>
__global__ void rms_norm_backward_warp_kernel(const T* dy, const T* x, const T* weight, const float* inv_rms,
                                              const T* residual_grad, T* dx, float* partial, std::int64_t rows,
                                              int cols, bool zero_centered) {
  extern __shared__ float block_dw[];
  const int lane = threadIdx.x % kWarpLanes, warp = threadIdx.x / kWarpLanes, packs = cols / V;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) block_dw[c] = 0;
  RmsNormBackwardShare<T, Element<T>, V, L> share;
  const std::int64_t all_warps = static_cast<std::int64_t>(gridDim.x) * kRowWarps;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kRowWarps + warp; r < rows; r += all_warps) {
    const T* xr = x + r * cols;
    const T* dyr = dy + r * cols;
    share.read_ahead(xr, dyr, packs, lane, kWarpLanes);  // the row itself: every pack is cached
    share.advance();
    const float inv = inv_rms[r];
    const float mean =
        warp_sum(share.dot(xr, dyr, weight, packs, lane, kWarpLanes, inv, zero_centered)) / static_cast<float>(cols);
    share.gradients(xr, dyr, weight, residual_grad ? residual_grad + r * cols : nullptr, dx + r * cols, block_dw, packs,
                    lane, kWarpLanes, inv, mean, zero_centered);
  }
  for (int w = 0; w < kRowWarps; ++w) {
    __syncthreads();  // block_dw zeroed, or the warp before has added its sums
    if (warp == w) share.add_weight_sums(block_dw, packs, lane, kWarpLanes);
  }
  __syncthreads();
  float* block_partial = partial + static_cast<std::int64_t>(blockIdx.x) * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) block_partial[c] = block_dw[c];
}

// dweight[c] = Σ_b partial[b][c]: a block per 32 columns, its kSumRows rows of threads each summing every kSumRows-th
// block's row, then the rows' sums added in order.
constexpr int kSumRows = 32;
__global__ void sum_partials_kernel(const float* partial, float* dweight, std::int64_t blocks, std::int64_t cols) {
  __shared__ float sums[kSumRows][33];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float total = 0;
  if (c < cols)
    for (std::int64_t b = threadIdx.y; b < blocks; b += kSumRows) total += partial[b * cols + c];
  sums[threadIdx.y][threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  float all = 0;
  for (int y = 0; y < kSumRows; ++y) all += sums[y][threadIdx.x];
  dweight[c] = all;
}

// The packs of V elements a thread of the cross-entropy's gradient takes, blockDim.x apart: 16 elements of 16 bits or
// fp32; 4 single elements.
template <int V>
constexpr int kPacksPerThread = V >= 8 ? 2 : 4;

// Rows over the grid's y (grid-stride); a row's n / V packs over x, kGluPerThread a thread, blockDim.x apart.
constexpr int kGluPerThread = 4;

template <typename T, int V>
__global__ void glu_forward_kernel(Glu glu, const T* in, T* out, std::int64_t rows, int n) {
  const int first = static_cast<int>(blockIdx.x) * blockDim.x * kGluPerThread + threadIdx.x, packs = n / V;
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* gate = in + r * 2 * n;
#pragma unroll
    for (int j = 0; j < kGluPerThread; ++j) {
      const int p = first + j * static_cast<int>(blockDim.x);
      if (p >= packs) break;
      glu_forward_pack<T, Element<T>, V>(glu, gate, gate + n, out + r * n, p * V);
    }
  }
}

template <typename T, int V>
__global__ void glu_backward_kernel(Glu glu, const T* dy, const T* in, T* din, std::int64_t rows, int n) {
  const int first = static_cast<int>(blockIdx.x) * blockDim.x * kGluPerThread + threadIdx.x, packs = n / V;
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* gate = in + r * 2 * n;
    T* d_gate = din + r * 2 * n;
#pragma unroll
    for (int j = 0; j < kGluPerThread; ++j) {
      const int p = first + j * static_cast<int>(blockDim.x);
      if (p >= packs) break;
      glu_backward_pack<T, Element<T>, V>(glu, dy + r * n, gate, gate + n, d_gate, d_gate + n, p * V);
    }
  }
}

// Grid-stride over the numel / V packs.
template <typename T, int V>
__global__ void softcap_forward_kernel(const T* x, T* y, std::int64_t packs, float cap) {
  for (std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    softcap_forward_pack<T, Element<T>, V>(x, y, cap, p * V);
}

template <typename T, int V>
__global__ void softcap_backward_kernel(const T* dy, const T* y, T* dx, std::int64_t packs, float cap) {
  for (std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    softcap_backward_pack<T, Element<T>, V>(dy, y, dx, cap, p * V);
}

// The cross-entropy's passes over a chunk's logits [rows, cols] (cross_entropy_logit.h): a block per row (grid-stride)
// for the row's max and for its Σ exp(z − max) and target logit; the gradient over rows (grid y) and packs (x).
template <typename T, int V>
__global__ void cross_entropy_max_kernel(const T* logits, std::int64_t rows, int cols, float cap, float* max) {
  using P = Pack<T, V>;
  const int packs = cols / V;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const P* row = reinterpret_cast<const P*>(logits + r * cols);
    float m = -INFINITY;
    for (int p = threadIdx.x; p < packs; p += blockDim.x) {
      const P v = row[p];
#pragma unroll
      for (int i = 0; i < V; ++i) m = fmaxf(m, cross_entropy_logit(Element<T>::load(v.v[i]), cap));
    }
    m = block_max(m);
    if (threadIdx.x == 0) max[r] = m;
  }
}

template <typename T, int V>
__global__ void cross_entropy_sums_kernel(const T* logits, const std::int64_t* target, const bool* outside,
                                          const float* max, std::int64_t rows, int cols, float cap, float* sums) {
  using P = Pack<T, V>;
  const int packs = cols / V;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = logits + r * cols;
    const float m = max[r];
    float sum = 0;
    for (int p = threadIdx.x; p < packs; p += blockDim.x) {
      const P v = reinterpret_cast<const P*>(row)[p];
#pragma unroll
      for (int i = 0; i < V; ++i) sum += expf(cross_entropy_logit(Element<T>::load(v.v[i]), cap) - m);
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) {
      sums[r] = outside[r] ? 0.0f : cross_entropy_logit(Element<T>::load(row[target[r]]), cap) - m;
      sums[rows + r] = sum;
    }
  }
}

template <typename T, int V>
__global__ void cross_entropy_backward_kernel(const T* logits, const std::int64_t* target, const bool* outside,
                                              const float* lse, const float* grad_loss, std::int64_t rows, int cols,
                                              float cap, T* grad) {
  using P = Pack<T, V>;
  constexpr int K = kPacksPerThread<V>;
  const int packs = cols / V;
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float row_lse = lse[r], row_grad = grad_loss[r];
    const std::int64_t t = outside[r] ? -1 : target[r];
    const P* in = reinterpret_cast<const P*>(logits + r * cols);
    P* out = reinterpret_cast<P*>(grad + r * cols);
    // Every pack read before any is written: a write between two reads would hold the second back (the compiler
    // cannot tell that they touch different memory).
    const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x * K + threadIdx.x;
    P v[K];
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (first + j * blockDim.x < packs) v[j] = in[first + j * blockDim.x];
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const std::int64_t p = first + j * blockDim.x;
      if (p >= packs) break;
      P g;
#pragma unroll
      for (int i = 0; i < V; ++i)
        g.v[i] = Element<T>::store(
            cross_entropy_gradient(Element<T>::load(v[j].v[i]), row_lse, p * V + i == t, row_grad, cap));
      out[p] = g;
    }
  }
}

// x [rows, heads, head_dim] (heads where the layouts put them): a block per row (grid-stride), threads over (slot,
// head) of rope_slot.h.
template <typename T>
__global__ void rope_kernel(const T* x, RopeLayout x_layout, const float* cos, const float* sin, T* y,
                            RopeLayout y_layout, std::int64_t rows, int heads, int head_dim, int rot, bool interleaved,
                            bool transpose) {
  const int slots = rope_slots(head_dim);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* c = cos + r * rot;
    const float* s = sin + r * rot;
    for (int head = threadIdx.y; head < heads; head += blockDim.y) {
      const T* xh = x + x_layout.head(r, head, head_dim);
      T* yh = y + y_layout.head(r, head, head_dim);
      for (int p = threadIdx.x; p < slots; p += blockDim.x)
        rope_slot(
            p, head_dim, rot, interleaved, transpose, c, s, [xh](int d) { return Element<T>::load(xh[d]); },
            [yh](int d, float v) { yh[d] = Element<T>::store(v); });
    }
  }
}

// RoPE by packs (rope_pack of rope_slot.h) where the head's shape and the pointers allow: grid-stride over every
// (row, head, pack), the packs of a head on consecutive threads and a row's heads after them, so a warp shares the
// row's tables.
template <typename T, int V>
__global__ void rope_pack_kernel(const T* x, RopeLayout x_layout, const float* cos, const float* sin, T* y,
                                 RopeLayout y_layout, std::int64_t rows, int heads, int head_dim, int rot,
                                 bool interleaved, bool transpose) {
  const int packs = rope_packs(head_dim, rot, interleaved, V);
  const std::int64_t per_row = std::int64_t{heads} * packs, units = rows * per_row;
  for (std::int64_t u = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = u / per_row;
    const int within = static_cast<int>(u - r * per_row), head = within / packs, q = within - head * packs;
    rope_pack<T, Element<T>, V>(q, rot, interleaved, transpose, cos + r * rot, sin + r * rot,
                                x + x_layout.head(r, head, head_dim), y + y_layout.head(r, head, head_dim));
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

// Threads for a row of `packs` packs: about two packs each, a multiple of 32, at most 1024.
int row_threads(std::int64_t packs) {
  return static_cast<int>(std::clamp<std::int64_t>(((packs + 1) / 2 + 31) / 32 * 32, 32, 1024));
}

// The blocks of `threads` threads and `shared` bytes of `kernel` the current GPU runs at once (at least 1).
template <typename Kernel>
std::int64_t resident_blocks(Kernel kernel, int threads, std::size_t shared) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared) != cudaSuccess)
    return 512;
  return std::max<std::int64_t>(1, std::int64_t{sms} * per_sm);
}

// The most threads a block of `kernel` may have (its registers allow), a multiple of 32.
template <typename Kernel>
int max_threads(Kernel kernel) {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) return 1024;
  return std::max(32, attributes.maxThreadsPerBlock / 32 * 32);
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// f(std::integral_constant<int, V>) with V = kPack<T> when rows of `cols` elements at every pointer in `pointers`
// start 16-byte aligned (cols a multiple of the pack, each pointer aligned), else V = 1.
template <typename T, typename F>
void with_pack(std::int64_t cols, std::initializer_list<const void*> pointers, F f) {
  bool vectorised = cols % kPack<T> == 0;
  for (const void* p : pointers) vectorised = vectorised && aligned16(p);
  if (vectorised) f(std::integral_constant<int, kPack<T>>());
  else f(std::integral_constant<int, 1>());
}

unsigned row_blocks(std::int64_t rows) { return static_cast<unsigned>(std::min<std::int64_t>(rows, INT_MAX)); }

// Whether every head of `layout` starts a multiple of V elements from `base`, which is 16-byte aligned.
bool heads_aligned(const void* base, RopeLayout layout, std::int64_t head_dim, int V) {
  return aligned16(base) && layout.row % V == 0 && layout.group % V == 0 && head_dim % V == 0;
}

std::string rope(Dtype type, const void* x, RopeLayout x_layout, const float* cos, const float* sin, void* y,
                 RopeLayout y_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                 std::int64_t rot_dim, bool interleaved, bool transpose, void* stream) {
  if (heads > INT_MAX || head_dim > INT_MAX) return "more than 2^31 heads or elements in a head";
  if (rows == 0 || heads == 0 || head_dim == 0) return "";
  const int slots = rope_slots(static_cast<int>(head_dim));
  const int tx = std::min(slots, kThreads);
  const dim3 block(tx, static_cast<unsigned>(std::clamp<std::int64_t>(kThreads / tx, 1, heads)));
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int V = kPack<T>;
    if (rope_packs_fit(static_cast<int>(head_dim), static_cast<int>(rot_dim), interleaved, V) &&
        heads_aligned(x, x_layout, head_dim, V) && heads_aligned(y, y_layout, head_dim, V)) {
      const std::int64_t units =
          rows * heads * rope_packs(static_cast<int>(head_dim), static_cast<int>(rot_dim), interleaved, V);
      rope_pack_kernel<T, V><<<elementwise_blocks(units), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(x), x_layout, cos, sin, static_cast<T*>(y), y_layout, rows, static_cast<int>(heads),
          static_cast<int>(head_dim), static_cast<int>(rot_dim), interleaved, transpose);
      return;
    }
    rope_kernel<T><<<row_blocks(rows), block, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), x_layout, cos, sin, static_cast<T*>(y), y_layout, rows, static_cast<int>(heads),
        static_cast<int>(head_dim), static_cast<int>(rot_dim), interleaved, transpose);
  });
}

// The gated units' grid: rows over y (at most 65535, grid-stride), a row's packs over x.
dim3 glu_grid(std::int64_t rows, std::int64_t packs, int per_thread) {
  const std::int64_t per_block = std::int64_t{kThreads} * per_thread;
  return dim3(static_cast<unsigned>((packs + per_block - 1) / per_block),
              static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)));
}

// Whether RMSNorm takes a row a warp (lane_packs > 0: the row fits) or a block; `refused` says why a forced choice
// cannot be had.
bool rows_over_warps(RowsOver rows_over, int lane_packs, std::int64_t cols, std::string& refused) {
  if (rows_over == RowsOver::kBlocks) return false;
  if (lane_packs > 0) return true;
  if (rows_over == RowsOver::kWarps)
    refused = "a row of " + std::to_string(cols) + " elements does not fit a warp's registers";
  return false;
}

}  // namespace

std::int64_t partial_rows(std::int64_t rows) { return std::min<std::int64_t>(std::max<std::int64_t>(rows, 1), 1024); }

std::string rms_norm_forward(Dtype type, const void* x, const void* residual, void* sum, const void* weight, void* y,
                             float* inv_rms, std::int64_t rows, std::int64_t cols, float eps, bool zero_centered,
                             void* stream, RowsOver rows_over) {
  if (residual && !sum) return "a residual without the sum's output";
  if (rows > INT_MAX || cols > INT_MAX / 2) return "too many rows or columns for one launch";
  if (rows == 0) return "";
  std::string refused;
  const std::string error = typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto s = static_cast<cudaStream_t>(stream);
    const auto residual_in = static_cast<const T*>(residual);
    const auto sum_out = static_cast<T*>(sum);
    with_pack<T>(cols, {x, weight, y, residual, sum}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      const int lane_packs = rms_norm_lane_packs(static_cast<int>(cols / V));
      if (rows_over_warps(rows_over, lane_packs, cols, refused)) {
        with_lane_packs(lane_packs, [&](auto l) {
          constexpr int L = decltype(l)::value;
          rms_norm_forward_warp_kernel<T, V, L>
              <<<static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps), kRowWarps * kWarpLanes, 0, s>>>(
                  static_cast<const T*>(x), residual_in, sum_out, static_cast<const T*>(weight), static_cast<T*>(y),
                  inv_rms, rows, static_cast<int>(cols), eps, zero_centered);
        });
        return;
      }
      if (!refused.empty()) return;
      const auto kernel = rms_norm_forward_kernel<T, V>;
      kernel<<<static_cast<unsigned>(rows), std::min(row_threads(cols / V), max_threads(kernel)), 0, s>>>(
          static_cast<const T*>(x), residual_in, sum_out, static_cast<const T*>(weight), static_cast<T*>(y), inv_rms,
          static_cast<int>(cols), eps, zero_centered);
    });
  });
  return refused.empty() ? error : refused;
}

std::string rms_norm_backward(Dtype type, const void* dy, const void* x, const void* weight, const float* inv_rms,
                              const void* residual_grad, void* dx, float* dweight, float* partial, std::int64_t rows,
                              std::int64_t cols, bool zero_centered, void* stream, RowsOver rows_over) {
  if (cols > INT_MAX / 2) return "too many columns for one launch";
  if (cols == 0) return "";  // no element of dx or dweight to write (and no block for the weight gradient's sum)
  // Shared memory for the block's weight-gradient sums when a row of them fits in the 48 KiB any launch may ask for
  // (the warp-a-row kernel's rows always do).
  const std::size_t shared = static_cast<std::size_t>(cols) * sizeof(float);
  const bool shared_partials = shared <= 46 * 1024;
  std::int64_t blocks = 0;
  std::string refused;
  const std::string error = typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto s = static_cast<cudaStream_t>(stream);
    const auto residual = static_cast<const T*>(residual_grad);
    with_pack<T>(cols, {dy, x, weight, dx, residual_grad}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      const int lane_packs = rms_norm_lane_packs(static_cast<int>(cols / V));
      if (rows_over_warps(rows_over, lane_packs, cols, refused)) {
        with_lane_packs(lane_packs, [&](auto l) {
          constexpr int L = decltype(l)::value;
          const auto kernel = rms_norm_backward_warp_kernel<T, V, L>;
          // As many blocks as the GPU holds at once, each warp's rows one after another; at most a row a warp and
          // partial_rows(rows) blocks.
          blocks = std::min({partial_rows(rows), std::max<std::int64_t>(1, (rows + kRowWarps - 1) / kRowWarps),
                             resident_blocks(kernel, kRowWarps * kWarpLanes, shared)});
          kernel<<<static_cast<unsigned>(blocks), kRowWarps * kWarpLanes, shared, s>>>(
              static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(weight), inv_rms, residual,
              static_cast<T*>(dx), partial, rows, static_cast<int>(cols), zero_centered);
        });
        return;
      }
      if (!refused.empty()) return;
      const auto kernel = rms_norm_backward_kernel<T, V>;
      const int threads = std::min(row_threads(cols / V), max_threads(kernel));
      // As many blocks as the GPU holds at once (a block takes its rows one after another, so a row's loads wait on
      // the one before: the rows in flight are the blocks resident), at most partial_rows(rows).
      blocks = std::min(partial_rows(rows), resident_blocks(kernel, threads, shared_partials ? shared : 0));
      kernel<<<static_cast<unsigned>(blocks), threads, shared_partials ? shared : 0, s>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(weight), inv_rms, residual,
          static_cast<T*>(dx), partial, rows, static_cast<int>(cols), zero_centered, shared_partials);
    });
    if (refused.empty())
      sum_partials_kernel<<<static_cast<unsigned>((cols + 31) / 32), dim3(32, kSumRows), 0, s>>>(partial, dweight,
                                                                                                 blocks, cols);
  });
  return refused.empty() ? error : refused;
}

std::string glu_forward(Dtype type, Glu glu, const void* in, void* out, std::int64_t rows, std::int64_t n,
                        void* stream) {
  if (n > INT_MAX / 2) return "more than 2^30 columns";
  if (rows == 0 || n == 0) return "";
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_pack<T>(n, {in, out}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      glu_forward_kernel<T, V>
          <<<glu_grid(rows, n / V, kGluPerThread), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
              glu, static_cast<const T*>(in), static_cast<T*>(out), rows, static_cast<int>(n));
    });
  });
}

std::string glu_backward(Dtype type, Glu glu, const void* dy, const void* in, void* din, std::int64_t rows,
                         std::int64_t n, void* stream) {
  if (n > INT_MAX / 2) return "more than 2^30 columns";
  if (rows == 0 || n == 0) return "";
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_pack<T>(n, {dy, in, din}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      glu_backward_kernel<T, V>
          <<<glu_grid(rows, n / V, kGluPerThread), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
              glu, static_cast<const T*>(dy), static_cast<const T*>(in), static_cast<T*>(din), rows,
              static_cast<int>(n));
    });
  });
}

std::string softcap_forward(Dtype type, const void* x, void* y, std::int64_t numel, float cap, void* stream) {
  if (numel == 0) return "";
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_pack<T>(numel, {x, y}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      softcap_forward_kernel<T, V><<<elementwise_blocks(numel / V), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(x), static_cast<T*>(y), numel / V, cap);
    });
  });
}

std::string softcap_backward(Dtype type, const void* dy, const void* y, void* dx, std::int64_t numel, float cap,
                             void* stream) {
  if (numel == 0) return "";
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_pack<T>(numel, {dy, y, dx}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      softcap_backward_kernel<T, V><<<elementwise_blocks(numel / V), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<T*>(dx), numel / V, cap);
    });
  });
}

std::string cross_entropy_max(Dtype type, const void* logits, std::int64_t rows, std::int64_t cols, float cap,
                              float* max, void* stream) {
  if (cols > INT_MAX / 2) return "a row of more than 2^30 logits";
  if (rows == 0) return "";
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_pack<T>(cols, {logits}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      cross_entropy_max_kernel<T, V><<<row_blocks(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(logits), rows, static_cast<int>(cols), cap, max);
    });
  });
}

std::string cross_entropy_sums(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                               const float* max, std::int64_t rows, std::int64_t cols, float cap, float* sums,
                               void* stream) {
  if (cols > INT_MAX / 2) return "a row of more than 2^30 logits";
  if (rows == 0) return "";
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_pack<T>(cols, {logits}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      cross_entropy_sums_kernel<T, V><<<row_blocks(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(logits), target, outside, max, rows, static_cast<int>(cols), cap, sums);
    });
  });
}

std::string cross_entropy_backward(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                                   const float* lse, const float* grad_loss, std::int64_t rows, std::int64_t cols,
                                   float cap, void* grad, void* stream) {
  if (cols > INT_MAX / 2) return "a row of more than 2^30 logits";
  if (rows == 0 || cols == 0) return "";
  return typed(type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_pack<T>(cols, {logits, grad}, [&](auto pack) {
      constexpr int V = decltype(pack)::value;
      cross_entropy_backward_kernel<T, V>
          <<<glu_grid(rows, cols / V, kPacksPerThread<V>), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
              static_cast<const T*>(logits), target, outside, lse, grad_loss, rows, static_cast<int>(cols), cap,
              static_cast<T*>(grad));
    });
  });
}

std::string rope_forward(Dtype type, const void* x, RopeLayout x_layout, const float* cos, const float* sin, void* y,
                         RopeLayout y_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                         std::int64_t rot_dim, bool interleaved, void* stream) {
  return rope(type, x, x_layout, cos, sin, y, y_layout, rows, heads, head_dim, rot_dim, interleaved,
              /*transpose=*/false, stream);
}

std::string rope_backward(Dtype type, const void* dy, RopeLayout dy_layout, const float* cos, const float* sin,
                          void* dx, RopeLayout dx_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                          std::int64_t rot_dim, bool interleaved, void* stream) {
  return rope(type, dy, dy_layout, cos, sin, dx, dx_layout, rows, heads, head_dim, rot_dim, interleaved,
              /*transpose=*/true, stream);
}

}  // namespace trestle::kernels::cuda
