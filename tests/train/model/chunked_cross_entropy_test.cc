// The chunked output-layer cross-entropy (tp 1) against the output layer + vocab-parallel cross-entropy it replaces:
// loss and gradients (with soft-capping, vocabulary padding, a main-grad sink), and its peak memory at vocab 32000,
// measured by a counting CPU allocator.
#include "train/model/chunked_cross_entropy.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "train/model/fused_kernels.h"

namespace trestle::train {
namespace {

at::Tensor unfused_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                        const VocabRange& range, double softcap) {
  at::Tensor logits = at::linear(hidden, weight);
  if (softcap > 0) logits = at::tanh(logits / softcap) * softcap;
  return vocab_parallel_cross_entropy(logits, targets, range, TpGroup::single());
}

// 15 tokens (5 x 3) of width 16 over a vocabulary of 90 padded to 96 rows, with the unfused loss and its gradients
// for Σ loss · token_scale.
struct LossCase {
  VocabRange range = vocab_range(90, 96, TpGroup::single());
  at::Tensor hidden = at::randn({5, 3, 16}).requires_grad_(true);
  at::Tensor weight = at::randn({96, 16}).mul_(0.5).requires_grad_(true);
  at::Tensor targets = at::randint(0, 90, {5, 3}, at::kLong);
  at::Tensor expected, grad_hidden, grad_weight;
  LossCase(double softcap, const at::Tensor& token_scale) {
    expected = unfused_loss(hidden, weight, targets, range, softcap);
    (expected * token_scale).sum().backward();
    grad_hidden = hidden.grad().clone();
    grad_weight = weight.grad().clone();
    hidden.mutable_grad().reset();
    weight.mutable_grad().reset();
  }
  // The gradients a run of the loss left in hidden and weight are the unfused ones (none in the padding rows).
  void expect_gradients() const {
    EXPECT_LT((hidden.grad() - grad_hidden).abs().max().item<double>(), 1e-5);
    EXPECT_LT((weight.grad() - grad_weight).abs().max().item<double>(), 1e-5);
    EXPECT_EQ(weight.grad().narrow(0, 90, 6).abs().max().item<double>(), 0.0);
  }
};

// A main-grad buffer of 7s (gradient accumulation fusion) that its next micro-batch writes, counting accumulations.
WeightGradSink sevens_sink(int* accumulated) {
  WeightGradSink sink;
  sink.main_grad = at::full({96, 16}, 7.0);
  sink.overwrite = true;
  sink.on_accumulated = [accumulated] { ++*accumulated; };
  return sink;
}

class ChunkedCrossEntropyPasses : public ::testing::TestWithParam<bool> {};

// With ATen's ops on fp32 logits, and with the fused cross-entropy passes (fused_kernels.h: the CUDA kernels'
// arithmetic, here in their CPU loops).
TEST_P(ChunkedCrossEntropyPasses, GiveTheUnfusedLossAndGradients) {
  at::manual_seed(2);
  // 15 tokens in chunks of 4, 4, 4, 3; and in one chunk, whose logits backward takes from forward.
  for (const auto& [softcap, chunk] : {std::pair{0.0, 4}, std::pair{4.0, 4}, std::pair{0.0, 15}, std::pair{4.0, 15}}) {
    SCOPED_TRACE("softcap " + std::to_string(softcap) + ", chunk " + std::to_string(chunk));
    const at::Tensor scale = at::rand({5, 3});
    const LossCase c(softcap, scale);
    const auto& [range, hidden, weight, targets, expected, grad_hidden, grad_weight] = c;
    OutputLossOptions options;
    options.softcap = softcap;
    options.chunk_tokens = chunk;
    options.fused_kernels = GetParam();
    const at::Tensor loss = chunked_output_cross_entropy(hidden, weight, targets, range, TpGroup::single(), options);
    EXPECT_LT((loss - expected).abs().max().item<double>(), 1e-5);
    (loss * scale).sum().backward();
    c.expect_gradients();

    // Into a main-grad buffer (gradient accumulation fusion): written on the first micro-batch, then added to.
    int accumulated = 0;
    WeightGradSink sink = sevens_sink(&accumulated);
    options.sink = &sink;
    for (int pass = 0; pass < 2; ++pass)
      (chunked_output_cross_entropy(hidden, weight.detach().requires_grad_(true), targets, range,
                                    TpGroup::single(), options) * scale).sum().backward();
    EXPECT_EQ(accumulated, 2);
    EXPECT_LT((sink.main_grad - 2 * grad_weight).abs().max().item<double>(), 1e-5);
  }
}

// The weighted sum with its gradients made in the forward pass (the trainer's loss): the per-token path's loss, and
// its gradients for a loss weighted per token and scaled once more by the sum's gradient; into a sink only when
// backward runs (a forward alone, as evaluation's, leaves the buffer as it was).
TEST_P(ChunkedCrossEntropyPasses, WeightedSumGivesTheUnfusedLossAndGradients) {
  at::manual_seed(6);
  for (const auto& [softcap, chunk] : {std::pair{0.0, 4}, std::pair{4.0, 4}, std::pair{0.0, 15}, std::pair{4.0, 15}}) {
    SCOPED_TRACE("softcap " + std::to_string(softcap) + ", chunk " + std::to_string(chunk));
    const at::Tensor token_weights = at::rand({5, 3}) * (at::rand({5, 3}) > 0.3).to(at::kFloat);
    const double outer = 2.5;  // the sum's gradient
    const LossCase c(softcap, token_weights * outer);
    const auto& [range, hidden, weight, targets, expected, grad_hidden, grad_weight] = c;
    OutputLossOptions options;
    options.softcap = softcap;
    options.chunk_tokens = chunk;
    options.fused_kernels = GetParam();
    const WeightedOutputLoss loss =
        weighted_output_cross_entropy(hidden, weight, targets, token_weights, range, TpGroup::single(), options);
    EXPECT_FALSE(loss.per_token.requires_grad());
    EXPECT_LT((loss.per_token - expected).abs().max().item<double>(), 1e-5);
    EXPECT_NEAR(loss.sum.item<double>(), (expected * token_weights).sum().item<double>(), 1e-4);
    loss.sum.mul(outer).backward();
    c.expect_gradients();

    int accumulated = 0;
    WeightGradSink sink = sevens_sink(&accumulated);
    options.sink = &sink;
    const at::Tensor frozen = weight.detach().requires_grad_(true);
    {
      const WeightedOutputLoss unused =
          weighted_output_cross_entropy(hidden, frozen, targets, token_weights, range, TpGroup::single(), options);
      EXPECT_EQ(accumulated, 0);
      EXPECT_TRUE(at::equal(sink.main_grad, at::full({96, 16}, 7.0)));
    }
    for (int pass = 0; pass < 2; ++pass)
      weighted_output_cross_entropy(hidden, frozen, targets, token_weights, range, TpGroup::single(), options)
          .sum.mul(outer)
          .backward();
    EXPECT_EQ(accumulated, 2);
    EXPECT_LT((sink.main_grad - 2 * grad_weight).abs().max().item<double>(), 1e-5);
    EXPECT_FALSE(frozen.grad().defined());
    {
      at::NoGradGuard no_grad;
      const WeightedOutputLoss evaluated =
          weighted_output_cross_entropy(hidden, weight, targets, token_weights, range, TpGroup::single(), options);
      EXPECT_NEAR(evaluated.sum.item<double>(), loss.sum.item<double>(), 1e-6);
    }
  }
  EXPECT_THROW(weighted_output_cross_entropy(
                   at::randn({5, 3, 16}), at::randn({96, 16}), at::randint(0, 90, {5, 3}, at::kLong), at::ones({3, 5}),
                   vocab_range(90, 96, TpGroup::single()), TpGroup::single(), OutputLossOptions{}),
               c10::Error);
}

INSTANTIATE_TEST_SUITE_P(AtenAndFused, ChunkedCrossEntropyPasses, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& tested) { return tested.param ? "Fused" : "Aten"; });

