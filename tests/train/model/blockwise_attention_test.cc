#include "train/model/blockwise_attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/grouped_attention.h"

namespace trestle::train {
namespace {

// The whole score matrix in double: q [b, heads, s, d], k and v grouped; `allowed` as the options'.
at::Tensor composite_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const ScoresAttention& o) {
  const std::int64_t heads = q.size(1), seq = q.size(2);
  at::Tensor scores = at::matmul(q, kernels::expand_groups(k, heads).transpose(-2, -1)) * o.scale;
  if (o.softcap > 0) scores = at::tanh(scores / o.softcap) * o.softcap;
  const at::Tensor allowed = o.allowed ? *o.allowed : at::ones({seq, seq}, q.options().dtype(at::kBool)).tril();
  scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  if (o.sinks.defined()) {
    const at::Tensor sink = o.sinks.view({1, -1, 1, 1}).expand({q.size(0), heads, seq, 1});
    scores = at::cat({scores, sink}, -1);
  }
  at::Tensor probs = at::softmax(scores, -1).narrow(-1, 0, seq);
  probs = probs.masked_fill(at::isnan(probs), 0.0);  // a query that sees nothing: 0
  return at::matmul(probs, kernels::expand_groups(v, heads));
}

struct Inputs {
  at::Tensor q, k, v, sinks, grad;
};

Inputs random_inputs(std::int64_t batch, std::int64_t heads, std::int64_t groups, std::int64_t seq, std::int64_t dim,
                     std::int64_t value_dim, bool with_sinks) {
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  // q made [s, b, heads, d] and viewed heads first, as the layer passes it: not contiguous.
  return {at::randn({seq, batch, heads, dim}, f64).permute({1, 2, 0, 3}), at::randn({batch, groups, seq, dim}, f64),
          at::randn({batch, groups, seq, value_dim}, f64), with_sinks ? at::randn({heads}, f64) : at::Tensor(),
          at::randn({batch, heads, seq, value_dim}, f64)};
}

// Output and gradients (q, k, v, sinks) of `attend` on copies of the inputs in `type`, as double.
std::vector<at::Tensor> run(const Inputs& in, at::ScalarType type,
                            const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&)>& attend) {
  auto leaf = [&](const at::Tensor& t, at::ScalarType as) {
    return t.defined() ? t.to(as).detach().requires_grad_(true) : at::Tensor();
  };
  const at::Tensor q = leaf(in.q, type), k = leaf(in.k, type), v = leaf(in.v, type);
  const at::Tensor sinks = leaf(in.sinks, type);
  const at::Tensor out = attend(q, k, v, sinks);
  out.backward(in.grad.to(type));
  std::vector<at::Tensor> result{out.detach().to(at::kDouble), q.grad().to(at::kDouble), k.grad().to(at::kDouble),
                                 v.grad().to(at::kDouble)};
  if (sinks.defined()) result.push_back(sinks.grad().to(at::kDouble));
  return result;
}

void expect_close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, double tolerance,
                  const std::string& what) {
  const char* names[] = {"output", "grad q", "grad k", "grad v", "grad sinks"};
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double scale = std::max(1.0, want[i].abs().max().item<double>());
    const double error = (got[i] - want[i]).abs().max().item<double>() / scale;
    EXPECT_LE(error, tolerance) << what << ": " << names[i];
    EXPECT_FALSE(at::isnan(got[i]).any().item<bool>()) << what << ": " << names[i];
  }
}

struct Case {
  std::int64_t heads, groups, seq, dim, value_dim;
  double softcap;
  bool sinks;
  std::string mask;  // causal, window, documents, hidden (a row that sees nothing)
  std::int64_t block_scores;
};

std::string name(const Case& c) {
  return "heads " + std::to_string(c.heads) + "/" + std::to_string(c.groups) + " seq " + std::to_string(c.seq) + " d " +
         std::to_string(c.dim) + "/" + std::to_string(c.value_dim) + " cap " + std::to_string(c.softcap) +
         (c.sinks ? " sinks " : " ") + c.mask + " block " + std::to_string(c.block_scores);
}

ScoresAttention options_of(const Case& c, std::int64_t batch) {
  ScoresAttention o;
  o.scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  o.softcap = c.softcap;
  o.block_scores = c.block_scores;
  const std::int64_t s = c.seq;
  const at::Tensor i = at::arange(s).unsqueeze(1), j = i.transpose(0, 1);
  const at::Tensor causal = j <= i;
  if (c.mask == "window") {
    o.window = 5;
    o.allowed = causal & (i - j < o.window);
  } else if (c.mask == "documents") {  // [b, 1, s, s]: batch 0 in documents of 7, batch 1 in two halves
    const at::Tensor doc = at::stack({at::arange(s) / 7, at::arange(s) / ((s + 1) / 2)});
    o.allowed = (causal & (doc.unsqueeze(2) == doc.unsqueeze(1))).unsqueeze(1).narrow(0, 0, batch);
  } else if (c.mask == "hidden") {  // row 3 sees nothing
    at::Tensor allowed = causal.clone();
    allowed[3].fill_(false);
    o.allowed = allowed;
  }
  return o;
}

