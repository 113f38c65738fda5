#include "train/model/fused_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu_table.h"
#include "kernels/kernel_dtype.h"

#if defined(TRESTLE_HAVE_CUDA) && defined(TRESTLE_HAVE_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/cuda_kernels.h"
#define TRESTLE_FUSED_CUDA 1
#endif

namespace trestle::train {
namespace {

namespace cpu = kernels::cpu;
#if defined(TRESTLE_FUSED_CUDA)
namespace cuda = kernels::cuda;
#endif

using kernels::cpu_table;
using kernels::RopeLayout;

cpu::Dtype dtype_of(const at::Tensor& t) { return kernels::dtype_of(t.scalar_type()); }

cpu::Glu glu_of(Glu glu) { return glu == Glu::kSwiGlu ? cpu::Glu::kSwiGlu : cpu::Glu::kGeGlu; }

#if defined(TRESTLE_FUSED_CUDA)
void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
void check_launch(const std::string& error, const char* kernel) {
  TORCH_CHECK(error.empty(), "the CUDA kernel ", kernel, " failed: ", error);
}
#endif

void check_device(const at::Tensor& t) {
  TORCH_CHECK(supports(t), "the fused kernels do not take ", t.scalar_type(), " tensors on ", t.device(),
              t.is_cuda() ? " (this build has no CUDA kernels)" : "");
}

}  // namespace

bool supports(const at::Tensor& t) {
  const auto type = t.scalar_type();
  if (type != at::kFloat && type != at::kBFloat16 && type != at::kHalf) return false;
  if (t.is_cpu()) return true;
#if defined(TRESTLE_FUSED_CUDA)
  return t.is_cuda();
#else
  return false;
#endif
}

std::string cpu_kernels_name() { return cpu_table().name; }

RmsNormForward rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered,
                                const at::Tensor& residual) {
  check_device(x);
  const std::int64_t cols = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols && weight.scalar_type() == x.scalar_type() &&
                  weight.device() == x.device(),
              "rms_norm: the weight must be [", cols, "] of x's dtype and device");
  TORCH_CHECK(!residual.defined() || (residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                                      residual.device() == x.device()),
              "rms_norm: the residual must be x's shape, dtype and device");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor rc = residual.defined() ? residual.contiguous() : at::Tensor();
  const std::int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
  RmsNormForward out{at::empty_like(xc), at::empty({rows}, xc.options().dtype(at::kFloat)),
                     rc.defined() ? at::empty_like(xc) : at::Tensor()};
  const void* residual_data = rc.defined() ? rc.data_ptr() : nullptr;
  void* sum_data = rc.defined() ? out.sum.data_ptr() : nullptr;
  if (rows == 0) return out;
  if (xc.is_cpu()) {
    cpu_table().rms_norm_forward(dtype_of(xc), xc.data_ptr(), residual_data, sum_data, wc.data_ptr(), out.y.data_ptr(),
                                 out.inv_rms.data_ptr<float>(), rows, cols, static_cast<float>(eps), zero_centered);
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(xc.device());  // launch on the tensor's GPU
    check_launch(cuda::rms_norm_forward(dtype_of(xc), xc.data_ptr(), residual_data, sum_data, wc.data_ptr(),
                                        out.y.data_ptr(), out.inv_rms.data_ptr<float>(), rows, cols,
                                        static_cast<float>(eps), zero_centered, stream_of(xc)),
                 "rms_norm_forward");
#endif
  }
  return out;
}

