// The fused kernels of kernels/ on at::Tensor: RMSNorm (plain and Gemma's (1 + w) form), the gated MLP units SwiGLU
// and GeGLU, soft-capping and rotary position embedding, each forward and backward with fp32 arithmetic on float,
// bfloat16 or half tensors. CPU tensors run the vectorised, threaded CPU build of the instruction set ATen chose for
// this CPU; CUDA tensors the CUDA kernels when Trestle was built with them. The fused_* functions plug into autograd
// and compute what the model's composites compute (transformer_layer.h, rope.h); supports() says when they apply.
#pragma once

#include <ATen/Tensor.h>

#include <string>
#include <vector>

namespace trestle::train {

enum class Glu { kSwiGlu, kGeGlu };

// Whether the fused kernels take tensors of this dtype on this device (float / bfloat16 / half; CPU, or CUDA in a
// CUDA build).
bool supports(const at::Tensor& t);
// The CPU instruction set the CPU versions run with ("avx512", "avx2", "default").
std::string cpu_kernels_name();

// RMSNorm over the last dim: x [..., cols], weight [cols] of x's dtype. Returns y (x's dtype) and inv_rms [rows] fp32.
// With residual (x's shape and dtype), the residual stream's step before the norm: the rows normed are h = x + residual
// (x's dtype), returned as `sum` (its forward in the same pass: no separate addition reading h back).
struct RmsNormForward {
  at::Tensor y, inv_rms, sum;
};
RmsNormForward rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered,
                                const at::Tensor& residual = {});
struct RmsNormBackward {
  at::Tensor dx, dweight;  // dweight: the weight's dtype (summed in fp32)
};
// With residual_grad (x's shape and dtype), the gradient x also has from the residual stream, dx is the sum of the
// two, rounded once: autograd's separate addition of the two gradients (3 passes over x's size) is left out.
RmsNormBackward rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& inv_rms, bool zero_centered, const at::Tensor& residual_grad = {});
// fc1 output [..., 2n] = [gate; up] -> [..., n], and back.
at::Tensor glu_forward(const at::Tensor& in, Glu glu);
at::Tensor glu_backward(const at::Tensor& dy, const at::Tensor& in, Glu glu);
// cap · tanh(x / cap), and its backward from the output.
at::Tensor softcap_forward(const at::Tensor& x, double cap);
at::Tensor softcap_backward(const at::Tensor& dy, const at::Tensor& y, double cap);
// RoPE on x [seq, batch, heads, head_dim] with fp32 tables cos, sin [seq, batch, 1, rot_dim] as rope_tables makes them
// (any shape that broadcasts to it over seq and batch), rot_dim even and at most head_dim: the first rot_dim dims
// rotated (rotate_half, or with `interleaved` the pairs (x0, x1), (x2, x3), ... by the tables' first half), the rest
// copied; y in x's dtype. The backward is the forward's transpose: dy -> dx.
at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);
at::Tensor rope_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);
// The same on Megatron's fused projection qkv [seq, batch, groups, per_group + 2, head_dim] (each group's query heads,
// its key head, its value head), its heads read where they lie: {the rotated queries [seq, batch, groups · per_group,
// head_dim], the rotated keys [seq, batch, groups, head_dim], the values [seq, batch, groups, head_dim]}; and back, the
// three gradients (an undefined one: zeros) written into one of qkv's sizes, with no concatenation.
std::vector<at::Tensor> qkv_rope_forward(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                         bool interleaved);
at::Tensor qkv_rope_backward(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                             at::IntArrayRef qkv_sizes, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);

// The vocabulary-parallel cross-entropy's passes over a chunk of the output layer's logits [rows, cols] (its dtype),
// soft-capped inside as z = cap · tanh(l / cap) when cap > 0 (chunked_cross_entropy.h runs them): the rows' largest z
// (fp32 [rows]); with the all-reduced maxima, [2, rows] fp32 of the target's z − max (0 where `outside`: the target is
// another rank's) and Σ exp(z − max); and the logits' gradient (their dtype) (exp(z − lse) − [target]) · grad_loss ·
// (1 − tanh²(l / cap)). target: int64 [rows], the target's column; outside: bool [rows]. On the CPU the vectorised
// builds (kernels/cpu/cpu_kernels.h), which refuse a target outside the row's columns, naming it.
at::Tensor cross_entropy_max(const at::Tensor& logits, double cap);
at::Tensor cross_entropy_sums(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& outside,
                              const at::Tensor& max, double cap);
at::Tensor cross_entropy_grad(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& outside,
                              const at::Tensor& lse, const at::Tensor& grad_loss, double cap);

// The same through autograd.
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered);
// A residual stream's step and the norm after it: {h = x + delta, RMSNorm(h)}, x and delta of one shape and dtype.
// Its backward takes h's gradient from the stream's continuation into the norm's backward (residual_grad above).
std::vector<at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                           double eps, bool zero_centered);
at::Tensor fused_glu(const at::Tensor& in, Glu glu);
at::Tensor fused_softcap(const at::Tensor& x, double cap);
// The tables are constants: refused when they require grad.
at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved = false);
std::vector<at::Tensor> fused_qkv_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                       bool interleaved = false);

}  // namespace trestle::train
