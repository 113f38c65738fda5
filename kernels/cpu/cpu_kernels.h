// The CPU versions of the fused kernels, vectorised with ATen's Vectorized<float> and threaded with at::parallel_for.
// cpu_kernels.cc is compiled once per instruction set (AVX-512, AVX2, and a portable build), each into a table of its
// own; kernels/cpu_table.h picks the table of the capability ATen chose for this CPU (ATEN_CPU_CAPABILITY honoured).
// Tensors are row-major and contiguous; the element type is one of float, bfloat16, half; arithmetic is fp32. The
// cast-and-pack kernel (pack_source.h) is the exception: strided sources of any dtype.
#pragma once

#include <cstdint>

#include "kernels/cpu/pack_source.h"
#include "kernels/cpu/rope_layout.h"

namespace trestle::kernels::cpu {

using kernels::RopeLayout;

enum class Dtype { kFloat, kBFloat16, kHalf };
// The gated units of an MLP whose fc1 output is [gate; up]: silu(gate) · up, or gelu_tanh(gate) · up.
enum class Glu { kSwiGlu, kGeGlu };

struct Table {
  const char* name;  // "avx512", "avx2" or "default"
  // y = n · w with n = x / rms(x) rounded to the element type (or (x / rms(x)) · (1 + w) when zero_centered);
  // inv_rms[r] = 1 / sqrt(mean(x[r]²) + eps) in fp32. With residual (x's shape; nullptr: none), the residual stream's
  // step before the norm: the rows normed are h = x + residual rounded to the element type, written to `sum`.
  void (*rms_norm_forward)(Dtype type, const void* x, const void* residual, void* sum, const void* weight, void* y,
                           float* inv_rms, std::int64_t rows, std::int64_t cols, float eps, bool zero_centered);
  // dx (element type) and dweight (fp32 [cols], overwritten) from dy, x, weight and the forward's inv_rms. With
  // residual_grad (x's shape; nullptr: none), the gradient x has from elsewhere (the residual stream that x also
  // continues), dx is their sum, rounded once.
  void (*rms_norm_backward)(Dtype type, const void* dy, const void* x, const void* weight, const float* inv_rms,
                            const void* residual_grad, void* dx, float* dweight, std::int64_t rows, std::int64_t cols,
                            bool zero_centered);
  // in [rows, 2n] = [gate; up] per row -> out [rows, n].
  void (*glu_forward)(Dtype type, Glu glu, const void* in, void* out, std::int64_t rows, std::int64_t n);
  // dy [rows, n], in [rows, 2n] -> din [rows, 2n].
  void (*glu_backward)(Dtype type, Glu glu, const void* dy, const void* in, void* din, std::int64_t rows,
                       std::int64_t n);
  // y = cap · tanh(x / cap), and its backward from the output: dx = dy · (1 - (y / cap)²).
  void (*softcap_forward)(Dtype type, const void* x, void* y, std::int64_t numel, float cap);
  void (*softcap_backward)(Dtype type, const void* dy, const void* y, void* dx, std::int64_t numel, float cap);
  // The vocabulary-parallel cross-entropy's passes over a chunk of logits [rows, cols] (element type; read as fp32,
  // z = cap · tanh(l / cap) when cap > 0, else l), as the CUDA kernels (cross_entropy_logit.h): max[r] = the
  // row's largest z; sums [2, rows]: the target's z − max[r] (0 where outside[r]: another rank holds the target) and
  // Σ exp(z − max[r]); grad (element type) = (exp(z − lse[r]) − [c is the target]) · grad_loss[r] · (1 − tanh²(l /
  // cap) when capped). target[r] lies in [0, cols) where !outside[r] (the caller checks).
  void (*cross_entropy_max)(Dtype type, const void* logits, std::int64_t rows, std::int64_t cols, float cap,
                            float* max);
  void (*cross_entropy_sums)(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                             const float* max, std::int64_t rows, std::int64_t cols, float cap, float* sums);
  void (*cross_entropy_backward)(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                                 const float* lse, const float* grad_loss, std::int64_t rows, std::int64_t cols,
                                 float cap, void* grad);
  // RoPE on x [rows, heads, head_dim] (a row: one token of one sequence; its heads where x_layout puts them, into
  // y's where y_layout does: kernels/cpu/rope_layout.h) with fp32 tables cos, sin [rows, rot_dim] shared by the row's
  // heads, rot_dim even and at most head_dim: y = x·cos + rotate_half(x)·sin on the first rot_dim dims, the rest
  // copied. Interleaved: the pairs (x0, x1), (x2, x3), ... rotated by the tables' first half,
  // y[2i] = x[2i]·cos[i] - x[2i+1]·sin[i], y[2i+1] = x[2i+1]·cos[i] + x[2i]·sin[i].
  void (*rope_forward)(Dtype type, const void* x, RopeLayout x_layout, const float* cos, const float* sin, void* y,
                       RopeLayout y_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                       std::int64_t rot_dim, bool interleaved);
  // dx from dy: the forward's transpose (as a linear map of x), dx[i] = dy[i]·cos[i] + dy[i+h]·sin[i+h],
  // dx[i+h] = dy[i+h]·cos[i+h] - dy[i]·sin[i] with h = rot_dim / 2 (interleaved: the pairs' transposes).
  void (*rope_backward)(Dtype type, const void* dy, RopeLayout dy_layout, const float* cos, const float* sin, void* dx,
                        RopeLayout dx_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                        std::int64_t rot_dim, bool interleaved);
  // Every source of the list packed at its destination (pack_source.h), the list's elements shared over at most
  // `threads` threads (0: ATen's number) with at::parallel_for.
  void (*cast_pack)(const PackSource* sources, std::int64_t count, int threads);
  // Σ x² over numel elements in double, as the gradient clipping's norm takes it: each square exact (an fp32 value's
  // square fits a double), the sum in blocks of kSquaresBlock elements, a block's 16 lanes (lane j the elements at
  // j mod 16) added pairwise, the blocks' sums in order. The same bits in every build and on any number of threads.
  double (*sum_of_squares)(Dtype type, const void* x, std::int64_t numel);
};
inline constexpr std::int64_t kSquaresBlock = std::int64_t{1} << 16;
inline constexpr int kSquaresLanes = 16;

const Table& table_default();
#if defined(TRESTLE_KERNELS_AVX2)
const Table& table_avx2();
#endif
#if defined(TRESTLE_KERNELS_AVX512)
const Table& table_avx512();
#endif

}  // namespace trestle::kernels::cpu