RmsNormBackward rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& inv_rms, bool zero_centered, const at::Tensor& residual_grad) {
  check_device(x);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "rms_norm: dy must be x's shape and dtype");
  TORCH_CHECK(!residual_grad.defined() ||
                  (residual_grad.sizes() == x.sizes() && residual_grad.scalar_type() == x.scalar_type() &&
                   residual_grad.device() == x.device()),
              "rms_norm: the residual's gradient must be x's shape, dtype and device");
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous(), wc = weight.contiguous();
  const at::Tensor residual = residual_grad.defined() ? residual_grad.contiguous() : at::Tensor();
  const void* residual_data = residual.defined() ? residual.data_ptr() : nullptr;
  const at::Tensor inv = inv_rms.contiguous();
  const std::int64_t cols = xc.size(-1), rows = cols == 0 ? 0 : xc.numel() / cols;
  TORCH_CHECK(inv.scalar_type() == at::kFloat && inv.numel() == rows, "rms_norm: inv_rms must be fp32 [", rows, "]");
  at::Tensor dx = at::empty_like(xc);
  at::Tensor dw = rows > 0 ? at::empty({cols}, xc.options().dtype(at::kFloat))  // every version overwrites it
                           : at::zeros({cols}, xc.options().dtype(at::kFloat));
  if (rows > 0) {
    if (xc.is_cpu()) {
      cpu_table().rms_norm_backward(dtype_of(xc), dyc.data_ptr(), xc.data_ptr(), wc.data_ptr(), inv.data_ptr<float>(),
                                    residual_data, dx.data_ptr(), dw.data_ptr<float>(), rows, cols, zero_centered);
    } else {
#if defined(TRESTLE_FUSED_CUDA)
      const c10::cuda::CUDAGuard guard(xc.device());  // launch on the tensor's GPU
      at::Tensor partial = at::empty({cuda::partial_rows(rows), cols}, xc.options().dtype(at::kFloat));
      check_launch(cuda::rms_norm_backward(dtype_of(xc), dyc.data_ptr(), xc.data_ptr(), wc.data_ptr(),
                                           inv.data_ptr<float>(), residual_data, dx.data_ptr(), dw.data_ptr<float>(),
                                           partial.data_ptr<float>(), rows, cols, zero_centered, stream_of(xc)),
                   "rms_norm_backward");
#endif
    }
  }
  return {dx, dw.to(weight.scalar_type())};
}

at::Tensor glu_forward(const at::Tensor& in, Glu glu) {
  check_device(in);
  TORCH_CHECK(in.dim() >= 1 && in.size(-1) % 2 == 0, "glu: the input's last dim must be [gate; up], even");
  const at::Tensor c = in.contiguous();
  const std::int64_t n = c.size(-1) / 2, rows = n == 0 ? 0 : c.numel() / (2 * n);
  std::vector<std::int64_t> shape(c.sizes().begin(), c.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, c.options());
  if (rows == 0) return out;
  if (c.is_cpu()) {
    cpu_table().glu_forward(dtype_of(c), glu_of(glu), c.data_ptr(), out.data_ptr(), rows, n);
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(c.device());  // launch on the tensor's GPU
    check_launch(cuda::glu_forward(dtype_of(c), glu_of(glu), c.data_ptr(), out.data_ptr(), rows, n, stream_of(c)),
                 "glu_forward");
#endif
  }
  return out;
}

at::Tensor glu_backward(const at::Tensor& dy, const at::Tensor& in, Glu glu) {
  check_device(in);
  const at::Tensor c = in.contiguous(), d = dy.contiguous();
  const std::int64_t n = c.size(-1) / 2, rows = n == 0 ? 0 : c.numel() / (2 * n);
  TORCH_CHECK(d.numel() == rows * n && d.scalar_type() == c.scalar_type(), "glu: dy must be the output's shape");
  at::Tensor din = at::empty_like(c);
  if (rows == 0) return din;
  if (c.is_cpu()) {
    cpu_table().glu_backward(dtype_of(c), glu_of(glu), d.data_ptr(), c.data_ptr(), din.data_ptr(), rows, n);
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(c.device());  // launch on the tensor's GPU
    check_launch(cuda::glu_backward(dtype_of(c), glu_of(glu), d.data_ptr(), c.data_ptr(), din.data_ptr(), rows, n,
                                    stream_of(c)),
                 "glu_backward");
#endif
  }
  return din;
}

