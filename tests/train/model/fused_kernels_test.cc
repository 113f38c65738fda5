// The fused kernels as the model calls them (train/model/fused_kernels.h): through autograd against the plain
// reference, on non-contiguous inputs, in every dtype; the CPU build chosen; what they refuse, naming it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <string>

#include "kernels/reference.h"
#include "train/model/fused_kernels.h"

namespace trestle::train {
namespace {

double tolerance(at::ScalarType t) { return t == at::kFloat ? 2e-6 : t == at::kHalf ? 2e-3 : 1.6e-2; }

void expect_close(const at::Tensor& got, const at::Tensor& expected, at::ScalarType type, const std::string& what) {
  ASSERT_EQ(got.sizes(), expected.sizes()) << what;
  const at::Tensor a = got.to(at::kDouble), b = expected.to(at::kDouble);
  const double scale = b.abs().max().item<double>() + 1e-12;
  EXPECT_LE((a - b).abs().max().item<double>() / scale, tolerance(type)) << what;
}

kernels::cpu::Dtype dtype_of(at::ScalarType t) {
  using kernels::cpu::Dtype;
  return t == at::kFloat ? Dtype::kFloat : t == at::kBFloat16 ? Dtype::kBFloat16 : Dtype::kHalf;
}

TEST(FusedKernelsTest, AutogradGivesTheReferenceOnNonContiguousInputs) {
  at::manual_seed(3);
  const auto& ref = kernels::reference_table();
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const std::string what = c10::toString(type);
    const at::Tensor x = at::randn({40, 6}).to(type).t().detach().requires_grad_(true);  // [6, 40], a transposed view
    ASSERT_FALSE(x.is_contiguous());
    const at::Tensor w = (at::randn({40}) * 0.3 + 1).to(type).requires_grad_(true);
    const at::Tensor dy = at::randn({6, 40}).to(type);
    const at::Tensor y = fused_rms_norm(x, w, 1e-6, false);
    y.backward(dy);
    const at::Tensor xc = x.detach().contiguous();
    at::Tensor ry = at::empty_like(xc), inv = at::empty({6}, at::kFloat), rdx = at::empty_like(xc);
    at::Tensor rdw = at::empty({40}, at::kFloat);
    ref.rms_norm_forward(dtype_of(type), xc.data_ptr(), w.data_ptr(), ry.data_ptr(), inv.data_ptr<float>(), 6, 40,
                         1e-6f, false);
    ref.rms_norm_backward(dtype_of(type), dy.data_ptr(), xc.data_ptr(), w.data_ptr(), inv.data_ptr<float>(),
                          rdx.data_ptr(), rdw.data_ptr<float>(), 6, 40, false);
    expect_close(y.detach(), ry, type, what + " y");
    expect_close(x.grad(), rdx, type, what + " dx");
    expect_close(w.grad(), rdw, type, what + " dw");
    EXPECT_EQ(w.grad().scalar_type(), type);

    const at::Tensor in = at::randn({12, 5}).to(type).t().detach().requires_grad_(true);  // [5, 12]
    const at::Tensor out = fused_glu(in, Glu::kGeGlu);
    const at::Tensor dout = at::randn({5, 6}).to(type);
    out.backward(dout);
    const at::Tensor inc = in.detach().contiguous();
    at::Tensor rout = at::empty({5, 6}, inc.options()), rdin = at::empty_like(inc);
    ref.glu_forward(dtype_of(type), kernels::cpu::Glu::kGeGlu, inc.data_ptr(), rout.data_ptr(), 5, 6);
    ref.glu_backward(dtype_of(type), kernels::cpu::Glu::kGeGlu, dout.data_ptr(), inc.data_ptr(), rdin.data_ptr(), 5, 6);
    expect_close(out.detach(), rout, type, what + " geglu");
    expect_close(in.grad(), rdin, type, what + " geglu grad");

    const at::Tensor logits = (at::randn({7, 9}) * 10).to(type).requires_grad_(true);
    const at::Tensor capped = fused_softcap(logits, 5.0);
    capped.sum().backward();
    expect_close(capped.detach(), at::tanh(logits.detach().to(at::kDouble) / 5) * 5, type, what + " softcap");
    expect_close(logits.grad(), 1 - at::tanh(logits.detach().to(at::kDouble) / 5).pow(2),
                 type == at::kFloat ? at::kFloat : at::kBFloat16, what + " softcap grad");
  }
  const std::string chosen = cpu_kernels_name();
  EXPECT_TRUE(chosen == "avx512" || chosen == "avx2" || chosen == "default") << chosen;
}

TEST(FusedKernelsTest, RefusesWhatItCannotTakeNamingIt) {
  const at::Tensor ints = at::ones({2, 4}, at::kLong);
  EXPECT_FALSE(supports(ints));
  try {
    glu_forward(ints, Glu::kSwiGlu);
    ADD_FAILURE() << "an int64 tensor was taken";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("Long"), std::string::npos) << e.what_without_backtrace();
  }
  EXPECT_THROW(rms_norm_forward(at::ones({2, 4}), at::ones({3}), 1e-5, false), c10::Error);  // weight of another size
  EXPECT_THROW(glu_forward(at::ones({2, 5}), Glu::kSwiGlu), c10::Error);                      // no [gate; up] halves
  EXPECT_THROW(softcap_forward(at::ones({2}), 0.0), c10::Error);                               // no cap
  EXPECT_EQ(glu_forward(at::ones({0, 4}), Glu::kSwiGlu).sizes(), (at::IntArrayRef{0, 2}));     // empty is fine
}

}  // namespace
}  // namespace trestle::train
