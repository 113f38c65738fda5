#include "train/model/fused_kernels.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu_table.h"

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

cpu::Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return cpu::Dtype::kFloat;
    case at::kBFloat16:
      return cpu::Dtype::kBFloat16;
    case at::kHalf:
      return cpu::Dtype::kHalf;
    default:
      TORCH_CHECK(false, "the fused kernels take float, bfloat16 or half tensors, not ", t.scalar_type());
  }
}

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

RmsNormForward rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered) {
  check_device(x);
  const std::int64_t cols = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols && weight.scalar_type() == x.scalar_type() &&
                  weight.device() == x.device(),
              "rms_norm: the weight must be [", cols, "] of x's dtype and device");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const std::int64_t rows = cols == 0 ? 0 : xc.numel() / cols;
  RmsNormForward out{at::empty_like(xc), at::empty({rows}, xc.options().dtype(at::kFloat))};
  if (rows == 0) return out;
  if (xc.is_cpu()) {
    cpu_table().rms_norm_forward(dtype_of(xc), xc.data_ptr(), wc.data_ptr(), out.y.data_ptr(),
                                 out.inv_rms.data_ptr<float>(), rows, cols, static_cast<float>(eps), zero_centered);
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(xc.device());  // launch on the tensor's GPU
    check_launch(cuda::rms_norm_forward(dtype_of(xc), xc.data_ptr(), wc.data_ptr(), out.y.data_ptr(),
                                        out.inv_rms.data_ptr<float>(), rows, cols, static_cast<float>(eps),
                                        zero_centered, stream_of(xc)),
                 "rms_norm_forward");
#endif
  }
  return out;
}

RmsNormBackward rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& inv_rms, bool zero_centered) {
  check_device(x);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "rms_norm: dy must be x's shape and dtype");
  const at::Tensor xc = x.contiguous(), dyc = dy.contiguous(), wc = weight.contiguous();
  const at::Tensor inv = inv_rms.contiguous();
  const std::int64_t cols = xc.size(-1), rows = cols == 0 ? 0 : xc.numel() / cols;
  TORCH_CHECK(inv.scalar_type() == at::kFloat && inv.numel() == rows, "rms_norm: inv_rms must be fp32 [", rows, "]");
  at::Tensor dx = at::empty_like(xc);
  at::Tensor dw = at::zeros({cols}, xc.options().dtype(at::kFloat));
  if (rows > 0) {
    if (xc.is_cpu()) {
      cpu_table().rms_norm_backward(dtype_of(xc), dyc.data_ptr(), xc.data_ptr(), wc.data_ptr(), inv.data_ptr<float>(),
                                    dx.data_ptr(), dw.data_ptr<float>(), rows, cols, zero_centered);
    } else {
#if defined(TRESTLE_FUSED_CUDA)
      const c10::cuda::CUDAGuard guard(xc.device());  // launch on the tensor's GPU
      at::Tensor partial = at::empty({cuda::partial_rows(rows), cols}, xc.options().dtype(at::kFloat));
      check_launch(cuda::rms_norm_backward(dtype_of(xc), dyc.data_ptr(), xc.data_ptr(), wc.data_ptr(),
                                           inv.data_ptr<float>(), dx.data_ptr(), dw.data_ptr<float>(),
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

// RoPE's forward, or its transpose (the backward), on x [seq, batch, heads, head_dim].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved, bool transpose) {
  check_device(x);
  TORCH_CHECK(x.dim() == 4, "rope: x must be [seq, batch, heads, head_dim], not ", x.sizes());
  const std::int64_t seq = x.size(0), batch = x.size(1), heads = x.size(2), head_dim = x.size(3);
  const bool tables_fit = cos.dim() == 4 && sin.sizes() == cos.sizes() && (cos.size(0) == seq || cos.size(0) == 1) &&
                          (cos.size(1) == batch || cos.size(1) == 1) && cos.size(2) == 1 && cos.size(3) % 2 == 0 &&
                          cos.size(3) <= head_dim && cos.device() == x.device() && sin.device() == x.device();
  TORCH_CHECK(tables_fit, "rope: cos and sin must be [", seq, ", ", batch, ", 1, rot_dim] (or broadcast to it) on ",
              x.device(), ", rot_dim even and at most head_dim ", head_dim, "; not ", cos.sizes(), " and ",
              sin.sizes());
  const std::int64_t rot = cos.size(3);
  auto table = [&](const at::Tensor& t) { return t.to(at::kFloat).expand({seq, batch, 1, rot}).contiguous(); };
  const at::Tensor xc = x.contiguous(), c = table(cos), s = table(sin);
  at::Tensor y = at::empty_like(xc);
  if (xc.numel() == 0) return y;
  if (xc.is_cpu()) {
    const cpu::Table& t = cpu_table();
    (transpose ? t.rope_backward : t.rope_forward)(dtype_of(xc), xc.data_ptr(), c.data_ptr<float>(),
                                                   s.data_ptr<float>(), y.data_ptr(), seq * batch, heads, head_dim, rot,
                                                   interleaved);
  } else {
#if defined(TRESTLE_FUSED_CUDA)
    const c10::cuda::CUDAGuard guard(xc.device());  // launch on the tensor's GPU
    check_launch((transpose ? cuda::rope_backward : cuda::rope_forward)(
                     dtype_of(xc), xc.data_ptr(), c.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr(), seq * batch,
                     heads, head_dim, rot, interleaved, stream_of(xc)),
                 transpose ? "rope_backward" : "rope_forward");
#endif
  }
  return y;
}

}  // namespace

at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  return rope(x, cos, sin, interleaved, /*transpose=*/false);
}

at::Tensor rope_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  return rope(dy, cos, sin, interleaved, /*transpose=*/true);
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

}  // namespace

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered) {
  return FusedRmsNorm::apply(x, weight, eps, zero_centered);
}

at::Tensor fused_glu(const at::Tensor& in, Glu glu) {
  return FusedGlu::apply(in, static_cast<std::int64_t>(glu));
}

at::Tensor fused_softcap(const at::Tensor& x, double cap) { return FusedSoftcap::apply(x, cap); }

at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(),
              "fused_rope: the cos and sin tables are constants here (no gradient flows to them); detach them or use "
              "the composite apply_rope");
  return FusedRope::apply(x, cos, sin, interleaved);
}

}  // namespace trestle::train