at::Tensor softcap_forward(const at::Tensor& x, double cap) {
  check_device(x);
  TORCH_CHECK(cap > 0, "softcap: the cap must be positive");
  const at::Tensor c = x.contiguous();
  at::Tensor y = at::empty_like(c);
  if (c.numel() == 0) return y;
  if (c.is_cpu()) {
    cpu_table().softcap_forward(dtype_of(c), c.data_ptr(), y.data_ptr(), c.numel(), static_cast<float>(cap));
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(c.device());  // launch on the tensor's GPU
    check_launch(cuda::softcap_forward(dtype_of(c), c.data_ptr(), y.data_ptr(), c.numel(), static_cast<float>(cap),
                                       stream_of(c)),
                 "softcap_forward");
#endif
  }
  return y;
}

at::Tensor softcap_backward(const at::Tensor& dy, const at::Tensor& y, double cap) {
  check_device(y);
  const at::Tensor d = dy.contiguous(), yc = y.contiguous();
  TORCH_CHECK(d.sizes() == yc.sizes() && d.scalar_type() == yc.scalar_type(), "softcap: dy must be y's shape");
  at::Tensor dx = at::empty_like(yc);
  if (yc.numel() == 0) return dx;
  if (yc.is_cpu()) {
    cpu_table().softcap_backward(dtype_of(yc), d.data_ptr(), yc.data_ptr(), dx.data_ptr(), yc.numel(),
                                 static_cast<float>(cap));
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(yc.device());  // launch on the tensor's GPU
    check_launch(cuda::softcap_backward(dtype_of(yc), d.data_ptr(), yc.data_ptr(), dx.data_ptr(), yc.numel(),
                                        static_cast<float>(cap), stream_of(yc)),
                 "softcap_backward");
#endif
  }
  return dx;
}

namespace {

// The tables cos, sin for x's [seq, batch, ...] rows as fp32 [seq · batch, rot_dim], checked.
std::pair<at::Tensor, at::Tensor> rope_row_tables(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                                  std::int64_t head_dim) {
  const std::int64_t seq = x.size(0), batch = x.size(1);
  const bool tables_fit = cos.dim() == 4 && sin.sizes() == cos.sizes() && (cos.size(0) == seq || cos.size(0) == 1) &&
                          (cos.size(1) == batch || cos.size(1) == 1) && cos.size(2) == 1 && cos.size(3) % 2 == 0 &&
                          cos.size(3) <= head_dim && cos.device() == x.device() && sin.device() == x.device();
  TORCH_CHECK(tables_fit, "rope: cos and sin must be [", seq, ", ", batch, ", 1, rot_dim] (or broadcast to it) on ",
              x.device(), ", rot_dim even and at most head_dim ", head_dim, "; not ", cos.sizes(), " and ",
              sin.sizes());
  const std::int64_t rot = cos.size(3);
  auto table = [&](const at::Tensor& t) { return t.to(at::kFloat).expand({seq, batch, 1, rot}).contiguous(); };
  return {table(cos), table(sin)};
}

// RoPE (or its transpose) of `heads` heads of head_dim per row, over `rows` rows, from `x` (where x_layout puts the
// heads) to `y` (where y_layout does): `like` gives the dtype and device, c and s the rows' tables.
void rope_heads(const at::Tensor& like, const void* x, RopeLayout x_layout, void* y, RopeLayout y_layout,
                std::int64_t rows, std::int64_t heads, std::int64_t head_dim, const at::Tensor& c, const at::Tensor& s,
                bool interleaved, bool transpose) {
  if (rows == 0 || heads == 0 || head_dim == 0) return;
  const std::int64_t rot = c.size(-1);
  if (like.is_cpu()) {
    const cpu::Table& t = cpu_table();
    (transpose ? t.rope_backward : t.rope_forward)(dtype_of(like), x, x_layout, c.data_ptr<float>(),
                                                   s.data_ptr<float>(), y, y_layout, rows, heads, head_dim, rot,
                                                   interleaved);
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(like.device());  // launch on the tensor's GPU
    check_launch((transpose ? cuda::rope_backward : cuda::rope_forward)(
                     dtype_of(like), x, x_layout, c.data_ptr<float>(), s.data_ptr<float>(), y, y_layout, rows, heads,
                     head_dim, rot, interleaved, stream_of(like)),
                 transpose ? "rope_backward" : "rope_forward");
#endif
  }
}

// RoPE's forward, or its transpose (the backward), on x [seq, batch, heads, head_dim].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved, bool transpose) {
  check_device(x);
  TORCH_CHECK(x.dim() == 4, "rope: x must be [seq, batch, heads, head_dim], not ", x.sizes());
  const std::int64_t heads = x.size(2), head_dim = x.size(3);
  const auto [c, s] = rope_row_tables(x, cos, sin, head_dim);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const RopeLayout layout = RopeLayout::contiguous(heads, head_dim);
  rope_heads(xc, xc.data_ptr(), layout, y.data_ptr(), layout, x.size(0) * x.size(1), heads, head_dim, c, s, interleaved,
             transpose);
  return y;
}

