// The fused kernels as the model calls them (train/model/fused_kernels.h): through autograd against the plain
// reference, on non-contiguous inputs, in every dtype; RoPE against the model's composite (rope.h) too; the CPU build
// chosen; what they refuse, naming it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/reference.h"
#include "train/model/fused_kernels.h"
#include "train/model/rope.h"

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
    ref.rms_norm_forward(dtype_of(type), xc.data_ptr(), nullptr, nullptr, w.data_ptr(), ry.data_ptr(),
                         inv.data_ptr<float>(), 6, 40, 1e-6f, false);
    ref.rms_norm_backward(dtype_of(type), dy.data_ptr(), xc.data_ptr(), w.data_ptr(), inv.data_ptr<float>(), nullptr,
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

// Tables as the model makes them: rot_dim wide, for positions [batch, seq] shuffled.
RopeTables tables_for(std::int64_t seq, std::int64_t batch, std::int64_t rot) {
  const at::Tensor inverse_frequencies = 1.0 / at::pow(10000.0, at::arange(0, rot, 2, at::kFloat) / rot);
  return rope_tables(inverse_frequencies, at::randint(0, 4096, {batch, seq}, at::kLong));
}

// fused_add_rms_norm: {x + delta, RMSNorm(x + delta)} with h's gradient from the rest of the stream added in the
// norm's backward, against the add and the fused norm as separate autograd nodes (whose gradients autograd adds): the
// same outputs bit for bit; gradients within one rounding (the fused sum rounds once) in every dtype; and each output
// alone taking part in the loss (the other's gradient undefined).
TEST(FusedKernelsTest, AddThenNormGivesTheSeparateStepsThroughAutograd) {
  at::manual_seed(12);
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const bool zero_centered : {false, true})
      for (const int uses : {3, 1, 2}) {  // bit 0: the loss reads h, bit 1: the norm's output
        const std::string what =
            std::string(c10::toString(type)) + (zero_centered ? " (1 + w)" : "") + " uses " + std::to_string(uses);
        const at::Tensor x0 = (at::randn({5, 3, 48}) * 2).to(type), delta0 = at::randn({5, 3, 48}).to(type);
        const at::Tensor w0 = (at::randn({48}) * 0.3 + (zero_centered ? 0.0 : 1.0)).to(type);
        const at::Tensor gh = at::randn({5, 3, 48}).to(type), gn = at::randn({5, 3, 48}).to(type);
        auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
        const at::Tensor x = leaf(x0), delta = leaf(delta0), w = leaf(w0);
        const at::Tensor sx = leaf(x0), sdelta = leaf(delta0), sw = leaf(w0);
        auto loss = [&](const at::Tensor& h, const at::Tensor& n) {
          at::Tensor l = at::zeros({}, at::kDouble);
          if (uses & 1) l = l + (h.to(at::kDouble) * gh.to(at::kDouble)).sum();
          if (uses & 2) l = l + (n.to(at::kDouble) * gn.to(at::kDouble)).sum();
          return l;
        };
        const std::vector<at::Tensor> fused = fused_add_rms_norm(x, delta, w, 1e-6, zero_centered);
        loss(fused[0], fused[1]).backward();
        const at::Tensor sh = sx + sdelta;
        const at::Tensor sn = fused_rms_norm(sh, sw, 1e-6, zero_centered);
        loss(sh, sn).backward();
        EXPECT_TRUE(at::equal(fused[0].detach(), sh.detach())) << what << " h";
        EXPECT_TRUE(at::equal(fused[1].detach(), sn.detach())) << what << " normed";
        expect_close(x.grad(), sx.grad(), type, what + " dx");
        expect_close(delta.grad(), sdelta.grad(), type, what + " ddelta");
        if (uses & 2) {
          expect_close(w.grad(), sw.grad(), type, what + " dw");
        } else {
          EXPECT_FALSE(w.grad().defined() && w.grad().abs().max().item<double>() > 0) << what << " dw without the norm";
        }
      }
}