// The fused passes in bf16 and half: the logits read in the layer's dtype, the loss and the logits' gradient (rounded
// to that dtype) as ATen's ops on the same logits widened to fp32 give them; a target in another rank's vocabulary
// (outside) counts no logit; the soft-cap's derivative applied.
TEST(ChunkedCrossEntropyTest, FusedPassesInSixteenBitsMatchTheFp32Ops) {
  at::manual_seed(4);
  for (const auto type : {at::kBFloat16, at::kHalf, at::kFloat})
    for (const double cap : {0.0, 3.0}) {
      SCOPED_TRACE(std::string(c10::toString(type)) + ", cap " + std::to_string(cap));
      const std::int64_t rows = 7, cols = 37;  // 37: one element at a time; the model's widths take packs
      const at::Tensor logits = (at::randn({rows, cols}) * 4).to(type);
      const at::Tensor target = at::randint(0, cols, {rows}, at::kLong);
      const at::Tensor outside = at::rand({rows}) < 0.3;
      const at::Tensor grad_loss = at::rand({rows});
      at::Tensor z = logits.to(at::kFloat);
      at::Tensor t;
      if (cap > 0) {
        t = at::tanh(z / cap);
        z = t * cap;
      }
      const at::Tensor max = std::get<0>(z.max(-1));
      EXPECT_LE((cross_entropy_max(logits, cap) - max).abs().max().item<double>(), 1e-6 * (cap > 0 ? cap : 1e6));
      const at::Tensor sums = cross_entropy_sums(logits, target, outside, max, cap);
      const at::Tensor shifted = z - max.unsqueeze(-1);
      const at::Tensor target_logit = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
      EXPECT_LT((sums[0] - target_logit).abs().max().item<double>(), 1e-6);
      const at::Tensor sum_exp = shifted.exp().sum(-1);
      EXPECT_LT(((sums[1] - sum_exp) / sum_exp).abs().max().item<double>(), 1e-6);
      const at::Tensor lse = sum_exp.log() + max;
      at::Tensor g = (z - lse.unsqueeze(-1)).exp();
      g.scatter_add_(-1, target.unsqueeze(-1), -(~outside).to(at::kFloat).unsqueeze(-1));
      g.mul_(grad_loss.unsqueeze(-1));
      if (cap > 0) g.mul_(1 - t * t);
      const at::Tensor grad = cross_entropy_grad(logits, target, outside, lse, grad_loss, cap);
      EXPECT_EQ(grad.scalar_type(), type);
      // Rounded to the dtype: within half a unit in its last place of the fp32 gradient (and fp32 rounding).
      const double ulp = type == at::kFloat ? 1e-6 : type == at::kBFloat16 ? 1.0 / 256 : 1.0 / 2048;
      EXPECT_LE((grad.to(at::kFloat) - g).abs().max().item<double>(), ulp * g.abs().max().item<double>() + 1e-7);
    }
  const at::Tensor logits = at::randn({2, 5});
  EXPECT_THROW(cross_entropy_sums(logits, at::zeros({3}, at::kLong), at::zeros({3}, at::kBool), at::zeros({2}), 0.0),
               c10::Error);
}