// Where a group's query heads (part 0) or its key head (part 1) lie in a fused projection [seq, batch, groups,
// per_group
// + 2, head_dim] (each group's query heads, its key head, its value head), and the offset of the part's first head.
std::pair<RopeLayout, std::int64_t> qkv_part(const at::Tensor& qkv, int part) {
  const std::int64_t groups = qkv.size(2), slots = qkv.size(3), per_group = slots - 2, head_dim = qkv.size(4);
  const RopeLayout layout{groups * slots * head_dim, slots * head_dim, part == 0 ? per_group : 1};
  return {layout, part == 0 ? 0 : per_group * head_dim};
}

void* element_at(const at::Tensor& t, std::int64_t offset) {
  return static_cast<char*>(t.data_ptr()) + offset * static_cast<std::int64_t>(t.element_size());
}

}  // namespace

std::vector<at::Tensor> qkv_rope_forward(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                         bool interleaved) {
  check_device(qkv);
  TORCH_CHECK(qkv.dim() == 5 && qkv.size(3) >= 3,
              "qkv_rope: qkv must be [seq, batch, groups, queries per group + 2, head_dim], not ", qkv.sizes());
  const at::Tensor x = qkv.contiguous();
  const std::int64_t seq = x.size(0), batch = x.size(1), groups = x.size(2), per_group = x.size(3) - 2,
                     head_dim = x.size(4);
  const auto [c, s] = rope_row_tables(x, cos, sin, head_dim);
  at::Tensor q = at::empty({seq, batch, groups * per_group, head_dim}, x.options());
  at::Tensor k = at::empty({seq, batch, groups, head_dim}, x.options());
  for (int part = 0; part < 2; ++part) {
    const auto [layout, offset] = qkv_part(x, part);
    at::Tensor& out = part == 0 ? q : k;
    rope_heads(x, element_at(x, offset), layout, out.data_ptr(), RopeLayout::contiguous(out.size(2), head_dim),
               seq * batch, out.size(2), head_dim, c, s, interleaved, /*transpose=*/false);
  }
  return {q, k, x.select(3, per_group + 1).contiguous()};
}