TEST(BlockwiseAttentionTest, MatchesTheWholeScoreMatrixInDouble) {
  at::manual_seed(3);
  const std::int64_t batch = 2;
  const std::vector<Case> cases = {
      {4, 2, 37, 8, 8, 0.0, false, "causal", 1},               // a row a block
      {4, 2, 37, 8, 8, 2.5, false, "causal", 2 * 4 * 37 * 5},  // 5 rows a block, the last of 2
      {4, 4, 37, 8, 8, 2.5, true, "window", 2 * 4 * 37 * 6},
      {6, 1, 29, 16, 12, 0.0, true, "documents", 2 * 6 * 29 * 4},  // values narrower than keys
      {4, 2, 37, 8, 8, 3.0, true, "causal", 0},                    // the device's default: one block
      {4, 2, 16, 8, 8, 1.5, false, "hidden", 2 * 4 * 16 * 3},
      {2, 1, 1, 4, 4, 2.0, true, "causal", 0},  // one token
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(name(c));
    const Inputs in = random_inputs(batch, c.heads, c.groups, c.seq, c.dim, c.value_dim, c.sinks);
    ScoresAttention o = options_of(c, batch);
    auto composite = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sinks) {
      ScoresAttention with = o;
      with.sinks = sinks;
      return composite_attention(q, k, v, with);
    };
    auto blockwise = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sinks) {
      ScoresAttention with = o;
      with.sinks = sinks;
      return blockwise_attention(q, k, v, with);
    };
    const std::vector<at::Tensor> want = run(in, at::kDouble, composite);
    expect_close(run(in, at::kDouble, blockwise), want, 1e-12, "double");
    expect_close(run(in, at::kFloat, blockwise), want, 2e-5, "float");
    expect_close(run(in, at::kBFloat16, blockwise), want, 6e-2, "bfloat16");
    if (c.mask == "hidden") {  // the row that sees nothing: output 0 and no gradient through it
      const std::vector<at::Tensor> got = run(in, at::kFloat, blockwise);
      EXPECT_EQ(got[0].select(2, 3).abs().max().item<double>(), 0.0);
      EXPECT_EQ(got[1].select(2, 3).abs().max().item<double>(), 0.0);
    }
  }
}

TEST(BlockwiseAttentionTest, ItsFloatErrorIsTheWholeMatrixCompositesOwn) {
  // In fp32 the output's and gradients' errors against double stay on the order of the whole-matrix composite's.
  at::manual_seed(5);
  const Case c{8, 2, 64, 16, 16, 4.0, true, "causal", 2 * 8 * 64 * 8};
  const Inputs in = random_inputs(2, c.heads, c.groups, c.seq, c.dim, c.value_dim, c.sinks);
  ScoresAttention o = options_of(c, 2);
  auto attend = [&](bool blockwise) {
    return [&, blockwise](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sinks) {
      ScoresAttention with = o;
      with.sinks = sinks;
      return blockwise ? blockwise_attention(q, k, v, with) : composite_attention(q, k, v, with);
    };
  };
  const std::vector<at::Tensor> want = run(in, at::kDouble, attend(false));
  const std::vector<at::Tensor> composite = run(in, at::kFloat, attend(false));
  const std::vector<at::Tensor> blockwise = run(in, at::kFloat, attend(true));
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double composite_error = (composite[i] - want[i]).abs().max().item<double>();
    const double blockwise_error = (blockwise[i] - want[i]).abs().max().item<double>();
    EXPECT_LE(blockwise_error, 4 * composite_error + 1e-6) << "tensor " << i;
  }
}