// bf16 hidden states and weight with an fp32 main grad (--bf16's gradient accumulation fusion): the weight's gradient
// lands in the fp32 buffer as the fp32 computation on the same bf16 values gives it (the logits' GEMM in bf16 aside).
TEST(ChunkedCrossEntropyTest, Bf16InputsIntoAnFp32MainGrad) {
  at::manual_seed(3);
  const VocabRange range = vocab_range(90, 96, TpGroup::single());
  const at::Tensor hidden = at::randn({5, 3, 16}).to(at::kBFloat16);
  const at::Tensor weight = (at::randn({96, 16}) * 0.5).to(at::kBFloat16);
  const at::Tensor targets = at::randint(0, 90, {5, 3}, at::kLong);
  const at::Tensor weight32 = weight.to(at::kFloat).requires_grad_(true);
  unfused_loss(hidden.to(at::kFloat), weight32, targets, range, 0.0).sum().backward();
  for (const bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused passes" : "ATen's ops");
    WeightGradSink sink;
    sink.main_grad = at::full({96, 16}, 7.0);
    sink.overwrite = true;
    OutputLossOptions options;
    options.chunk_tokens = 4;
    options.sink = &sink;
    options.fused_kernels = fused;
    chunked_output_cross_entropy(hidden.detach().requires_grad_(true), weight.detach().requires_grad_(true), targets,
                                 range, TpGroup::single(), options)
        .sum()
        .backward();
    EXPECT_EQ(sink.main_grad.scalar_type(), at::kFloat);
    const double scale = weight32.grad().abs().max().item<double>();
    EXPECT_LT((sink.main_grad - weight32.grad()).abs().max().item<double>(), 2e-2 * scale);
    EXPECT_EQ(sink.main_grad.narrow(0, 90, 6).abs().max().item<double>(), 0.0);
  }
}