at::Tensor qkv_rope_backward(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                             at::IntArrayRef qkv_sizes, const at::Tensor& cos, const at::Tensor& sin,
                             bool interleaved) {
  TORCH_CHECK(qkv_sizes.size() == 5 && qkv_sizes[3] >= 3,
              "qkv_rope: qkv must be [seq, batch, groups, queries per group "
              "+ 2, head_dim], not ",
              qkv_sizes);
  const at::Tensor& like = dq.defined() ? dq : dk.defined() ? dk : dv;
  TORCH_CHECK(like.defined(), "qkv_rope_backward: no gradient given");
  check_device(like);
  at::Tensor dqkv = at::empty(qkv_sizes, like.options());
  const std::int64_t per_group = qkv_sizes[3] - 2, head_dim = qkv_sizes[4];
  const auto [c, s] = rope_row_tables(dqkv, cos, sin, head_dim);
  for (int part = 0; part < 2; ++part) {
    const at::Tensor& grad = part == 0 ? dq : dk;
    const auto [layout, offset] = qkv_part(dqkv, part);
    if (!grad.defined()) {
      dqkv.narrow(3, part == 0 ? 0 : per_group, part == 0 ? per_group : 1).zero_();
      continue;
    }
    const std::int64_t heads = part == 0 ? dqkv.size(2) * per_group : dqkv.size(2);
    TORCH_CHECK(grad.dim() == 4 && grad.size(0) == dqkv.size(0) && grad.size(1) == dqkv.size(1) &&
                    grad.size(2) == heads && grad.size(3) == head_dim && grad.scalar_type() == dqkv.scalar_type(),
                "qkv_rope_backward: the ", part == 0 ? "queries'" : "keys'", " gradient must be [", dqkv.size(0), ", ",
                dqkv.size(1), ", ", heads, ", ", head_dim, "] of ", dqkv.scalar_type(), ", not ", grad.sizes());
    const at::Tensor g = grad.contiguous();
    rope_heads(dqkv, g.data_ptr(), RopeLayout::contiguous(heads, head_dim), element_at(dqkv, offset), layout,
               dqkv.size(0) * dqkv.size(1), heads, head_dim, c, s, interleaved, /*transpose=*/true);
  }
  if (dv.defined()) dqkv.select(3, per_group + 1).copy_(dv);
  else dqkv.select(3, per_group + 1).zero_();
  return dqkv;
}

at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  return rope(x, cos, sin, interleaved, /*transpose=*/false);
}

at::Tensor rope_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  return rope(dy, cos, sin, interleaved, /*transpose=*/true);
}

namespace {

// The checks the cross-entropy passes share: logits [rows, cols] of a fused dtype, target and outside [rows] (int64,
// bool) on the logits' device.
void check_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& outside) {
  check_device(logits);
  TORCH_CHECK(logits.dim() == 2, "cross_entropy: the logits must be [rows, cols]");
  TORCH_CHECK(target.scalar_type() == at::kLong && outside.scalar_type() == at::kBool &&
                  target.numel() == logits.size(0) && outside.numel() == logits.size(0) &&
                  target.device() == logits.device() && outside.device() == logits.device(),
              "cross_entropy: target (int64) and outside (bool) must be [", logits.size(0), "] on the logits' device");
}

at::Tensor float_rows(const at::Tensor& t, const at::Tensor& logits, const char* what) {
  TORCH_CHECK(t.numel() == logits.size(0) && t.device() == logits.device(), "cross_entropy: ", what, " must be [",
              logits.size(0), "] on the logits' device");
  return t.to(at::kFloat).contiguous();
}

// The CPU passes read each row's target column: it must be one of the row's where another rank does not hold it.
void check_targets(const at::Tensor& target, const at::Tensor& outside, std::int64_t cols) {
  if (!target.is_cpu()) return;  // the GPU's check would wait for the GPU; the model's targets come checked
  const at::Tensor bad = outside.logical_not() & ((target < 0) | (target >= cols));
  if (!bad.any().item<bool>()) return;
  const std::int64_t r = bad.nonzero()[0][0].item<std::int64_t>();
  TORCH_CHECK(false, "cross_entropy: target ", target[r].item<std::int64_t>(), " of row ", r, " outside the ", cols,
              " columns");
}

}  // namespace