// As context parallelism's ring calls it: queries and keys of other positions and lengths, documents, windows, and a
// gradient through the log-sum-exps as well as the output; against the masked whole matrix in double.
TEST(BlockwiseAttentionTest, PositionsDocumentsAndTheLogSumExpsGradient) {
  at::manual_seed(7);
  const std::int64_t b = 2, heads = 4, groups = 2, d = 8;
  const at::Tensor q_pos = at::cat({at::arange(0, 6), at::arange(18, 24)});  // a rank's two chunks
  const at::Tensor k_pos = at::cat({at::arange(6, 11), at::arange(13, 18)});
  const std::int64_t sq = q_pos.numel(), sk = k_pos.numel();
  // Batch 0: documents starting at 0, 9 and 20; batch 1: one document.
  auto documents = [&](const at::Tensor& pos) {
    return at::stack({(pos >= 9).to(at::kLong) + (pos >= 20).to(at::kLong), at::zeros_like(pos)});
  };
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q0 = at::randn({b, heads, sq, d}, f64), k0 = at::randn({b, groups, sk, d}, f64),
                   v0 = at::randn({b, groups, sk, d}, f64);
  const at::Tensor grad_out = at::randn({b, heads, sq, d}, f64), grad_lse = at::randn({b, heads, sq}, f64);
  for (const std::int64_t window : {std::int64_t{0}, std::int64_t{9}}) {
    for (const double softcap : {0.0, 3.0}) {
      SCOPED_TRACE("window " + std::to_string(window) + " softcap " + std::to_string(softcap));
      ScoresAttention o;
      o.scale = 0.4;
      o.softcap = softcap;
      o.window = window;
      o.q_positions = q_pos;
      o.k_positions = k_pos;
      o.q_documents = documents(q_pos);
      o.k_documents = documents(k_pos);
      o.block_scores = b * heads * sk * 5;  // blocks of 5 rows, the last of 2
      at::Tensor visible = k_pos.view({1, 1, 1, -1}) <= q_pos.view({1, 1, -1, 1});
      if (window > 0) visible = visible & (q_pos.view({1, 1, -1, 1}) - k_pos.view({1, 1, 1, -1}) < window);
      visible = visible & (o.q_documents.view({b, 1, sq, 1}) == o.k_documents.view({b, 1, 1, sk}));
      ASSERT_TRUE(visible.logical_not().all(-1).any().item<bool>());  // some query sees none of these keys
      // One pass: the output, the log-sum-exps (their -inf as 0) and the gradients of q, k, v.
      auto pass = [&](bool blockwise) {
        const at::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
                         v = v0.clone().requires_grad_(true);
        at::Tensor out, lse;
        if (blockwise) {
          const AttentionPartial part = blockwise_attention_with_lse(q, k, v, o);
          out = part.out;
          lse = part.lse;
        } else {
          at::Tensor scores = at::matmul(q, kernels::expand_groups(k, heads).transpose(-2, -1)) * o.scale;
          if (softcap > 0) scores = at::tanh(scores / softcap) * softcap;
          scores = scores.masked_fill(visible.logical_not(), -std::numeric_limits<double>::infinity());
          lse = at::logsumexp(scores, -1);
          const at::Tensor probs = at::exp(scores - lse.masked_fill(at::isinf(lse), 0.0).unsqueeze(-1));
          out = at::matmul(probs, kernels::expand_groups(v, heads));
        }
        const at::Tensor finite = lse.masked_fill(at::isinf(lse), 0.0);
        ((out * grad_out).sum() + (finite * grad_lse).sum()).backward();
        return std::vector<at::Tensor>{out.detach(), finite.detach(), q.grad(), k.grad(), v.grad()};
      };
      const std::vector<at::Tensor> want = pass(false), got = pass(true);
      const char* names[] = {"output", "lse", "grad q", "grad k", "grad v"};
      for (std::size_t i = 0; i < want.size(); ++i)
        EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-12) << names[i];
    }
  }
}

TEST(BlockwiseAttentionTest, RefusesWhatItCannotServe) {
  const at::Tensor q = at::randn({1, 4, 8, 4}), k = at::randn({1, 3, 8, 4}), v = at::randn({1, 2, 8, 4});
  ScoresAttention o;
  EXPECT_THROW(blockwise_attention(q, k, k, o), c10::Error);                  // 3 groups for 4 heads
  EXPECT_THROW(blockwise_attention(q, v, v.narrow(2, 0, 7), o), c10::Error);  // values of another length
  o.sinks = at::zeros({3});
  EXPECT_THROW(blockwise_attention(q, v, v, o), c10::Error);  // 3 sinks for 4 heads
  o.sinks = at::Tensor();
  o.allowed = at::ones({1, 4, 8, 8}, at::kBool);  // a mask per head
  EXPECT_THROW(blockwise_attention(q, v, v, o), c10::Error);
  o.allowed = at::ones({8, 8});  // not bool
  EXPECT_THROW(blockwise_attention(q, v, v, o), c10::Error);
  o.allowed.reset();
  EXPECT_THROW(blockwise_attention(q, v.narrow(2, 0, 6), v.narrow(2, 0, 6), o), c10::Error);  // 8 over 6, no positions
  o.q_positions = at::arange(8);
  EXPECT_THROW(blockwise_attention(q, v, v, o), c10::Error);  // the queries' positions alone
  o.k_positions = at::tensor({0, 1, 2, 3, 5, 4, 6, 7});
  EXPECT_THROW(blockwise_attention(q, v, v, o), c10::Error);  // the keys' out of order
  o.k_positions = at::arange(7);
  EXPECT_THROW(blockwise_attention(q, v, v, o), c10::Error);  // 7 positions for 8 keys
  o.k_positions = at::arange(8);
  o.q_documents = at::zeros({1, 8}, at::kLong);
  EXPECT_THROW(blockwise_attention(q, v, v, o), c10::Error);  // the queries' documents alone
  o.k_documents = at::zeros({2, 8}, at::kLong);
  EXPECT_THROW(blockwise_attention(q, v, v, o), c10::Error);  // documents of another batch
  o.k_documents = at::zeros({1, 8}, at::kLong);
  EXPECT_NO_THROW(blockwise_attention(q, v, v, o));
}

}  // namespace
}  // namespace trestle::train
