// The training loop's pieces on one process: Megatron's micro-batch cut, the inputs a micro-batch becomes, the
// data-parallel gradient buffer (gradients accumulate in place into its buckets; a single rank reduces nothing),
// from-scratch initialisation being the same model at every tensor-parallel size, and the training checkpoint's
// round trip (parameters, optimizer state, step, progress, RNG) through ckpt's save and load at another layout.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <filesystem>
#include <limits>

#include "ckpt/collective.h"
#include "parallel/layout/parallel_layout.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"
#include "train/data/gpt_data_builder.h"
#include "train/loop/grad_buckets.h"
#include "train/loop/micro_batches.h"
#include "train/loop/train_checkpoint.h"
#include "train/model/fused_linear.h"
#include "train/model/model_init.h"

namespace trestle::train {
namespace {

TEST(MicroBatchesTest, CutAsMegatronsSampler) {
  auto shape = make_batch_shape(2, 16, 4);
  ASSERT_TRUE(shape.ok()) << shape.status().message();
  EXPECT_EQ(shape->micro_batches(), 2);
  // Iteration starting at sample 32: micro-batch m of dp rank d holds 32 + m·8 + d·2 and the next.
  EXPECT_EQ(micro_batch_samples(*shape, 32, 0, 0), (std::vector<std::int64_t>{32, 33}));
  EXPECT_EQ(micro_batch_samples(*shape, 32, 3, 0), (std::vector<std::int64_t>{38, 39}));
  EXPECT_EQ(micro_batch_samples(*shape, 32, 1, 1), (std::vector<std::int64_t>{42, 43}));
  // Every sample of the global batch is read exactly once.
  std::vector<int> seen(16, 0);
  for (int d = 0; d < 4; ++d)
    for (int m = 0; m < 2; ++m)
      for (auto s : micro_batch_samples(*shape, 0, d, m)) ++seen[static_cast<std::size_t>(s)];
  EXPECT_EQ(seen, std::vector<int>(16, 1));
}

TEST(MicroBatchesTest, RefusesABatchThatDoesNotDivide) {
  EXPECT_TRUE(
      fails_with(make_batch_shape(2, 12, 4),
                 "global batch size (12) is not divisible by micro batch size (2) times data parallel size (4)"));
}

class FixedSamples : public data::SampleSource {
 public:
  std::size_t size() const override { return 2; }
  Result<data::Sample> sample(std::size_t i) const override {
    if (i == 0) return data::Sample{{5, 6, 7, 8, 9}, {2, 3}};
    return data::Sample{{1, 2, 0, -1, -1}, {3}};  // padded past the data's end (pad id -1)
  }
};

TEST(MicroBatchesTest, SamplesBecomeShiftedTokensAndLabelsWithMaskedPadding) {
  BatchOptions options;
  options.sequence_length = 4;
  auto batch = read_token_batch(FixedSamples(), {0, 1}, options);
  ASSERT_TRUE(batch.ok()) << batch.status().message();
  EXPECT_TRUE(at::equal(batch->tokens, at::tensor({5, 6, 7, 8, 1, 2, 0, 0}, at::kLong).view({2, 4})));
  EXPECT_TRUE(at::equal(batch->labels, at::tensor({6, 7, 8, 9, 2, 0, 0, 0}, at::kLong).view({2, 4})));
  EXPECT_TRUE(at::equal(batch->loss_mask, at::tensor(std::vector<float>{1, 1, 1, 1, 1, 1, 0, 0}).view({2, 4})));
  EXPECT_TRUE(at::equal(batch->positions[1], at::arange(4, at::kLong)));
  options.eod_mask_loss = true;
  options.eod_token_id = 0;
  batch = read_token_batch(FixedSamples(), {1}, options);
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(at::equal(batch->loss_mask, at::tensor(std::vector<float>{1, 1, 0, 0}).view({1, 4})));

  EXPECT_TRUE(fails_with(read_token_batch(FixedSamples(), {2}, options), "sample 2 is past the dataset's 2 samples"));
  options.sequence_length = 5;
  EXPECT_TRUE(fails_with(read_token_batch(FixedSamples(), {0}, options), "has 5 tokens; sequence length 5 needs 6"));
}

// --reset-attention-mask: a token's document is the number of end-of-document tokens before it (the end token itself
// closes its own document), found before padding ids become 0, as Megatron's masks are made.
TEST(MicroBatchesTest, DocumentsCountTheEndOfDocumentTokensBeforeEachToken) {
  BatchOptions options;
  options.sequence_length = 4;
  auto batch = read_token_batch(FixedSamples(), {0, 1}, options);
  ASSERT_TRUE(batch.ok());
  EXPECT_FALSE(batch->documents.defined());
  options.reset_attention_mask = true;
  options.eod_token_id = 6;
  batch = read_token_batch(FixedSamples(), {0, 1}, options);
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(at::equal(batch->documents, at::tensor({0, 0, 1, 1, 0, 0, 0, 0}, at::kLong).view({2, 4})));
  options.eod_token_id = 0;  // sample 1: tokens 1 2 0 -1, the pad (-1) replaced by 0 after the documents are found
  batch = read_token_batch(FixedSamples(), {1}, options);
  ASSERT_TRUE(batch.ok());
  EXPECT_TRUE(at::equal(batch->documents, at::tensor({0, 0, 0, 1}, at::kLong).view({1, 4})));
  EXPECT_TRUE(at::equal(batch->tokens, at::tensor({1, 2, 0, 0}, at::kLong).view({1, 4})));
}

// --dataloader-inter-document-masking: megatron-core's GPTDataset (inter_document_masking) takes the extra token off
// the last document part, folds padding into the last document, and restarts the positions at each document.
TEST(MicroBatchesTest, DatasetDocumentsMaskAttentionAndRestartPositions) {
  auto parts = sample_documents({3, 2, 3}, 7);  // 8 tokens read: the last part loses the extra one
  ASSERT_TRUE(parts.ok()) << parts.status().message();
  EXPECT_EQ(parts->documents, (std::vector<std::int64_t>{0, 0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(parts->positions, (std::vector<std::int64_t>{0, 1, 2, 0, 1, 0, 1}));
  parts = sample_documents({4, 1}, 4);  // the last part held only the extra token: it is dropped
  ASSERT_TRUE(parts.ok());
  EXPECT_EQ(parts->documents, (std::vector<std::int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(parts->positions, (std::vector<std::int64_t>{0, 1, 2, 3}));
  parts = sample_documents({2, 0, 3}, 4);  // an empty part in between numbers no token
  ASSERT_TRUE(parts.ok());
  EXPECT_EQ(parts->documents, (std::vector<std::int64_t>{0, 0, 2, 2}));
  // Padded past the data's end: 2 + 1 tokens read for 6 positions. megatron-core still takes one off the last part,
  // which empties it, so its real token joins the padding in the first document's continuation.
  parts = sample_documents({2, 1}, 6);
  ASSERT_TRUE(parts.ok());
  EXPECT_EQ(parts->documents, (std::vector<std::int64_t>(6, 0)));
  EXPECT_EQ(parts->positions, (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_TRUE(fails_with(sample_documents({3, 3}, 4), "its document parts hold 6 tokens, more than the sequence's 5"));
  EXPECT_TRUE(fails_with(sample_documents({3, -1}, 4), "a document part of negative length -1"));

  BatchOptions options;  // FixedSamples: sample 0 read as parts of 2 and 3 tokens, sample 1 as 3 tokens, padded
  options.sequence_length = 4;
  options.inter_document_masking = true;
  options.reset_attention_mask = true;  // no effect beside it, as in Megatron (its documents: 0 1 1 1 for sample 0)
  options.eod_token_id = 5;
  auto batch = read_token_batch(FixedSamples(), {0, 1}, options);
  ASSERT_TRUE(batch.ok()) << batch.status().message();
  EXPECT_TRUE(at::equal(batch->documents, at::tensor({0, 0, 1, 1, 0, 0, 0, 0}, at::kLong).view({2, 4})));
  EXPECT_TRUE(at::equal(batch->positions, at::tensor({0, 1, 0, 1, 0, 1, 2, 3}, at::kLong).view({2, 4})));
  EXPECT_TRUE(at::equal(batch->tokens, at::tensor({5, 6, 7, 8, 1, 2, 0, 0}, at::kLong).view({2, 4})));
}

// --rampup-batch-size (megatron-core 0.16's calculator) and --step-batch-size-schedule (0.19's), with Megatron-LM's
// iteration counts for --train-samples.
TEST(MicroBatchesTest, GlobalBatchRampUpAndStepSchedule) {
  const BatchRampup rampup{4, 2, 24};  // to 8: two increments, 12 samples each
  ASSERT_TRUE(check_batch_rampup(rampup, 8).ok());
  std::vector<std::int64_t> sizes;
  for (const std::int64_t consumed : {0, 11, 12, 23, 24, 25, 1000})
    sizes.push_back(ramped_global_batch(rampup, 8, consumed));
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{4, 4, 6, 6, 8, 8, 8}));
  EXPECT_EQ(*rampup_train_iterations(rampup, 8, 80), 12);  // 4 4 4 6 6 8 (32 samples), then 6 batches of 8
  EXPECT_TRUE(fails_with(check_batch_rampup({3, 2, 24}, 8),
                         "interval (5) to be divisible by global batch size "
                         "increment (2)"));
  EXPECT_TRUE(fails_with(check_batch_rampup({8, 2, 24}, 8), "must be below --global-batch-size 8"));
  EXPECT_TRUE(fails_with(check_batch_rampup({4, 2, 0}, 8), "must be positive"));

  auto steps = parse_step_batch_size_schedule("256:4, 0:2 0.768K:8", 32);  // tokens over 32-token samples
  ASSERT_TRUE(steps.ok()) << steps.status().message();
  EXPECT_EQ(steps->steps, (std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 2}, {8, 4}, {24, 8}}));
  sizes.clear();
  for (const std::int64_t consumed : {0, 7, 8, 23, 24, 99}) sizes.push_back(stepped_global_batch(*steps, consumed));
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{2, 2, 4, 4, 8, 8}));
  EXPECT_EQ(*step_schedule_train_iterations(*steps, 64), 13);  // 4 of 2, 4 of 4, 5 of 8
  auto big = parse_step_batch_size_schedule("0:768 250B:1.5K", 4096);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->steps.back(), (std::pair<std::int64_t, std::int64_t>{61035156, 1500}));
  EXPECT_TRUE(fails_with(parse_step_batch_size_schedule("32:2", 32), "first schedule entry must have threshold 0"));
  EXPECT_TRUE(fails_with(parse_step_batch_size_schedule("0:2 16:4", 32), "strictly increasing"));
  EXPECT_TRUE(fails_with(parse_step_batch_size_schedule("0:2 64", 32), "expected THRESHOLD:BATCH_SIZE"));
  EXPECT_TRUE(fails_with(parse_step_batch_size_schedule("0:2 0x40:4", 32), "is not two numbers"));
  EXPECT_TRUE(fails_with(parse_step_batch_size_schedule("0:0", 32), "batch size must be positive"));
  EXPECT_TRUE(fails_with(parse_step_batch_size_schedule(" ", 32), "at least one entry"));
  // Schedules counted one iteration at a time are refused past the limit (a billion by default) rather than hang.
  EXPECT_TRUE(fails_with(rampup_train_iterations({1, 1, 4'000'000'000}, 2, 8'000'000'000, 1000), "more than 1000"));
  EXPECT_TRUE(fails_with(step_schedule_train_iterations(*parse_step_batch_size_schedule("0:1", 1), 2000, 1000),
                         "more than 1000 iterations"));
  EXPECT_EQ(*step_schedule_train_iterations(*parse_step_batch_size_schedule("0:1", 1), 1000, 1000), 1000);
}

TEST(MicroBatchesTest, RefusesTokenIdsOutsideTheVocabulary) {
  // A dataset tokenized for another model: ids past the vocabulary were masked to zeros by the vocab-parallel
  // embedding and trained on without a word (the loss sat at ln(vocab)). The pad id past the data's end is no token.
  BatchOptions options;
  options.sequence_length = 4;
  options.vocab_size = 9;
  EXPECT_TRUE(read_token_batch(FixedSamples(), {1}, options).ok());
  EXPECT_TRUE(fails_with(read_token_batch(FixedSamples(), {1, 0}, options),
                         "sample 0 holds token id 9 at position 4, outside the model's vocabulary [0, 9)"));
  options.vocab_size = 10;
  EXPECT_TRUE(read_token_batch(FixedSamples(), {0, 1}, options).ok());
}

// --data-path's weights: Megatron normalises them, so each must be a finite number above 0 (a negative one was
// reported as the dataset's "negative sample count", NaN and infinities likewise).
TEST(DataPathTest, WeightsMustBeFiniteAndPositive) {
  auto blend = data::parse_data_path({"0.3", "a", "0.7", "b"});
  ASSERT_TRUE(blend.ok()) << blend.status().message();
  EXPECT_EQ(blend->weights, (std::vector<double>{0.3, 0.7}));
  for (const char* bad : {"-1", "0", "nan", "inf"})
    EXPECT_TRUE(fails_with(data::parse_data_path({bad, "a", "1", "b"}),
                           std::string("the weight of 'a' is ") + bad + "; weights must be finite numbers above 0"));
  EXPECT_TRUE(fails_with(data::parse_data_path({"1e308", "a", "1e308", "b"}), "the weights' sum overflows"));
  blend = data::parse_data_path({"a", "b"});
  ASSERT_TRUE(blend.ok());
  EXPECT_FALSE(blend->weights.has_value()) << "prefixes alone blend by size";
  // Weights are read as Python's float() reads them: a subnormal is a weight; hexadecimal is not a number, so every
  // word is a prefix (strtod read 0x10 as 16).
  blend = data::parse_data_path({"1e-320", "a", "1", "b"});
  ASSERT_TRUE(blend.ok()) << blend.status().message();
  ASSERT_TRUE(blend->weights.has_value());
  EXPECT_GT((*blend->weights)[0], 0.0);
  blend = data::parse_data_path({"0x10", "a", "1", "b"});
  ASSERT_TRUE(blend.ok());
  EXPECT_FALSE(blend->weights.has_value());
  EXPECT_EQ(blend->prefixes, (std::vector<std::string>{"0x10", "a", "1", "b"}));
}

TEST(GradBucketsTest, GradientsAccumulateInPlaceIntoTheBuckets) {
  std::vector<at::Tensor> params = {at::ones({3, 2}).requires_grad_(true), at::ones({4}).requires_grad_(true),
                                    at::ones({5}).requires_grad_(true)};
  auto buckets = GradBuckets::create(params, nullptr, 1, /*bucket_elements=*/6, "test group", at::kFloat);
  ASSERT_TRUE(buckets.ok()) << buckets.status().message();
  // Reverse order: [p2 (5), p1 (4)] reach 6 elements, then [p0 (6)].
  EXPECT_EQ((*buckets)->bucket_count(), 2u);
  EXPECT_EQ((*buckets)->buffer().numel(), 15);
  (*buckets)->zero();
  for (int micro = 0; micro < 2; ++micro) {
    if (micro == 1) (*buckets)->arm();
    ((params[0] * 2).sum() + (params[1] * 3).sum() + (params[2] * params[2]).sum()).backward();
  }
  ASSERT_TRUE((*buckets)->finish().ok());
  EXPECT_TRUE(at::equal(params[0].grad(), at::full({3, 2}, 4.0f)));
  EXPECT_TRUE(at::equal(params[1].grad(), at::full({4}, 6.0f)));
  EXPECT_TRUE(at::equal(params[2].grad(), at::full({5}, 4.0f)));
  // The gradients are the buffer's memory.
  EXPECT_EQ((*buckets)->buffer().sum().item<float>(), 6 * 4.0f + 4 * 6.0f + 5 * 4.0f);
  (*buckets)->zero();
  EXPECT_EQ(params[1].grad().abs().sum().item<float>(), 0.0f);
}

// --check-for-nan-in-loss-and-grad's local check: the buckets whose gradients held a NaN or Inf as they started their
// reduction, reset by zero().
TEST(GradBucketsTest, NamesTheBucketsWithNonFiniteGradients) {
  std::vector<at::Tensor> params = {at::ones({3, 2}).requires_grad_(true), at::ones({4}).requires_grad_(true),
                                    at::ones({5}).requires_grad_(true)};
  auto buckets = GradBuckets::create(params, nullptr, 1, /*bucket_elements=*/6, "test group", at::kFloat);
  ASSERT_TRUE(buckets.ok()) << buckets.status().message();
  (*buckets)->check_nonfinite(true);
  auto step = [&](double p0_scale) {
    (*buckets)->zero();
    (*buckets)->arm();
    ((params[0] * p0_scale).sum() + (params[1] * 3).sum() + (params[2] * params[2]).sum()).backward();
    return (*buckets)->finish();
  };
  ASSERT_TRUE(step(2).ok());
  EXPECT_TRUE((*buckets)->nonfinite_buckets().empty());
  ASSERT_TRUE(step(std::numeric_limits<double>::infinity()).ok());  // p0 is alone in bucket 1
  EXPECT_EQ((*buckets)->nonfinite_buckets(), std::vector<std::size_t>{1});
  (*buckets)->poison_next_step_for_test();
  ASSERT_TRUE(step(2).ok());
  EXPECT_EQ((*buckets)->nonfinite_buckets(), std::vector<std::size_t>{0});
  ASSERT_TRUE(step(2).ok());
  EXPECT_TRUE((*buckets)->nonfinite_buckets().empty());
}

// Gradient accumulation fusion: a fused linear's weight gradient is GEMM-accumulated straight into its place in the
// buffer (the first micro-batch after zero() overwrites whatever was there), equal to autograd's; x's and the bias's
// gradients still come through autograd, and a fused weight that received nothing in an iteration reads zero.
TEST(GradBucketsTest, FusedLinearAccumulatesItsWeightGradientIntoTheBuffer) {
  at::manual_seed(7);
  const at::Tensor w0 = at::randn({5, 3}), b0 = at::randn({5});
  std::vector<at::Tensor> params = {w0.clone().requires_grad_(true), b0.clone().requires_grad_(true)};
  auto buckets = GradBuckets::create(params, nullptr, 1, /*bucket_elements=*/100, "test group", at::kFloat);
  ASSERT_TRUE(buckets.ok()) << buckets.status().message();
  WeightGradSink* sink = (*buckets)->fused_sink(params[0]);
  ASSERT_NE(sink, nullptr);
  EXPECT_EQ((*buckets)->fused_sink(params[0]), sink);
  EXPECT_EQ((*buckets)->fused_sink(at::ones({5, 3})), nullptr);
  const at::Tensor w_ref = w0.clone().requires_grad_(true), b_ref = b0.clone().requires_grad_(true);
  for (int iteration = 0; iteration < 2; ++iteration) {
    (*buckets)->buffer().fill_(7.0f);  // stale contents the fused write must replace
    (*buckets)->zero();
    if (w_ref.grad().defined()) w_ref.mutable_grad().zero_(), b_ref.mutable_grad().zero_();
    at::Tensor x_grad, x_ref_grad;
    for (int micro = 0; micro < 3; ++micro) {
      if (micro == 2) (*buckets)->arm();
      const at::Tensor x = at::randn({2, 4, 3}).requires_grad_(true), x_ref = x.detach().clone().requires_grad_(true);
      const at::Tensor target = at::randn({2, 4, 5});
      (fused_linear(x, params[0], sink, params[1]) * target).sum().backward();
      (at::linear(x_ref, w_ref, b_ref) * target).sum().backward();
      EXPECT_TRUE(at::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6));
    }
    ASSERT_TRUE((*buckets)->finish().ok());
    EXPECT_TRUE(at::allclose((*buckets)->grads()[0], w_ref.grad(), 1e-5, 1e-5))
        << (*buckets)->grads()[0] << w_ref.grad();
    EXPECT_TRUE(at::allclose((*buckets)->grads()[1], b_ref.grad(), 1e-5, 1e-5));
  }
  // An iteration in which only the bias saw a gradient: the fused weight's stale 7s are zeroed by finish().
  (*buckets)->buffer().fill_(7.0f);
  (*buckets)->zero();
  (*buckets)->arm();
  params[1].sum().backward();
  ASSERT_TRUE((*buckets)->finish().ok());
  EXPECT_EQ((*buckets)->grads()[0].abs().sum().item<float>(), 0.0f);
  EXPECT_TRUE(at::equal((*buckets)->grads()[1], at::ones({5})));
}

// bf16 parameters with fp32 main grads (Megatron's default for bf16): each micro-batch's bf16 gradient is added into
// fp32, so sums that bf16 cannot hold survive, and the parameters keep no gradient of their own.
TEST(GradBucketsTest, Bf16GradientsAccumulateInFp32) {
  std::vector<at::Tensor> params = {at::ones({4}, at::kBFloat16).requires_grad_(true)};
  auto buckets = GradBuckets::create(params, nullptr, 1, /*bucket_elements=*/100, "test group", at::kFloat);
  ASSERT_TRUE(buckets.ok()) << buckets.status().message();
  EXPECT_EQ((*buckets)->buffer().scalar_type(), at::kFloat);
  (*buckets)->zero();
  // 256 + 1 + 1 + ... : in bf16 (8 bits of mantissa) each +1 onto 256 rounds away; in fp32 they add up.
  ((params[0] * 256.0).sum()).backward();
  for (int micro = 0; micro < 8; ++micro) {
    if (micro == 7) (*buckets)->arm();
    params[0].sum().backward();
  }
  ASSERT_TRUE((*buckets)->finish().ok());
  EXPECT_FALSE(params[0].grad().defined());
  EXPECT_TRUE(at::equal((*buckets)->grads()[0], at::full({4}, 264.0f)));
  // Without fp32 accumulation the same sum stays at 256.
  std::vector<at::Tensor> narrow = {at::ones({4}, at::kBFloat16).requires_grad_(true)};
  auto in_bf16 = GradBuckets::create(narrow, nullptr, 1, 100, "test group", at::kBFloat16);
  ASSERT_TRUE(in_bf16.ok());
  (*in_bf16)->zero();
  ((narrow[0] * 256.0).sum()).backward();
  for (int micro = 0; micro < 8; ++micro) narrow[0].sum().backward();
  ASSERT_TRUE((*in_bf16)->finish().ok());
  EXPECT_EQ(narrow[0].grad().to(at::kFloat)[0].item<float>(), 256.0f);
}

GptModelSpec tiny_spec() {
  GptModelSpec s;
  s.num_layers = 2;
  s.hidden_size = 16;
  s.ffn_hidden_size = 24;
  s.num_attention_heads = 4;
  s.num_query_groups = 2;
  s.kv_channels = 4;
  s.vocab_size = 50;
  s.add_qkv_bias = true;
  return s;
}

ModelParameters allocate(const GptModelSpec& spec, int tp, int rank) {
  auto tensors = canonical_tensors(spec);
  EXPECT_TRUE(tensors.ok());
  auto p = ModelParameters::allocate(*tensors, {tp, rank}, padded_vocab_size(spec.vocab_size, 128, tp), false,
                                     at::TensorOptions().dtype(at::kFloat));
  EXPECT_TRUE(p.ok()) << p.status().message();
  return std::move(*p);
}

TEST(ModelInitTest, TheSameModelAtEveryTensorParallelSize) {
  const GptModelSpec spec = tiny_spec();
  InitOptions init;
  init.num_layers = spec.num_layers;
  ModelParameters whole = allocate(spec, 1, 0);
  ASSERT_TRUE(initialize_parameters(whole, init).ok());
  for (int rank = 0; rank < 2; ++rank) {
    ModelParameters half = allocate(spec, 2, rank);
    ASSERT_TRUE(initialize_parameters(half, init).ok());
    for (std::size_t i = 0; i < half.all().size(); ++i) {
      const auto& piece = half.all()[i];
      const at::Tensor full = whole.all()[i].tensor.detach();
      std::int64_t row = 0;
      for (const Box& box : piece.boxes) {
        at::Tensor expected = full;
        for (std::size_t d = 0; d < box.shape.size(); ++d)
          expected = expected.narrow(static_cast<std::int64_t>(d), box.offset[d], box.shape[d]);
        ASSERT_TRUE(at::equal(piece.tensor.detach().narrow(0, row, box.shape[0]), expected)) << piece.name();
        row += box.shape[0];
      }
    }
  }
  // Megatron's rules: norms one, biases zero, output projections with the smaller deviation.
  EXPECT_TRUE(at::equal(whole.get("decoder.final_layernorm.weight").detach(), at::ones({16})));
  EXPECT_EQ(whole.get("decoder.layers.0.self_attention.linear_qkv.bias").detach().abs().max().item<float>(), 0.0f);
  const double fc2 = whole.get("decoder.layers.1.mlp.linear_fc2.weight").detach().std().item<double>();
  const double fc1 = whole.get("decoder.layers.1.mlp.linear_fc1.weight").detach().std().item<double>();
  EXPECT_NEAR(fc1, 0.02, 0.004);
  EXPECT_NEAR(fc2, 0.01, 0.003);  // 0.02 / sqrt(2 · 2 layers)
  // A Mamba hybrid (megatron-core's is_hybrid_model): output layers at std / sqrt(layers), the same draws sqrt(2)
  // wider.
  InitOptions hybrid = init;
  hybrid.hybrid = true;
  ModelParameters hybrid_model = allocate(spec, 1, 0);
  ASSERT_TRUE(initialize_parameters(hybrid_model, hybrid).ok());
  EXPECT_TRUE(at::allclose(hybrid_model.get("decoder.layers.1.mlp.linear_fc2.weight").detach(),
                           whole.get("decoder.layers.1.mlp.linear_fc2.weight").detach() * std::sqrt(2.0)));
  EXPECT_TRUE(at::equal(hybrid_model.get("decoder.layers.1.mlp.linear_fc1.weight").detach(),
                        whole.get("decoder.layers.1.mlp.linear_fc1.weight").detach()));
  // Megatron's --embedding-init-method-std: the word embeddings alone take it.
  init.embedding_init_method_std = 0.5;
  ModelParameters wide = allocate(spec, 1, 0);
  ASSERT_TRUE(initialize_parameters(wide, init).ok());
  EXPECT_NEAR(wide.get("embedding.word_embeddings.weight").detach().narrow(0, 0, 50).std().item<double>(), 0.5, 0.05);
  EXPECT_TRUE(at::equal(wide.get("decoder.layers.1.mlp.linear_fc1.weight").detach(),
                        whole.get("decoder.layers.1.mlp.linear_fc1.weight").detach()));
}

TEST(TrainCheckpointTest, RoundTripAtAnotherLayout) {
  testing::TempDir dir;
  const GptModelSpec spec = tiny_spec();
  InitOptions init;
  init.num_layers = spec.num_layers;
  init.seed = 7;
  // Save from tp 1 (one rank), with optimizer state that differs from the weights.
  ModelParameters saved = allocate(spec, 1, 0);
  ASSERT_TRUE(initialize_parameters(saved, init).ok());
  std::vector<OptimizedParameter> optimized;
  for (auto& p : saved.all()) optimized.push_back({p.name(), p.tensor, true});
  AdamW optimizer(optimized, {});
  for (std::size_t i = 0; i < saved.all().size(); ++i) {
    optimizer.exp_avg(i).fill_(0.5 + static_cast<double>(i));
    optimizer.exp_avg_sq(i).fill_(0.25);
    optimizer.fp32_param(i).add_(1.0);
  }
  optimizer.set_steps(10);
  at::manual_seed(99);
  const std::string rng = rng_state(at::kCPU);
  TrainingCheckpoint checkpoint;
  checkpoint.root = dir.path().string();
  ParallelLayout layout;
  checkpoint.layout = layout_sizes_to_json(layout);
  checkpoint.progress.iteration = 10;
  checkpoint.progress.consumed_train_samples = 80;
  checkpoint.progress.scheduler = {{"num_steps", 80}};
  SoloCollective solo;
  AsyncSaver saver(1);
  ASSERT_TRUE(save_training_checkpoint_async(saver, solo, checkpoint, saved, &optimizer, whole_optimizer_slices(saved), {}).ok());
  ASSERT_TRUE(saver.finalize().ok());

  // Load into rank 1 of tp 2.
  ModelParameters loaded = allocate(spec, 2, 1);
  std::vector<OptimizedParameter> loaded_optimized;
  for (auto& p : loaded.all()) loaded_optimized.push_back({p.name(), p.tensor, true});
  AdamW loaded_optimizer(loaded_optimized, {});
  auto reader = CheckpointReader::open(dir.path().string());
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  at::manual_seed(1);
  TrainingLoadOptions options;
  options.rank = 0;
  options.layout = checkpoint.layout;  // the same layout JSON: the RNG state loads
  auto result = load_training_checkpoint(*reader, loaded, loaded_optimizer, whole_optimizer_slices(loaded), options);
  ASSERT_TRUE(result.ok()) << result.status().message();
  EXPECT_TRUE(result->optimizer_loaded);
  EXPECT_TRUE(result->rng_loaded);
  EXPECT_EQ(rng_state(at::kCPU), rng);
  EXPECT_EQ(result->progress.iteration, 10);
  EXPECT_EQ(result->progress.consumed_train_samples, 80);
  EXPECT_EQ(loaded_optimizer.steps(), 10);
  for (std::size_t i = 0; i < loaded.all().size(); ++i) {
    const auto& piece = loaded.all()[i];
    std::int64_t row = 0;
    for (const Box& box : piece.boxes) {
      at::Tensor expected = optimizer.exp_avg(i);
      at::Tensor master = optimizer.fp32_param(i);
      for (std::size_t d = 0; d < box.shape.size(); ++d) {
        expected = expected.narrow(static_cast<std::int64_t>(d), box.offset[d], box.shape[d]);
        master = master.narrow(static_cast<std::int64_t>(d), box.offset[d], box.shape[d]);
      }
      const auto rows = [&](const at::Tensor& t) { return t.dim() == 0 ? t : t.narrow(0, row, box.shape[0]); };
      ASSERT_TRUE(at::equal(rows(loaded_optimizer.exp_avg(i)), expected)) << piece.name();
      // The parameters take the masters (fp32_param), not the saved weights.
      ASSERT_TRUE(at::equal(rows(piece.tensor.detach()), master)) << piece.name();
      if (piece.tensor.dim() > 0) row += box.shape[0];
    }
  }
}

}  // namespace
}  // namespace trestle::train