at::Tensor cross_entropy_max(const at::Tensor& logits, double cap) {
  check_device(logits);
  TORCH_CHECK(logits.dim() == 2, "cross_entropy: the logits must be [rows, cols]");
  const at::Tensor l = logits.contiguous();
  const std::int64_t rows = l.size(0), cols = l.size(1);
  at::Tensor max = at::empty({rows}, l.options().dtype(at::kFloat));
  if (rows == 0) return max;
  if (l.is_cpu()) {
    cpu_table().cross_entropy_max(dtype_of(l), l.const_data_ptr(), rows, cols, static_cast<float>(cap),
                                  max.data_ptr<float>());
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(l.device());
    check_launch(cuda::cross_entropy_max(dtype_of(l), l.data_ptr(), rows, cols, static_cast<float>(cap),
                                         max.data_ptr<float>(), stream_of(l)),
                 "cross_entropy_max");
#endif
  }
  return max;
}

at::Tensor cross_entropy_sums(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& outside,
                              const at::Tensor& max, double cap) {
  check_cross_entropy(logits, target, outside);
  const at::Tensor l = logits.contiguous(), t = target.contiguous(), o = outside.contiguous();
  const at::Tensor m = float_rows(max, l, "max");
  const std::int64_t rows = l.size(0), cols = l.size(1);
  at::Tensor sums = at::empty({2, rows}, l.options().dtype(at::kFloat));
  if (rows == 0) return sums;
  if (l.is_cpu()) {
    check_targets(t, o, cols);
    cpu_table().cross_entropy_sums(dtype_of(l), l.const_data_ptr(), t.const_data_ptr<std::int64_t>(),
                                   o.const_data_ptr<bool>(), m.const_data_ptr<float>(), rows, cols,
                                   static_cast<float>(cap), sums.data_ptr<float>());
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(l.device());
    check_launch(cuda::cross_entropy_sums(dtype_of(l), l.data_ptr(), t.const_data_ptr<std::int64_t>(),
                                          o.const_data_ptr<bool>(), m.const_data_ptr<float>(), rows, cols,
                                          static_cast<float>(cap), sums.data_ptr<float>(), stream_of(l)),
                 "cross_entropy_sums");
#endif
  }
  return sums;
}

at::Tensor cross_entropy_grad(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& outside,
                              const at::Tensor& lse, const at::Tensor& grad_loss, double cap) {
  check_cross_entropy(logits, target, outside);
  const at::Tensor l = logits.contiguous(), t = target.contiguous(), o = outside.contiguous();
  const at::Tensor row_lse = float_rows(lse, l, "lse"), row_grad = float_rows(grad_loss, l, "grad_loss");
  const std::int64_t rows = l.size(0), cols = l.size(1);
  at::Tensor grad = at::empty_like(l);
  if (rows == 0 || cols == 0) return grad;
  if (l.is_cpu()) {
    check_targets(t, o, cols);
    cpu_table().cross_entropy_backward(dtype_of(l), l.const_data_ptr(), t.const_data_ptr<std::int64_t>(),
                                       o.const_data_ptr<bool>(), row_lse.const_data_ptr<float>(),
                                       row_grad.const_data_ptr<float>(), rows, cols, static_cast<float>(cap),
                                       grad.data_ptr());
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(l.device());
    check_launch(cuda::cross_entropy_backward(dtype_of(l), l.data_ptr(), t.const_data_ptr<std::int64_t>(),
                                              o.const_data_ptr<bool>(), row_lse.const_data_ptr<float>(),
                                              row_grad.const_data_ptr<float>(), rows, cols, static_cast<float>(cap),
                                              grad.data_ptr(), stream_of(l)),
                 "cross_entropy_backward");
#endif
  }
  return grad;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FusedRmsNorm : torch::autograd::Function<FusedRmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                            bool zero_centered) {
    RmsNormForward out = rms_norm_forward(x, weight, eps, zero_centered);
    ctx->save_for_backward({x, weight, out.inv_rms});
    ctx->saved_data["zero_centered"] = zero_centered;
    return out.y.view(x.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    RmsNormBackward g =
        rms_norm_backward(grad[0], saved[0], saved[1], saved[2], ctx->saved_data["zero_centered"].toBool());
    return {g.dx.view(saved[0].sizes()), g.dweight, at::Tensor(), at::Tensor()};
  }
};