// fused_rope against the composite apply_rope, forward and gradient, with x a non-contiguous view and its gradient
// arriving permuted (as attention's permute sends it): within fp32 rounding in float, the composite's own roundings
// (it computes in x's dtype) in the 16-bit types; and against the reference at the kernels' tolerance.
TEST(FusedKernelsTest, RopeGivesTheCompositeThroughAutograd) {
  at::manual_seed(8);
  const auto& ref = kernels::reference_table();
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const auto& [head_dim, rot] : std::vector<std::pair<std::int64_t, std::int64_t>>{{6, 4}, {64, 64}, {40, 24}}) {
      const std::int64_t seq = 7, batch = 2, heads = 3;
      const std::string what =
          std::string(c10::toString(type)) + " head_dim " + std::to_string(head_dim) + " rot " + std::to_string(rot);
      const RopeTables tables = tables_for(seq, batch, rot);
      const at::Tensor base = (at::randn({seq, heads, batch, head_dim}) * 2).to(type);
      const at::Tensor x = base.transpose(1, 2).detach().requires_grad_(true);  // [seq, batch, heads, head_dim]
      ASSERT_FALSE(x.is_contiguous());
      const at::Tensor composite_x = x.detach().clone().requires_grad_(true);
      const at::Tensor dy = at::randn({batch, heads, seq, head_dim}).to(type);
      const at::Tensor y = fused_rope(x, tables.cos, tables.sin);
      (y.permute({1, 2, 0, 3}) * dy).sum().backward();
      const at::Tensor expected = apply_rope(composite_x, tables);
      (expected.permute({1, 2, 0, 3}) * dy).sum().backward();
      const at::ScalarType against_composite = type == at::kFloat ? at::kFloat : at::kBFloat16;
      expect_close(y.detach(), expected.detach(), against_composite, what + " y vs composite");
      expect_close(x.grad(), composite_x.grad(), against_composite, what + " dx vs composite");

      const at::Tensor xc = x.detach().contiguous(), dyc = dy.permute({2, 0, 1, 3}).contiguous();
      const at::Tensor cos = tables.cos.expand({seq, batch, 1, rot}).contiguous();
      const at::Tensor sin = tables.sin.expand({seq, batch, 1, rot}).contiguous();
      at::Tensor ry = at::empty_like(xc), rdx = at::empty_like(xc);
      const kernels::RopeLayout layout = kernels::RopeLayout::contiguous(heads, head_dim);
      ref.rope_forward(dtype_of(type), xc.data_ptr(), layout, cos.data_ptr<float>(), sin.data_ptr<float>(),
                       ry.data_ptr(), layout, seq * batch, heads, head_dim, rot, false);
      ref.rope_backward(dtype_of(type), dyc.data_ptr(), layout, cos.data_ptr<float>(), sin.data_ptr<float>(),
                        rdx.data_ptr(), layout, seq * batch, heads, head_dim, rot, false);
      expect_close(y.detach(), ry, type, what + " y vs reference");
      expect_close(x.grad(), rdx, type, what + " dx vs reference");

      // apply_rope's fused path is this kernel.
      EXPECT_TRUE(at::equal(apply_rope(x.detach(), tables, /*fused=*/true), y.detach())) << what;
    }
}

// Interleaved pairs: the fused rotation of x, its dims then laid out as evens and odds, is the composite's rotation of
// x so laid out (multi-latent attention's form); so are the gradients.
// fused_qkv_rope on Megatron's fused projection [seq, batch, groups, per_group + 2, head_dim] gives what splitting it
// and rotating the parts with fused_rope gives, bit for bit, forward and qkv's gradient (written in one piece); and
// the composite's within its roundings.
TEST(FusedKernelsTest, QkvRopeGivesTheSplitPartsRotatedThroughAutograd) {
  at::manual_seed(12);
  for (const auto type : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const auto& [head_dim, rot] : std::vector<std::pair<std::int64_t, std::int64_t>>{{6, 4}, {64, 64}, {16, 8}}) {
      const std::int64_t seq = 5, batch = 2, groups = 3, per_group = 2;
      const std::string what =
          std::string(c10::toString(type)) + " head_dim " + std::to_string(head_dim) + " rot " + std::to_string(rot);
      const RopeTables tables = tables_for(seq, batch, rot);
      const at::Tensor qkv =
          (at::randn({seq, batch, groups, per_group + 2, head_dim}) * 2).to(type).requires_grad_(true);
      const at::Tensor split_qkv = qkv.detach().clone().requires_grad_(true);
      const at::Tensor composite_qkv = qkv.detach().clone().requires_grad_(true);
      const at::Tensor dq = at::randn({seq, batch, groups * per_group, head_dim}).to(type);
      const at::Tensor dk = at::randn({seq, batch, groups, head_dim}).to(type);
      const at::Tensor dv = at::randn({seq, batch, groups, head_dim}).to(type);
      auto loss = [&](const std::vector<at::Tensor>& qkv_parts) {
        return (qkv_parts[0] * dq).sum() + (qkv_parts[1] * dk).sum() + (qkv_parts[2] * dv).sum();
      };
      auto split = [&](const at::Tensor& t, bool fused) {
        const auto parts = t.split_with_sizes({per_group, 1, 1}, 3);
        const at::Tensor q = parts[0].reshape({seq, batch, groups * per_group, head_dim});
        return std::vector<at::Tensor>{
            fused ? fused_rope(q, tables.cos, tables.sin) : apply_rope(q, tables),
            fused ? fused_rope(parts[1].squeeze(3), tables.cos, tables.sin) : apply_rope(parts[1].squeeze(3), tables),
            parts[2].squeeze(3)};
      };
      const auto got = fused_qkv_rope(qkv, tables.cos, tables.sin);
      loss(got).backward();
      const auto expected = split(split_qkv, true);
      loss(expected).backward();
      const auto composite = split(composite_qkv, false);
      loss(composite).backward();
      for (int i = 0; i < 3; ++i) {
        EXPECT_TRUE(at::equal(got[i].detach(), expected[i].detach())) << what << " part " << i;
        expect_close(got[i].detach(), composite[i].detach(), type == at::kFloat ? at::kFloat : at::kBFloat16,
                     what + " part " + std::to_string(i) + " vs composite");
      }
      EXPECT_TRUE(at::equal(qkv.grad(), split_qkv.grad())) << what << " qkv's gradient";
      expect_close(qkv.grad(), composite_qkv.grad(), type == at::kFloat ? at::kFloat : at::kBFloat16,
                   what + " qkv's gradient vs composite");
    }
}

