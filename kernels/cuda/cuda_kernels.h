// The CUDA versions of the fused kernels (cuda_kernels.cu), on device pointers, launched on `stream` (a
// cudaStream_t). Same contracts as the CPU table (kernels/cpu/cpu_kernels.h): row-major contiguous tensors of float,
// bfloat16 or half, fp32 arithmetic; dweight is fp32 [cols], overwritten. Errors of the launch come back as a message
// (empty: launched).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cpu/cpu_kernels.h"

namespace trestle::kernels::cuda {

using cpu::Dtype;
using cpu::Glu;
using kernels::RopeLayout;

// Which RMSNorm kernels take the rows: kAuto, a warp a row where a row fits a warp's registers (rms_norm_share.h's
// rms_norm_lane_packs: up to 256 packs of 16 bytes, 2048 bf16 / 1024 fp32), else a block a row; kWarps and kBlocks
// force one (kWarps refused, as an error, for a row that does not fit), for the tests and bench kernels.
enum class RowsOver { kAuto, kWarps, kBlocks };

// With residual (nullable), the row normed is x + residual rounded to the element type, written to `sum`.
std::string rms_norm_forward(Dtype type, const void* x, const void* residual, void* sum, const void* weight, void* y,
                             float* inv_rms, std::int64_t rows, std::int64_t cols, float eps, bool zero_centered,
                             void* stream, RowsOver rows_over = RowsOver::kAuto);
// `partial` is fp32 scratch of partial_rows(rows) × cols floats (a row per block: as many as the GPU holds at once, up
// to that bound). residual_grad (nullable) is added into dx as the CPU table's.
std::string rms_norm_backward(Dtype type, const void* dy, const void* x, const void* weight, const float* inv_rms,
                              const void* residual_grad, void* dx, float* dweight, float* partial, std::int64_t rows,
                              std::int64_t cols, bool zero_centered, void* stream,
                              RowsOver rows_over = RowsOver::kAuto);
std::int64_t partial_rows(std::int64_t rows);
std::string glu_forward(Dtype type, Glu glu, const void* in, void* out, std::int64_t rows, std::int64_t n,
                        void* stream);
std::string glu_backward(Dtype type, Glu glu, const void* dy, const void* in, void* din, std::int64_t rows,
                         std::int64_t n, void* stream);
std::string softcap_forward(Dtype type, const void* x, void* y, std::int64_t numel, float cap, void* stream);
std::string softcap_backward(Dtype type, const void* dy, const void* y, void* dx, std::int64_t numel, float cap,
                             void* stream);
// x [rows, heads, head_dim] where x_layout puts its heads (y's where y_layout does), fp32 tables cos, sin [rows,
// rot_dim] (CPU table's rope_forward / rope_backward).
std::string rope_forward(Dtype type, const void* x, RopeLayout x_layout, const float* cos, const float* sin, void* y,
                         RopeLayout y_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                         std::int64_t rot_dim, bool interleaved, void* stream);
std::string rope_backward(Dtype type, const void* dy, RopeLayout dy_layout, const float* cos, const float* sin,
                          void* dx, RopeLayout dx_layout, std::int64_t rows, std::int64_t heads, std::int64_t head_dim,
                          std::int64_t rot_dim, bool interleaved, void* stream);

// The vocabulary-parallel cross-entropy's passes over a chunk's logits [rows, cols] (the output layer's dtype; soft-
// capped as z = cap · tanh(l / cap) when cap > 0, cross_entropy_logit.h), with target [rows] (int64, the target's
// column; ignored where outside[rows] is true: the target lies in another rank's vocabulary). max [rows] fp32: the
// row's largest z. sums [2, rows] fp32: the target's z − max (0 outside), Σ exp(z − max) with max the (all-reduced)
// row maxima given. grad [rows, cols] (the logits' dtype): (exp(z − lse) − [target]) · grad_loss · (1 − tanh²(l /
// cap)).
std::string cross_entropy_max(Dtype type, const void* logits, std::int64_t rows, std::int64_t cols, float cap,
                              float* max, void* stream);
std::string cross_entropy_sums(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                               const float* max, std::int64_t rows, std::int64_t cols, float cap, float* sums,
                               void* stream);
std::string cross_entropy_backward(Dtype type, const void* logits, const std::int64_t* target, const bool* outside,
                                   const float* lse, const float* grad_loss, std::int64_t rows, std::int64_t cols,
                                   float cap, void* grad, void* stream);

// Cast-and-pack (kernels/cpu/pack_source.h) of the whole list in one launch (cast_pack.cu), sources' `data` on the
// device. Design: the kernel writes every destination itself, wherever it lies: in device memory, or in pinned host
// memory mapped into the device's address space (cudaHostAlloc's, which LibTorch's pinned host allocator hands out:
// with unified addressing the device writes it at device_address(host pointer)). A device-to-host staging copy is then
// this one kernel, its stores crossing the bus as the elements are cast and packed: no device buffer of the staged
// size (training may hold the device's memory to the last byte), no second copy, and the bytes cross once, in the
// stored (often narrower) dtype. The descriptors travel to `scratch` (device memory of cast_pack_scratch_bytes(count))
// in one copy on `stream` ahead of the kernel; the caller waits for the stream before reading the destinations.
std::size_t cast_pack_scratch_bytes(std::int64_t count);
std::string cast_pack(const cpu::PackSource* sources, std::int64_t count, void* scratch, void* stream);
// The address at which the current device reaches `pointer`: itself for device memory, its mapped address for pinned
// host memory; nullptr where the device cannot write it (pageable host memory).
void* device_address(void* pointer);

}  // namespace trestle::kernels::cuda