// {h = x + delta, RMSNorm(h)} in one pass; backward: dx = ddelta = h's gradient from elsewhere + the norm's, in one
// pass.
struct FusedAddRmsNorm : torch::autograd::Function<FusedAddRmsNorm> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& delta,
                               const at::Tensor& weight, double eps, bool zero_centered) {
    RmsNormForward out = rms_norm_forward(x, weight, eps, zero_centered, delta);
    const at::Tensor h = out.sum.view(x.sizes());
    ctx->save_for_backward({h, weight, out.inv_rms});
    ctx->saved_data["zero_centered"] = zero_centered;
    return {h, out.y.view(x.sizes())};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor dx;
    at::Tensor dweight;
    if (grad[1].defined()) {
      RmsNormBackward g =
          rms_norm_backward(grad[1], saved[0], saved[1], saved[2], ctx->saved_data["zero_centered"].toBool(), grad[0]);
      dx = g.dx.view(saved[0].sizes());
      dweight = g.dweight;
    } else {
      dx = grad[0];  // the norm's output took no part in the loss
    }
    return {dx, dx, dweight, at::Tensor(), at::Tensor()};
  }
};

struct FusedGlu : torch::autograd::Function<FusedGlu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& in, std::int64_t glu) {
    ctx->save_for_backward({in});
    ctx->saved_data["glu"] = glu;
    return glu_forward(in, static_cast<Glu>(glu));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor in = ctx->get_saved_variables()[0];
    return {glu_backward(grad[0], in, static_cast<Glu>(ctx->saved_data["glu"].toInt())).view(in.sizes()),
            at::Tensor()};
  }
};

struct FusedSoftcap : torch::autograd::Function<FusedSoftcap> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double cap) {
    at::Tensor y = softcap_forward(x, cap).view(x.sizes());
    ctx->save_for_backward({y});
    ctx->saved_data["cap"] = cap;
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor y = ctx->get_saved_variables()[0];
    return {softcap_backward(grad[0], y, ctx->saved_data["cap"].toDouble()).view(y.sizes()), at::Tensor()};
  }
};

struct FusedRope : torch::autograd::Function<FusedRope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            bool interleaved) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    return rope_forward(x, cos, sin, interleaved);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    return {rope_backward(grad[0], saved[0], saved[1], ctx->saved_data["interleaved"].toBool()), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

struct FusedQkvRope : torch::autograd::Function<FusedQkvRope> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qkv, const at::Tensor& cos,
                               const at::Tensor& sin, bool interleaved) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["sizes"] = qkv.sizes().vec();
    return qkv_rope_forward(qkv, cos, sin, interleaved);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const std::vector<std::int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    return {qkv_rope_backward(grad[0], grad[1], grad[2], sizes, saved[0], saved[1],
                              ctx->saved_data["interleaved"].toBool()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered) {
  return FusedRmsNorm::apply(x, weight, eps, zero_centered);
}

std::vector<at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                           double eps, bool zero_centered) {
  return FusedAddRmsNorm::apply(x, delta, weight, eps, zero_centered);
}

at::Tensor fused_glu(const at::Tensor& in, Glu glu) {
  return FusedGlu::apply(in, static_cast<std::int64_t>(glu));
}

at::Tensor fused_softcap(const at::Tensor& x, double cap) { return FusedSoftcap::apply(x, cap); }

std::vector<at::Tensor> fused_qkv_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                       bool interleaved) {
  TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(),
              "fused_qkv_rope: the cos and sin tables are constants here (no gradient flows to them)");
  return FusedQkvRope::apply(qkv, cos, sin, interleaved);
}

at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(),
              "fused_rope: the cos and sin tables are constants here (no gradient flows to them); detach them or use "
              "the composite apply_rope");
  return FusedRope::apply(x, cos, sin, interleaved);
}

}  // namespace trestle::train