TEST(FusedKernelsTest, InterleavedRopeGivesTheDeinterleavedComposite) {
  at::manual_seed(9);
  for (const auto type : {at::kFloat, at::kBFloat16}) {
    const RopeTables tables = tables_for(5, 2, 16);
    const at::Tensor x = (at::randn({5, 2, 3, 16}) * 2).to(type).requires_grad_(true);
    const at::Tensor composite_x = x.detach().clone().requires_grad_(true);
    const at::Tensor dy = at::randn({5, 2, 3, 16}).to(type);
    const at::Tensor y = deinterleave_pairs(fused_rope(x, tables.cos, tables.sin, /*interleaved=*/true));
    (y * dy).sum().backward();
    const at::Tensor expected = apply_rope(deinterleave_pairs(composite_x), tables);
    (expected * dy).sum().backward();
    const std::string what = c10::toString(type);
    expect_close(y.detach(), expected.detach(), type == at::kFloat ? at::kFloat : at::kBFloat16, what + " y");
    expect_close(x.grad(), composite_x.grad(), type == at::kFloat ? at::kFloat : at::kBFloat16, what + " dx");
  }
}

TEST(FusedKernelsTest, RopeRefusesWhatItCannotTakeNamingIt) {
  const RopeTables tables = tables_for(3, 2, 8);
  const at::Tensor x = at::randn({3, 2, 4, 8});
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("(taken)");
  };
  const at::Tensor learned = tables.cos.detach().requires_grad_(true);
  EXPECT_NE(message([&] { fused_rope(x, learned, tables.sin); }).find("constants"), std::string::npos);
  EXPECT_NE(message([&] { rope_forward(x.narrow(-1, 0, 6), tables.cos, tables.sin, false); }).find("rot_dim"),
            std::string::npos);  // tables wider than the head
  const at::Tensor odd = at::ones({3, 2, 1, 3});
  EXPECT_NE(message([&] { rope_forward(x, odd, odd, false); }).find("even"), std::string::npos);
  EXPECT_NE(message([&] { rope_forward(x[0], tables.cos, tables.sin, false); }).find("[seq, batch, heads"),
            std::string::npos);
  EXPECT_NE(message([&] { rope_forward(x.to(at::kLong), tables.cos, tables.sin, false); }).find("Long"),
            std::string::npos);
  // Tables over one sequence broadcast over the batch; no tokens is fine.
  const at::Tensor one = tables.cos.narrow(1, 0, 1), one_sin = tables.sin.narrow(1, 0, 1);
  EXPECT_TRUE(at::allclose(rope_forward(x, one, one_sin, false), apply_rope(x, {one, one_sin}), 1e-6, 1e-6));
  EXPECT_EQ(rope_forward(at::ones({0, 2, 4, 8}), tables.cos.narrow(0, 0, 0), tables.sin.narrow(0, 0, 0), false).sizes(),
            (at::IntArrayRef{0, 2, 4, 8}));
  // Tables that need a gradient keep apply_rope on the composite.
  EXPECT_TRUE(apply_rope(x, {learned, tables.sin}, /*fused=*/true).requires_grad());
}

}  // namespace
}  // namespace trestle::train
