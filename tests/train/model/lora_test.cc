// LoRA in the model (tp 1): a model with adapters gives the logits of the base model whose targeted weights are merged
// W + (alpha / rank) · B · A, for one adapter per fused linear and for the canonical q, k, v / gate, up parts; only the
// adapters get gradients.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"
#include "train/model/gpt_model.h"

namespace trestle::train {
namespace {

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
  return s;
}

std::unique_ptr<GptModel> make(const GptModelSpec& spec, std::optional<LoraConfig> lora) {
  ModelOptions options;
  options.lora = std::move(lora);
  auto model = GptModel::create(spec, ParallelLayout{}, TpGroup::single(), options);
  EXPECT_TRUE(model.ok()) << model.status().message();
  return std::move(*model);
}

// The per-part deltas B · A laid out as the fused weight's rows (per-group QKV order; [gate; up]).
at::Tensor fused_delta(const GptModel& model, const std::string& module, const GptModelSpec& s) {
  auto& adapters = const_cast<GptModel&>(model).parameter_store();
  auto delta = [&](const std::string& part) {
    return at::matmul(adapters.get(lora_tensor_name(module, part, false)),
                      adapters.get(lora_tensor_name(module, part, true)));
  };
  const bool fused = module.ends_with("linear_qkv") || module.ends_with("linear_fc1");
  if (model.lora()->type == LoraType::kLora || !fused) return delta("");
  if (module.ends_with("linear_fc1")) return at::cat({delta("adapter_gate"), delta("adapter_up")}, 0);
  const std::int64_t g = s.num_query_groups, d = s.kv_channels, per_group = s.num_attention_heads / g;
  const at::Tensor q = delta("adapter_q").view({g, per_group * d, -1});
  const at::Tensor k = delta("adapter_k").view({g, d, -1}), v = delta("adapter_v").view({g, d, -1});
  return at::cat({q, k, v}, 1).reshape({g * (per_group + 2) * d, -1});
}

TEST(LoraTest, AdaptedModelIsTheMergedBaseAndOnlyAdaptersLearn) {
  const GptModelSpec spec = tiny_spec();
  at::manual_seed(3);
  const at::Tensor tokens = at::randint(0, 100, {2, 8}, at::kLong);
  const at::Tensor positions = at::arange(8, at::kLong).unsqueeze(0).expand({2, 8}).contiguous();
  for (const LoraType type : {LoraType::kLora, LoraType::kCanonical}) {
    LoraConfig config;
    config.rank = 3;
    config.alpha = 6;
    config.type = type;
    auto adapted = make(spec, config);
    auto merged = make(spec, std::nullopt);
    {
      at::NoGradGuard no_grad;
      adapted->base_parameter_store().storage().normal_(0, 0.2);
      adapted->parameter_store().storage().normal_(0, 0.2);
      merged->parameter_store().storage().copy_(adapted->base_parameter_store().storage());
      for (std::int64_t i = 0; i < spec.num_layers; ++i) {
        const std::string p = "decoder.layers." + std::to_string(i) + ".";
        for (const std::string module : {"self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                                         "mlp.linear_fc2"})
          merged->parameter_store().get(p + module + ".weight").add_(fused_delta(*adapted, p + module, spec) * 2.0);
      }
    }
    const at::Tensor logits = adapted->forward(tokens, positions);
    EXPECT_LT((logits - merged->forward(tokens, positions)).abs().max().item<double>(), 2e-5)
        << lora_type_name(type);
    logits.pow(2).mean().backward();
    for (auto& p : adapted->base_parameter_store().all()) {
      EXPECT_FALSE(p.tensor.requires_grad()) << p.name();
      EXPECT_FALSE(p.tensor.grad().defined()) << p.name();
    }
    EXPECT_EQ(adapted->parameters().size(), type == LoraType::kLora ? 16u : 28u);
    for (auto& p : adapted->parameters()) {
      ASSERT_TRUE(p.tensor.grad().defined()) << p.name();
      EXPECT_GT(p.tensor.grad().abs().sum().item<double>(), 0.0) << p.name();
    }
  }
}

// An MoE layer: each routed expert's and the shared expert's fc1 / fc2 adapters equal their merged weights.
TEST(LoraTest, AdaptedExpertsAreTheMergedExperts) {
  GptModelSpec spec = tiny_spec();
  spec.num_experts = 3;
  spec.moe_router_topk = 2;
  spec.ffn_hidden_size = 16;
  spec.shared_expert_ffn_hidden_size = 24;
  at::manual_seed(4);
  const at::Tensor tokens = at::randint(0, 100, {2, 8}, at::kLong);
  const at::Tensor positions = at::arange(8, at::kLong).unsqueeze(0).expand({2, 8}).contiguous();
  for (const LoraType type : {LoraType::kLora, LoraType::kCanonical}) {
    LoraConfig config;
    config.rank = 2;
    config.alpha = 3;
    config.type = type;
    config.targets = {"linear_fc1", "linear_fc2"};
    auto adapted = make(spec, config);
    auto merged = make(spec, std::nullopt);
    {
      at::NoGradGuard no_grad;
      adapted->base_parameter_store().storage().normal_(0, 0.2);
      adapted->parameter_store().storage().normal_(0, 0.2);
      merged->parameter_store().storage().copy_(adapted->base_parameter_store().storage());
      for (std::int64_t i = 0; i < spec.num_layers; ++i) {
        std::vector<std::string> modules{"mlp.shared_experts"};
        for (int e = 0; e < 3; ++e) modules.push_back("mlp.experts.local_experts." + std::to_string(e));
        for (const auto& m : modules)
          for (const std::string fc : {".linear_fc1", ".linear_fc2"}) {
            const std::string module = "decoder.layers." + std::to_string(i) + "." + m + fc;
            merged->parameter_store().get(module + ".weight").add_(fused_delta(*adapted, module, spec) * 1.5);
          }
      }
    }
    const at::Tensor logits = adapted->forward(tokens, positions);
    EXPECT_LT((logits - merged->forward(tokens, positions)).abs().max().item<double>(), 2e-5)
        << lora_type_name(type);
    logits.pow(2).mean().backward();
    for (auto& p : adapted->parameters()) {
      ASSERT_TRUE(p.tensor.grad().defined()) << p.name();
      EXPECT_GT(p.tensor.grad().abs().sum().item<double>(), 0.0) << p.name();
    }
  }
}

TEST(LoraTest, RefusesDropoutWithRecompute) {
  LoraConfig config;
  config.rank = 2;
  config.alpha = 2;
  config.dropout = 0.1;
  ModelOptions options;
  options.lora = config;
  options.recompute = true;
  EXPECT_TRUE(fails_with(GptModel::create(tiny_spec(), ParallelLayout{}, TpGroup::single(), options),
                         "LoRA dropout with activation recompute"));
}

}  // namespace
}  // namespace trestle::train