// Counts the bytes the CPU allocator holds, and their peak.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(std::size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_ += n;
      peak_ = std::max(peak_, held_);
      sizes_[data] = n;
      contexts_[data] = inner.release_context();
      deleters_[data] = inner.get_deleter();
    }
    return {data, data, &CountingAllocator::free, inner.device()};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = held_;
  }
  std::size_t peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }
  std::size_t held() {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }
  static CountingAllocator* instance;

 private:
  static void free(void* data) {
    CountingAllocator* self = instance;
    void* context = nullptr;
    c10::DeleterFnPtr deleter = nullptr;
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      self->held_ -= self->sizes_.at(data);
      self->sizes_.erase(data);
      context = self->contexts_.at(data);
      deleter = self->deleters_.at(data);
      self->contexts_.erase(data);
      self->deleters_.erase(data);
    }
    if (deleter) deleter(context);
  }
  c10::Allocator* inner_;
  std::mutex mutex_;
  std::size_t held_ = 0, peak_ = 0;
  std::unordered_map<void*, std::size_t> sizes_;
  std::unordered_map<void*, void*> contexts_;
  std::unordered_map<void*, c10::DeleterFnPtr> deleters_;
};
CountingAllocator* CountingAllocator::instance = nullptr;

// Forward and backward of 4096 tokens at vocab 32000: the chunked version's peak (above what was held before) is at
// most a quarter of the unfused one's; the weighted sum's too (the trainer's loss, holding the weight's gradient
// from forward to backward).
TEST(ChunkedCrossEntropyTest, PeakMemoryIsAQuarterOfTheUnfusedAtVocab32000) {
  static CountingAllocator counting(c10::GetDefaultCPUAllocator());
  CountingAllocator::instance = &counting;
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  at::manual_seed(3);
  const std::int64_t tokens = 4096, h = 64, vocab = 32000;
  const VocabRange range = vocab_range(vocab, vocab, TpGroup::single());
  const at::Tensor weight = at::randn({vocab, h}).mul_(0.1).requires_grad_(true);
  const at::Tensor targets = at::randint(0, vocab, {tokens}, at::kLong);
  enum class Path { kUnfused, kChunked, kWeighted };
  auto peak_of = [&](Path path) {
    const at::Tensor hidden = at::randn({tokens, h}).requires_grad_(true);
    weight.mutable_grad() = at::zeros_like(weight);  // held before: both runs accumulate into it
    const std::size_t before = counting.held();
    counting.reset_peak();
    OutputLossOptions options;
    options.chunk_tokens = output_loss_chunk_tokens(vocab, at::kCPU);
    if (path == Path::kWeighted) {
      const at::Tensor weights = at::full({tokens}, 1.0 / tokens);
      weighted_output_cross_entropy(hidden, weight, targets, weights, range, TpGroup::single(), options).sum.backward();
    } else {
      const at::Tensor loss = path == Path::kChunked ? chunked_output_cross_entropy(hidden, weight, targets, range,
                                                                                    TpGroup::single(), options)
                                                     : unfused_loss(hidden, weight, targets, range, 0.0);
      loss.mean().backward();
    }
    return counting.peak() - before;
  };
  const std::size_t unfused = peak_of(Path::kUnfused), chunked = peak_of(Path::kChunked),
                    weighted = peak_of(Path::kWeighted);
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), /*priority=*/101);
  std::printf("peak above the inputs: unfused %.1f MiB, chunked %.1f MiB, weighted %.1f MiB\n", unfused / 1048576.0,
              chunked / 1048576.0, weighted / 1048576.0);
  EXPECT_GT(unfused, static_cast<std::size_t>(tokens * vocab * 4));  // at least the fp32 logits
  EXPECT_LE(chunked * 4, unfused);
  EXPECT_LE(weighted * 4, unfused);
}

}  // namespace
}  // namespace trestle::train
