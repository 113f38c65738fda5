// The model's pieces on one rank (tp 1, no processes): vocabulary-parallel cross-entropy against at::cross_entropy,
// RoPE scalings, full recompute against plain autograd, the parameter pieces and what create refuses. The
// multi-rank comparisons against transformers are tests/interop/test_model_transformers.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cmath>
#include <string>

#include "tests/support/status_matchers.h"
#include "train/model/gpt_model.h"
#include "train/model/rope.h"
#include "train/model/transformer_layer.h"
#include "train/model/vocab_parallel.h"

namespace trestle::train {
namespace {

// A group's backend for create's checks only: it runs no collective.
class NoCollectives : public c10d::Backend {
 public:
  NoCollectives(int rank, int size) : c10d::Backend(rank, size) {}
};

GptModelSpec tiny_spec() {
  GptModelSpec s;
  s.num_layers = 2;
  s.hidden_size = 32;
  s.ffn_hidden_size = 48;
  s.num_attention_heads = 4;
  s.num_query_groups = 2;
  s.kv_channels = 8;
  s.vocab_size = 100;
  s.add_qkv_bias = true;
  s.qk_layernorm = true;
  s.window_size = 3;
  return s;
}

TEST(VocabParallelTest, CrossEntropyIsTorchsOverTheRealVocabulary) {
  at::manual_seed(1);
  const TpGroup single = TpGroup::single();
  const VocabRange range = vocab_range(100, 128, single);
  EXPECT_EQ(range.rows, 128);
  EXPECT_EQ(range.valid, 100);
  at::Tensor logits = at::randn({5, 3, 128}).requires_grad_(true);
  at::Tensor targets = at::randint(0, 100, {5, 3}, at::kLong);
  at::Tensor loss = vocab_parallel_cross_entropy(logits, targets, range, single);
  loss.sum().backward();

  at::Tensor reference_logits = logits.detach().narrow(-1, 0, 100).clone().requires_grad_(true);
  at::Tensor reference =
      at::cross_entropy_loss(reference_logits.reshape({15, 100}), targets.reshape({15}), {}, at::Reduction::None)
          .reshape({5, 3});
  reference.sum().backward();
  EXPECT_LT((loss - reference).abs().max().item<float>(), 1e-5);
  EXPECT_LT((logits.grad().narrow(-1, 0, 100) - reference_logits.grad()).abs().max().item<float>(), 1e-6);
  EXPECT_EQ(logits.grad().narrow(-1, 100, 28).abs().max().item<float>(), 0.0f);
}

TEST(VocabParallelTest, EmbeddingZeroesIdsOutsideTheRows) {
  const VocabRange range{4, 4, 4};
  at::Tensor weight = at::arange(8, at::kFloat).view({4, 2}) + 1;
  at::Tensor out = vocab_parallel_embedding_partial(at::tensor({0, 4, 7, 8}, at::kLong).view({1, 4}), weight, range);
  EXPECT_TRUE(at::equal(out[0][0], at::zeros({2})));
  EXPECT_TRUE(at::equal(out[0][1], weight[0]));
  EXPECT_TRUE(at::equal(out[0][2], weight[3]));
  EXPECT_TRUE(at::equal(out[0][3], at::zeros({2})));
}

TEST(RopeTest, ScalingsChangeTheRightFrequencies) {
  GptModelSpec s = tiny_spec();
  s.kv_channels = 64;
  const at::Tensor plain = rope_inverse_frequencies(s);
  EXPECT_FLOAT_EQ(plain[0].item<float>(), 1.0f);
  s.rope_scaling = {RopeScalingType::kLinear, 4.0};
  EXPECT_TRUE(at::allclose(rope_inverse_frequencies(s), plain / 4));
  s.rope_scaling = {RopeScalingType::kLlama3, 8.0, 1.0, 4.0, 64};
  const at::Tensor llama3 = rope_inverse_frequencies(s);
  // Wavelengths below 64 / 4 are kept, above 64 / 1 divided by 8.
  EXPECT_FLOAT_EQ(llama3[0].item<float>(), plain[0].item<float>());
  EXPECT_FLOAT_EQ(llama3[31].item<float>(), plain[31].item<float>() / 8);
  EXPECT_LT(llama3[10].item<float>(), plain[10].item<float>());
}

// Partial rotary (GLM-4.5's partial_rotary_factor): the frequencies of the rotated dims only, 1 / base^(2i / rot_dim)
// as Megatron-Core and transformers compute them; the rotation of the first rot_dim dims is a whole-head RoPE of that
// slice, the other dims pass through, and the fused kernel gives the composite's values and gradients.
TEST(RopeTest, ProportionalRotatesTheFirstPairsAtTheWholeHeadsFrequencies) {
  // Gemma 4's full-attention layers: a quarter of a 32-dim head's 16 pairs rotate, at 1 / base^(2i / 32); the pairs
  // (i, i + 16) past them pass through, fused or not.
  const at::Tensor inv_freq = proportional_rope_inverse_frequencies(1e6, 32, 0.25);
  ASSERT_EQ(inv_freq.numel(), 16);
  for (int i = 0; i < 16; ++i)
    EXPECT_FLOAT_EQ(inv_freq[i].item<float>(), i < 4 ? std::pow(1e6f, -2.0f * i / 32.0f) : 0.0f) << i;
  EXPECT_TRUE(at::equal(proportional_rope_inverse_frequencies(1e4, 16, 1.0), [] {
    GptModelSpec plain = tiny_spec();
    plain.kv_channels = 16;
    return rope_inverse_frequencies(plain);
  }()));
  at::manual_seed(4);
  const at::Tensor positions = at::arange(5, at::kLong).unsqueeze(0).expand({2, 5});
  const RopeTables tables = rope_tables(inv_freq, positions);
  const at::Tensor x = at::randn({5, 2, 3, 32}, at::kFloat);
  for (const bool fused : {false, true}) {
    const at::Tensor y = apply_rope(x, tables, fused);
    for (const std::int64_t still : {4, 20}) EXPECT_TRUE(at::allclose(y.narrow(-1, still, 12), x.narrow(-1, still, 12)));
    EXPECT_FALSE(at::allclose(y.narrow(-1, 1, 3), x.narrow(-1, 1, 3)));
  }
}

TEST(RopeTest, PartialRotaryRotatesTheFirstDimsOnly) {
  GptModelSpec s = tiny_spec();
  s.kv_channels = 16;
  s.rotary_percent = 0.5;
  ASSERT_EQ(s.rotary_dim(), 8);
  const at::Tensor inv_freq = rope_inverse_frequencies(s);
  ASSERT_EQ(inv_freq.numel(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(inv_freq[i].item<float>(), std::pow(10000.0f, -2.0f * i / 8.0f));
  at::manual_seed(3);
  const at::Tensor positions = at::arange(6, at::kLong).unsqueeze(0).expand({2, 6});
  const RopeTables tables = rope_tables(inv_freq, positions);
  const at::Tensor x = at::randn({6, 2, 4, 16}, at::kFloat).requires_grad_(true);
  const at::Tensor y = apply_rope(x, tables);
  EXPECT_TRUE(at::equal(y.narrow(-1, 8, 8), x.narrow(-1, 8, 8)));
  EXPECT_TRUE(at::allclose(y.narrow(-1, 0, 8), apply_rope(x.narrow(-1, 0, 8), tables)));
  EXPECT_FALSE(at::allclose(y.narrow(-1, 0, 8), x.narrow(-1, 0, 8)));
  const at::Tensor xf = x.detach().clone().requires_grad_(true);
  const at::Tensor yf = apply_rope(xf, tables, /*fused=*/true);
  EXPECT_TRUE(at::allclose(yf, y, 1e-6, 1e-6));
  const at::Tensor dy = at::randn_like(y);
  y.backward(dy);
  yf.backward(dy);
  EXPECT_TRUE(at::allclose(xf.grad(), x.grad(), 1e-6, 1e-6));
  EXPECT_TRUE(at::equal(x.grad().narrow(-1, 8, 8), dy.narrow(-1, 8, 8)));
  s.rotary_percent = 0.3;  // floor(16 · 0.3) = 4, as int() of the same product in both references
  EXPECT_EQ(s.rotary_dim(), 4);
}

std::unique_ptr<GptModel> random_model(const GptModelSpec& spec, bool recompute, bool fused_kernels = false) {
  ModelOptions options;
  options.recompute = recompute;
  options.fused_kernels = fused_kernels;
  auto model = GptModel::create(spec, ParallelLayout{}, TpGroup::single(), options);
  EXPECT_TRUE(model.ok()) << model.status().message();
  at::manual_seed(7);
  at::NoGradGuard no_grad;
  (*model)->parameter_store().storage().normal_(0, 0.2);
  return std::move(*model);
}

// add_then_norm: without a delta, x itself and its norm; with one, the fused node and the composite steps agree
// (values within a rounding), in both norm forms.
TEST(GptModelTest, AddThenNormWithoutADeltaIsTheNormAlone) {
  at::manual_seed(5);
  for (const bool zero_centered : {false, true})
    for (const bool fused : {false, true}) {
      GptModelSpec spec = tiny_spec();
      spec.zero_centered_norms = zero_centered;
      const std::string what = std::string(zero_centered ? "(1 + w)" : "w") + (fused ? " fused" : " composite");
      const at::Tensor x = at::randn({3, 2, 32}), delta = at::randn({3, 2, 32}), w = at::randn({32}) * 0.2 + 1;
      const NormedResidual alone = add_then_norm(x, at::Tensor(), w, spec, fused);
      EXPECT_TRUE(alone.sum.is_same(x)) << what;
      EXPECT_TRUE(at::allclose(alone.normed, model_norm(x, w, spec, fused), 1e-6, 1e-6)) << what;
      const NormedResidual both = add_then_norm(x, delta, w, spec, fused);
      EXPECT_TRUE(at::equal(both.sum, x + delta)) << what;
      EXPECT_TRUE(at::allclose(both.normed, model_norm(x + delta, w, spec, false), 1e-5, 1e-5)) << what;
    }
}

// The fused kernels (norms, gated units, soft-caps, RoPE) give the composites' loss and gradients: a Llama-like model
// with q/k norms and windows, Gemma 2's form ((1 + w) norms before and after, GeGLU, soft-capped scores and logits),
// and multi-latent attention (RoPE on the decoupled dims, the key's shared by the heads).
TEST(GptModelTest, FusedKernelsGiveTheCompositesLossAndGradients) {
  GptModelSpec gemma = tiny_spec();
  gemma.geglu = gemma.zero_centered_norms = gemma.post_norms = true;
  gemma.attn_logit_softcapping = 3;
  gemma.final_logit_softcapping = 5;
  GptModelSpec partial = tiny_spec();  // GLM-4.5's RoPE over half of each head
  partial.kv_channels = 16;
  partial.rotary_percent = 0.5;
  GptModelSpec latent = tiny_spec();
  latent.q_lora_rank = 16;
  latent.kv_lora_rank = 8;
  latent.qk_head_dim = 8;
  latent.qk_pos_emb_head_dim = 4;
  latent.v_head_dim = 8;
  latent.num_query_groups = latent.num_attention_heads;
  latent.add_qkv_bias = latent.qk_layernorm = false;
  latent.window_size = 0;
  for (const GptModelSpec& spec : {tiny_spec(), gemma, partial, latent}) {
    at::manual_seed(5);
    at::Tensor tokens = at::randint(0, 100, {2, 8}, at::kLong);
    at::Tensor positions = at::arange(8, at::kLong).unsqueeze(0).expand({2, 8}).contiguous();
    at::Tensor labels = at::randint(0, 100, {2, 8}, at::kLong);
    std::vector<at::Tensor> losses;
    std::vector<std::unique_ptr<GptModel>> models;
    for (const bool fused : {false, true}) {
      models.push_back(random_model(spec, false, fused));
      losses.push_back(models.back()->loss(tokens, positions, labels));
      losses.back().sum().backward();
    }
    EXPECT_LT(((losses[1] - losses[0]).abs() / losses[0].abs()).max().item<double>(), 1e-6);
    auto& composite = models[0]->parameters();
    auto& fused = models[1]->parameters();
    for (std::size_t i = 0; i < composite.size(); ++i) {
      const at::Tensor a = composite[i].tensor.grad(), b = fused[i].tensor.grad();
      ASSERT_TRUE(a.defined() && b.defined()) << composite[i].name();
      // Gradients: fp32 rounding through the whole model's backward (the losses above agree to 1e-6).
      EXPECT_LT((a - b).abs().max().item<double>(), 1e-5 * (a.abs().max().item<double>() + 1e-6) + 1e-9)
          << composite[i].name();
    }
  }
}

// The two stages of `layout` (pp 2), their parameters copied from `whole`'s.
std::vector<std::unique_ptr<GptModel>> pipeline_stages(const GptModelSpec& spec, const ParallelLayout& layout,
                                                       GptModel& whole) {
  std::vector<std::unique_ptr<GptModel>> stages;
  for (int s = 0; s < 2; ++s) {
    ModelOptions options;
    options.pipeline_stage = s;
    auto stage = GptModel::create(spec, layout, TpGroup::single(), options);
    EXPECT_TRUE(stage.ok()) << stage.status().message();
    if (!stage.ok()) return {};
    at::NoGradGuard no_grad;
    for (auto& p : (*stage)->parameters()) p.tensor.copy_(whole.parameter_store().get(p.name()));
    stages.push_back(std::move(*stage));
  }
  return stages;
}

TEST(GptModelTest, RecomputeGivesTheSameLossAndGradients) {
  // A plain model; one with Gemma 4's per-layer inputs, which reach each recomputed layer as an input of its own; and
  // one whose last layer reuses the first's keys and values (an output of the first's recompute, an input of the
  // last's), with keys as values in the full-attention layers.
  GptModelSpec per_layer = tiny_spec();
  per_layer.per_layer_input_size = 4;
  per_layer.per_layer_vocab_size = per_layer.vocab_size;
  GptModelSpec shared = tiny_spec();
  shared.num_layers = 4;
  shared.add_qkv_bias = false;
  shared.mixed_attention = true;
  shared.window_layers = {true, false, true, false};
  shared.kv_shared_layers = 2;
  shared.attention_k_eq_v = true;
  for (const GptModelSpec& spec : {tiny_spec(), per_layer, shared}) {
    at::Tensor tokens = at::randint(0, 100, {2, 8}, at::kLong);
    at::Tensor positions = at::arange(8, at::kLong).unsqueeze(0).expand({2, 8}).contiguous();
    at::Tensor labels = at::randint(0, 100, {2, 8}, at::kLong);
    std::vector<at::Tensor> losses, grads;
    for (bool recompute : {false, true}) {
      auto model = random_model(spec, recompute);
      at::Tensor loss = model->loss(tokens, positions, labels);
      EXPECT_EQ(loss.sizes(), (at::IntArrayRef{2, 8}));
      loss.sum().backward();
      losses.push_back(loss.detach());
      std::vector<at::Tensor> g;
      for (auto& p : model->parameters()) {
        ASSERT_TRUE(p.tensor.grad().defined()) << p.name();
        g.push_back(p.tensor.grad().flatten());
      }
      grads.push_back(at::cat(g));
    }
    EXPECT_TRUE(at::equal(losses[0], losses[1]));
    EXPECT_GT(grads[0].abs().max().item<float>(), 0.0f);
    EXPECT_LT((grads[0] - grads[1]).abs().max().item<float>(), 1e-6);
  }
}

TEST(GptModelTest, ParametersAreTheCanonicalPieces) {
  GptModelSpec spec = tiny_spec();
  auto model = random_model(spec, false);
  auto& params = model->parameters();
  ASSERT_EQ(params.front().name(), "embedding.word_embeddings.weight");
  EXPECT_EQ(params.front().tensor.sizes(), (at::IntArrayRef{128, 32}));  // padded vocab rows
  ASSERT_EQ(params.front().boxes.size(), 1u);
  EXPECT_EQ(params.front().boxes[0].shape, (Shape{100, 32}));
  for (const auto& p : params) {
    EXPECT_TRUE(p.tensor.requires_grad()) << p.name();
    if (p.name().ends_with("linear_fc1.weight")) {
      EXPECT_EQ(p.boxes.size(), 2u);
    }
  }
  EXPECT_EQ(params.back().name(), "output_layer.weight");
}

TEST(GptModelTest, AVisionTowerIsCarriedFrozenOnTheFirstStage) {
  GptModelSpec spec = tiny_spec();
  spec.carried_tensors = {{"vision_model.patch_embed.proj.weight", {16, 3, 2, 4, 4}},
                          {"vision_model.decoder.final_layernorm.weight", {16}}};
  ParallelLayout layout;
  layout.pp = 2;
  for (int stage = 0; stage < 2; ++stage) {
    ModelOptions options;
    options.pipeline_stage = stage;
    auto model = GptModel::create(spec, layout, TpGroup::single(), options);
    ASSERT_TRUE(model.ok()) << model.status().message();
    for (const auto& p : (*model)->parameters()) EXPECT_FALSE(p.name().starts_with("vision_model.")) << p.name();
    const auto& carried = (*model)->carried_store().all();
    ASSERT_EQ(carried.size(), stage == 0 ? 2u : 0u);
    for (const auto& p : carried) EXPECT_FALSE(p.tensor.requires_grad()) << p.name();
    if (stage == 0) {
      EXPECT_EQ(carried[0].tensor.sizes(), (at::IntArrayRef{16, 3, 2, 4, 4}));
    }
  }
  // Under LoRA the tower is carried beside the frozen base, no adapter on it.
  ModelOptions lora;
  lora.lora = LoraConfig{4, 4.0};
  auto adapted = GptModel::create(spec, ParallelLayout{}, TpGroup::single(), lora);
  ASSERT_TRUE(adapted.ok()) << adapted.status().message();
  EXPECT_EQ((*adapted)->carried_store().all().size(), 2u);
  for (const auto& p : (*adapted)->parameters()) EXPECT_NE(p.name().find(".adapter."), std::string::npos) << p.name();
}

TEST(GptModelTest, CreateRefusesWhatItCannotRun) {
  const GptModelSpec spec = tiny_spec();
  ParallelLayout layout;
  layout.cp = 2;
  EXPECT_TRUE(fails_with(GptModel::create(spec, layout, TpGroup::single(), {}),
                         "the context-parallel group (rank 0 of 1) does not match the layout's cp 2"));
  layout = {};
  layout.pp = 2;
  ModelOptions third_stage;
  third_stage.pipeline_stage = 2;
  EXPECT_TRUE(fails_with(GptModel::create(spec, layout, TpGroup::single(), third_stage),
                         "pipeline stage 2 is not one of the layout's 2"));
  layout = {};
  layout.tp = 2;  // the group says 1
  EXPECT_TRUE(fails_with(GptModel::create(spec, layout, TpGroup::single(), {}),
                         "the tensor-parallel group (rank 0 of 1) does not match the layout's tp 2"));
  GptModelSpec moe = spec;
  moe.num_experts = 4;
  EXPECT_TRUE(GptModel::create(moe, ParallelLayout{}, TpGroup::single(), {}).ok());
  moe.moe_router_topk = 5;  // more experts per token than there are
  EXPECT_TRUE(fails_with(GptModel::create(moe, ParallelLayout{}, TpGroup::single(), {}),
                         "moe_router_topk 5 is not between 1 and the 4 experts"));
  moe.moe_router_topk = 2;
  ModelOptions sequence_parallel;  // each rank routes its own tokens
  sequence_parallel.sequence_parallel = true;
  EXPECT_TRUE(GptModel::create(moe, ParallelLayout{}, TpGroup::single(), sequence_parallel).ok());
  layout = {};
  layout.tp = layout.ep = layout.data_parallel = 2;  // Megatron's rule: ep with tp needs sequence parallelism
  EXPECT_TRUE(fails_with(GptModel::create(moe, layout, TpGroup::single(), {}),
                         "expert parallelism with tensor parallelism needs --sequence-parallel"));
  layout = {};
  layout.ep = layout.data_parallel = 2;  // the expert-parallel group says 1
  EXPECT_TRUE(fails_with(GptModel::create(moe, layout, TpGroup::single(), {}),
                         "the expert-parallel group (rank 0 of 1) does not match the layout's ep 2"));
  layout.ep = 3;  // 4 experts do not divide over 3 ranks (with a group of 3, so that the group's check passes)
  layout.data_parallel = 3;
  ModelOptions three_expert_ranks;
  three_expert_ranks.ep = TpGroup{c10::make_intrusive<NoCollectives>(0, 3), 0, 3};
  EXPECT_TRUE(fails_with(GptModel::create(moe, layout, TpGroup::single(), three_expert_ranks),
                         "number of experts (4) is not divisible by the expert-parallel size (3)"));
  GptModelSpec gemma = spec;  // every layer kind the description holds runs: Gemma's ...
  gemma.geglu = gemma.zero_centered_norms = gemma.post_norms = true;
  gemma.attn_logit_softcapping = gemma.final_logit_softcapping = 30;
  EXPECT_TRUE(GptModel::create(gemma, ParallelLayout{}, TpGroup::single(), {}).ok());
  GptModelSpec olmo = spec;  // ... OLMo 2's ...
  olmo.pre_norms = false;
  olmo.post_norms = olmo.qk_layernorm = olmo.qk_norm_full_projection = true;
  EXPECT_TRUE(GptModel::create(olmo, ParallelLayout{}, TpGroup::single(), {}).ok());
  GptModelSpec oss = moe;  // ... GPT-OSS's ...
  oss.add_bias_linear = oss.add_qkv_bias = oss.softmax_offset = oss.quick_geglu = true;
  EXPECT_TRUE(GptModel::create(oss, ParallelLayout{}, TpGroup::single(), {}).ok());
  GptModelSpec deepseek = moe;  // ... and DeepSeek's, multi-token prediction included.
  deepseek.q_lora_rank = 16;
  deepseek.kv_lora_rank = 8;
  deepseek.qk_head_dim = 8;
  deepseek.qk_pos_emb_head_dim = 4;
  deepseek.v_head_dim = 8;
  deepseek.num_query_groups = deepseek.num_attention_heads;
  deepseek.kv_channels = 8;
  deepseek.moe_first_dense_layers = 1;
  deepseek.dense_ffn_hidden_size = deepseek.ffn_hidden_size;
  deepseek.moe_router_expert_bias = true;
  deepseek.moe_router_score_function = "sigmoid";
  deepseek.add_qkv_bias = deepseek.qk_layernorm = false;
  EXPECT_TRUE(GptModel::create(deepseek, ParallelLayout{}, TpGroup::single(), {}).ok());
  deepseek.mtp_num_layers = 1;
  EXPECT_TRUE(GptModel::create(deepseek, ParallelLayout{}, TpGroup::single(), {}).ok());
  GptModelSpec glm = moe;  // GLM-4.5's RoPE over part of each head: an even number of dims, at least 2
  glm.kv_channels = 16;
  glm.rotary_percent = 0.5;
  EXPECT_TRUE(GptModel::create(glm, ParallelLayout{}, TpGroup::single(), {}).ok());
  glm.rotary_percent = 0.2;
  EXPECT_TRUE(fails_with(GptModel::create(glm, ParallelLayout{}, TpGroup::single(), {}),
                         "RoPE needs an even number of rotary dims per head, at least 2: head dim (kv_channels) 16 "
                         "x rotary_percent 0.2 gives 3"));
  glm.rotary_percent = 0.1;
  EXPECT_TRUE(fails_with(GptModel::create(glm, ParallelLayout{}, TpGroup::single(), {}), "gives 1"));
  // Qwen3-Next / Qwen3.5: Gated DeltaNet layers among gated attention ones build; context parallelism over them and
  // LoRA on them are refused naming the layers.
  GptModelSpec next = spec;
  next.linear_attention_layers = {true, false};
  next.linear_conv_kernel_dim = 4;
  next.linear_key_head_dim = next.linear_value_head_dim = 8;
  next.linear_num_key_heads = next.linear_num_value_heads = 2;
  next.attention_output_gate = true;
  ASSERT_EQ(next.num_layers, 2);
  EXPECT_TRUE(GptModel::create(next, ParallelLayout{}, TpGroup::single(), {}).ok());
  ParallelLayout cp2;
  cp2.cp = 2;
  EXPECT_TRUE(fails_with(GptModel::create(next, cp2, TpGroup::single(), {}),
                         "context parallelism over Gated DeltaNet layers"));
  ParallelLayout tp4;
  tp4.tp = 4;
  EXPECT_TRUE(fails_with(GptModel::create(next, tp4, TpGroup::single(), {}),
                         "tensor parallelism 4 does not divide the Gated DeltaNet's 2 key heads and 2 value heads"));
  ModelOptions lora;
  lora.lora = LoraConfig{8, 16.0};
  ModelOptions gdn_lora;  // LoRA on its layers (lora_test.cc), not on a model without them
  gdn_lora.lora = LoraConfig{8, 16.0};
  gdn_lora.lora->targets = {"in_proj", "out_proj"};
  EXPECT_TRUE(GptModel::create(next, ParallelLayout{}, TpGroup::single(), gdn_lora).ok());
  EXPECT_TRUE(fails_with(GptModel::create(spec, ParallelLayout{}, TpGroup::single(), gdn_lora),
                         "LoRA target in_proj: the model has no Gated DeltaNet layers or Mamba mixers"));
  // Gemma 4: per-layer KV heads a tp does not divide, per-layer embeddings short of the vocabulary and a router
  // described as softmax-first are refused naming what (the layouts it cannot run: test_train_families.py).
  GptModelSpec gemma4 = spec;
  gemma4.qk_layernorm = true;
  gemma4.layer_kv_channels = {8, 16};
  gemma4.layer_query_groups = {2, 1};
  gemma4.layer_scalar = gemma4.value_norm = true;
  gemma4.softmax_scale = 1.0;
  EXPECT_TRUE(GptModel::create(gemma4, ParallelLayout{}, TpGroup::single(), {}).ok());
  ParallelLayout tp2;
  tp2.tp = 2;
  EXPECT_TRUE(fails_with(GptModel::create(gemma4, tp2, TpGroup::single(), {}),
                         "tensor parallelism 2 does not divide layer 1's 1 KV heads"));
  EXPECT_TRUE(GptModel::create(gemma4, ParallelLayout{}, TpGroup::single(), lora).ok());
  GptModelSpec inputs = gemma4;
  inputs.per_layer_input_size = 4;
  inputs.per_layer_vocab_size = spec.vocab_size - 1;
  EXPECT_TRUE(fails_with(GptModel::create(inputs, ParallelLayout{}, TpGroup::single(), {}),
                         "per-layer embeddings cover 99 tokens, fewer than the vocabulary's 100"));
  GptModelSpec routed = gemma4;
  routed.num_experts = 4;
  routed.shared_expert_ffn_hidden_size = 48;
  routed.moe_beside_mlp = routed.moe_router_pre_softmax = true;
  EXPECT_TRUE(fails_with(GptModel::create(routed, ParallelLayout{}, TpGroup::single(), {}),
                         "Gemma 4's router renormalises its top-k weights"));
}

// Gemma 4's per-layer inputs, made from the embedding on the first stage, travel to the next beside the hidden states
// ([..., hidden + layers · per_layer_input_size]): over two stages the logits and every gradient (the per-layer
// embedding's and projection's included, which reach the first stage through the passed inputs) are the whole model's.
TEST(GptModelTest, PerLayerInputsAndSharedKeysTravelBetweenPipelineStages) {
  GptModelSpec inputs = tiny_spec();
  inputs.num_layers = 4;
  inputs.per_layer_input_size = 4;
  inputs.per_layer_vocab_size = inputs.vocab_size;
  // The last two layers reuse the first two's keys and values (a windowed layer's and a full-attention one's whose
  // keys are its values): split over two stages, both pairs cross.
  GptModelSpec shared = inputs;
  shared.add_qkv_bias = false;
  shared.mixed_attention = true;
  shared.window_layers = {true, false, true, false};
  shared.kv_shared_layers = 2;
  shared.attention_k_eq_v = true;
  for (const GptModelSpec& spec : {inputs, shared}) {
    ParallelLayout layout;
    layout.pp = 2;
    auto whole = random_model(spec, false);
    std::vector<std::unique_ptr<GptModel>> stages = pipeline_stages(spec, layout, *whole);
    ASSERT_EQ(stages.size(), 2u);
    const std::int64_t width = 32 + 4 * 4 + (spec.kv_shared_layers > 0 ? 2 * 2 * 2 * 8 : 0);
    EXPECT_EQ(stages[1]->stage_width(0), width);

    at::Tensor tokens = at::randint(0, 100, {2, 8}, at::kLong);
    at::Tensor positions = at::arange(8, at::kLong).unsqueeze(0).expand({2, 8}).contiguous();
    ChunkForward expected = whole->forward_chunk(0, at::Tensor(), tokens, positions);
    expected.output.sum().backward();

    ChunkForward first = stages[0]->forward_chunk(0, at::Tensor(), tokens, positions);
    EXPECT_EQ(first.output.sizes(), (std::vector<std::int64_t>{8, 2, width}));
    at::Tensor input = first.output.detach().requires_grad_(true);
    ChunkForward last = stages[1]->forward_chunk(0, input, tokens, positions);
    EXPECT_LT((last.output - expected.output).abs().max().item<float>(), 1e-5);
    last.output.sum().backward();
    torch::autograd::backward({first.output}, {input.grad()});
    int per_layer = 0;
    for (auto& p : whole->parameters()) {
      at::Tensor grad = at::zeros_like(p.tensor);
      for (auto& stage : stages)
        for (auto& q : stage->parameters())
          if (q.name() == p.name() && q.tensor.grad().defined()) grad += q.tensor.grad();
      EXPECT_LT((grad - p.tensor.grad()).abs().max().item<float>(), 1e-4) << p.name();
      if (p.name().find("per_layer") != std::string::npos) {
        ++per_layer;
        EXPECT_GT(p.tensor.grad().abs().max().item<float>(), 0.0f) << p.name();
      }
    }
    EXPECT_GE(per_layer, 3);  // the per-layer embedding, its projection and that projection's norm
    // A stage given the hidden states alone says what it takes.
    EXPECT_THROW(stages[1]->forward_chunk(0, input.narrow(2, 0, 32), tokens, positions), c10::Error);
  }
}

TEST(GptModelTest, ShiftedAheadIsTheTokensEachDepthSees) {
  const at::Tensor t = at::tensor({1, 2, 3, 4, 5, 6}, at::kLong).view({2, 3});
  const at::Tensor expected = at::tensor({2, 3, 0, 5, 6, 0, 3, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0, 0}, at::kLong).view({3, 2, 3});
  EXPECT_TRUE(at::equal(shifted_ahead(t, 3), expected));
}

// Multi-token prediction runs after the final norm on the last stage, which keeps its own copy of the (untied)
// embedding: chained over two stages, the depths' logits and every gradient are the whole model's, the embedding's
// summed over its two copies.
TEST(GptModelTest, MultiTokenPredictionOnTheLastStageIsTheWholeModels) {
  GptModelSpec spec = tiny_spec();
  spec.num_layers = 4;
  spec.mtp_num_layers = 2;
  ParallelLayout layout;
  layout.pp = 2;
  auto whole = random_model(spec, false);
  std::vector<std::unique_ptr<GptModel>> stages = pipeline_stages(spec, layout, *whole);
  ASSERT_EQ(stages.size(), 2u);
  EXPECT_FALSE(stages[0]->holds_embedding_copy());
  EXPECT_TRUE(stages[1]->holds_embedding_copy());
  for (auto& p : stages[0]->parameters()) EXPECT_FALSE(p.name().starts_with("mtp.")) << p.name();
  EXPECT_TRUE(stages[1]->parameter_store().get("mtp.layers.1.eh_proj.weight").defined());

  at::Tensor tokens = at::randint(0, 100, {2, 8}, at::kLong);
  at::Tensor positions = at::arange(8, at::kLong).unsqueeze(0).expand({2, 8}).contiguous();
  ChunkForward expected = whole->forward_chunk(0, at::Tensor(), tokens, positions);
  ASSERT_EQ(expected.mtp_logits.size(), 2u);
  EXPECT_EQ(expected.mtp_logits[1].sizes(), expected.output.sizes());
  (expected.output.sum() + expected.mtp_logits[0].sum() * 0.5 + expected.mtp_logits[1].sum() * 0.25).backward();

  ChunkForward first = stages[0]->forward_chunk(0, at::Tensor(), tokens, positions);
  at::Tensor input = first.output.detach().requires_grad_(true);
  ChunkForward last = stages[1]->forward_chunk(0, input, tokens, positions, shifted_ahead(tokens, 2));
  ASSERT_EQ(last.mtp_logits.size(), 2u);
  for (std::size_t d = 0; d < 2; ++d)
    EXPECT_LT((last.mtp_logits[d] - expected.mtp_logits[d]).abs().max().item<float>(), 1e-5);
  (last.output.sum() + last.mtp_logits[0].sum() * 0.5 + last.mtp_logits[1].sum() * 0.25).backward();
  torch::autograd::backward({first.output}, {input.grad()});
  for (auto& p : whole->parameters()) {
    at::Tensor grad = at::zeros_like(p.tensor);
    for (auto& stage : stages)
      for (auto& q : stage->parameters())
        if (q.name() == p.name()) grad += q.tensor.grad();
    EXPECT_LT((grad - p.tensor.grad()).abs().max().item<float>(), 1e-4) << p.name();
  }
}

// The stages of a pipeline (pp 2, two chunks each) hold exactly their layers, the embedding on the first and (tied) a
// copy on the last, and their chunks run in virtual-stage order give the whole model's logits and gradients.
TEST(GptModelTest, PipelineStagesChainedAreTheWholeModel) {
  GptModelSpec spec = tiny_spec();
  spec.num_layers = 8;
  spec.tied_embeddings = true;
  ParallelLayout layout;
  layout.pp = 2;
  layout.vpp = 2;
  auto whole = random_model(spec, false);
  std::vector<std::unique_ptr<GptModel>> stages = pipeline_stages(spec, layout, *whole);
  ASSERT_EQ(stages.size(), 2u);
  auto names = [](GptModel& m) {
    std::vector<std::string> out;
    for (auto& p : m.parameters())
      if (!p.name().starts_with("decoder.layers.") || p.name().ends_with("linear_qkv.weight")) out.push_back(p.name());
    return out;
  };
  // Virtual stage v = chunk * pp + stage holds layers [2v, 2v + 2).
  EXPECT_EQ(names(*stages[0]), (std::vector<std::string>{"embedding.word_embeddings.weight",
                                                         "decoder.layers.0.self_attention.linear_qkv.weight",
                                                         "decoder.layers.1.self_attention.linear_qkv.weight",
                                                         "decoder.layers.4.self_attention.linear_qkv.weight",
                                                         "decoder.layers.5.self_attention.linear_qkv.weight"}));
  EXPECT_EQ(
      names(*stages[1]),
      (std::vector<std::string>{
          "embedding.word_embeddings.weight", "decoder.layers.2.self_attention.linear_qkv.weight",
          "decoder.layers.3.self_attention.linear_qkv.weight", "decoder.layers.6.self_attention.linear_qkv.weight",
          "decoder.layers.7.self_attention.linear_qkv.weight", "decoder.final_layernorm.weight"}));
  EXPECT_FALSE(stages[0]->holds_embedding_copy());
  EXPECT_TRUE(stages[1]->holds_embedding_copy());

  at::Tensor tokens = at::randint(0, 100, {2, 8}, at::kLong);
  at::Tensor positions = at::arange(8, at::kLong).unsqueeze(0).expand({2, 8}).contiguous();
  at::Tensor labels = at::randint(0, 100, {2, 8}, at::kLong);
  at::Tensor expected = whole->loss(tokens, positions, labels);
  expected.sum().backward();
  std::vector<at::Tensor> inputs, outputs;  // per virtual stage
  for (int v = 0; v < 4; ++v) {
    GptModel& stage = *stages[static_cast<std::size_t>(v % 2)];
    at::Tensor input = v == 0 ? at::Tensor() : outputs.back().detach().requires_grad_(true);
    inputs.push_back(input);
    outputs.push_back(stage.forward_chunk(v / 2, input, tokens, positions).output);
  }
  at::Tensor loss = stages[1]->loss_from_logits(outputs.back(), labels);
  EXPECT_LT((loss - expected).abs().max().item<float>(), 1e-6);
  // Backward through the chain, each virtual stage's input gradient handed to the one before.
  loss.sum().backward();
  for (int v = 2; v >= 0; --v)
    torch::autograd::backward({outputs[static_cast<std::size_t>(v)]}, {inputs[static_cast<std::size_t>(v + 1)].grad()});
  for (auto& p : whole->parameters()) {
    at::Tensor grad = at::zeros_like(p.tensor);
    int holders = 0;
    for (auto& stage : stages)
      for (auto& q : stage->parameters())
        if (q.name() == p.name()) {
          ASSERT_TRUE(q.tensor.grad().defined()) << q.name();
          grad += q.tensor.grad();
          ++holders;
        }
    EXPECT_EQ(holders, p.name() == "embedding.word_embeddings.weight" ? 2 : 1) << p.name();
    EXPECT_LT((grad - p.tensor.grad()).abs().max().item<float>(), 1e-5) << p.name();
  }
}

}  // namespace
}  // namespace trestle::train
