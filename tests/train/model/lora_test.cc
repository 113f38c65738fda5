// LoRA in the model (tp 1): a model with adapters gives the logits of the base model whose targeted weights are merged
// W + (alpha / rank) · B · A, for one adapter per fused linear and for the canonical q, k, v / gate, up parts, on
// experts, Gated DeltaNet and multi-latent attention; only the adapters get gradients.
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

// Tokens [2, 8] and their positions, drawn with `seed`.
std::pair<at::Tensor, at::Tensor> random_batch(std::uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor tokens = at::randint(0, 100, {2, 8}, at::kLong);
  return {tokens, at::arange(8, at::kLong).unsqueeze(0).expand({2, 8}).contiguous()};
}

// A model with adapters (base and adapters random) and one without them holding the same base weights, which the
// caller merges the adapters into.
std::pair<std::unique_ptr<GptModel>, std::unique_ptr<GptModel>> adapted_and_base(const GptModelSpec& spec,
                                                                                const LoraConfig& config) {
  auto adapted = make(spec, config);
  auto merged = make(spec, std::nullopt);
  at::NoGradGuard no_grad;
  adapted->base_parameter_store().storage().normal_(0, 0.2);
  adapted->parameter_store().storage().normal_(0, 0.2);
  merged->parameter_store().storage().copy_(adapted->base_parameter_store().storage());
  return {std::move(adapted), std::move(merged)};
}

// The per-part deltas B · A laid out as the fused weight's rows (per-group QKV order; [gate; up]).
at::Tensor fused_delta(const GptModel& model, const std::string& module, const GptModelSpec& s) {
  auto& adapters = const_cast<GptModel&>(model).parameter_store();
  auto delta = [&](const std::string& part) {
    return at::matmul(adapters.get(lora_tensor_name(module, part, false)),
                      adapters.get(lora_tensor_name(module, part, true)));
  };
  const bool fused = module.ends_with("linear_qkv") || module.ends_with("linear_fc1");
  const bool routed_expert = module.find(".local_experts.") != std::string::npos;
  if (module_lora_type(model.lora()->type, routed_expert) == LoraType::kLora || !fused) return delta("");
  if (module.ends_with("linear_fc1")) return at::cat({delta("adapter_gate"), delta("adapter_up")}, 0);
  const std::int64_t g = s.num_query_groups, d = s.kv_channels, per_group = s.num_attention_heads / g;
  const at::Tensor q = delta("adapter_q").view({g, per_group * d, -1});
  const at::Tensor k = delta("adapter_k").view({g, d, -1}), v = delta("adapter_v").view({g, d, -1});
  return at::cat({q, k, v}, 1).reshape({g * (per_group + 2) * d, -1});
}

TEST(LoraTest, AdaptedModelIsTheMergedBaseAndOnlyAdaptersLearn) {
  const GptModelSpec spec = tiny_spec();
  const auto [tokens, positions] = random_batch(3);
  for (const LoraType type : {LoraType::kLora, LoraType::kCanonical}) {
    LoraConfig config;
    config.rank = 3;
    config.alpha = 6;
    config.type = type;
    auto [adapted, merged] = adapted_and_base(spec, config);
    {
      at::NoGradGuard no_grad;
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

// An MoE layer: each routed expert's and the shared expert's fc1 / fc2 adapters equal their merged weights (peft: the
// routed experts' fc1 one adapter, the shared expert's gate and up).
TEST(LoraTest, AdaptedExpertsAreTheMergedExperts) {
  GptModelSpec spec = tiny_spec();
  spec.num_experts = 3;
  spec.moe_router_topk = 2;
  spec.ffn_hidden_size = 16;
  spec.shared_expert_ffn_hidden_size = 24;
  const auto [tokens, positions] = random_batch(4);
  for (const LoraType type : {LoraType::kLora, LoraType::kCanonical, LoraType::kPeft}) {
    LoraConfig config;
    config.rank = 2;
    config.alpha = 3;
    config.type = type;
    config.targets = {"linear_fc1", "linear_fc2"};
    at::manual_seed(11);  // a router that gives every expert tokens
    auto [adapted, merged] = adapted_and_base(spec, config);
    {
      at::NoGradGuard no_grad;
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

// Qwen3-Next / Qwen3.5: a Gated DeltaNet layer's in_proj (B in the base's six pieces) and out_proj, and the gated
// attention's linear_qkv (the canonical q part holding each group's gates after its queries) equal their merged
// weights, for one adapter per linear and for the canonical parts of both Hugging Face layouts of in_proj.
TEST(LoraTest, AdaptedGatedDeltaNetAndGatedAttentionAreTheMergedWeights) {
  GptModelSpec spec = tiny_spec();
  spec.add_qkv_bias = false;
  spec.attention_output_gate = spec.zero_centered_norms = true;
  spec.linear_attention_layers = {true, false};
  spec.linear_conv_kernel_dim = 4;
  spec.linear_key_head_dim = 8;
  spec.linear_value_head_dim = 6;
  spec.linear_num_key_heads = 2;
  spec.linear_num_value_heads = 4;
  const auto [tokens, positions] = random_batch(5);
  const std::vector<std::pair<std::string, std::int64_t>> pieces{{"query", 16}, {"key", 16}, {"value", 24},
                                                                 {"z", 24},     {"beta", 4}, {"alpha", 4}};
  for (const bool split : {false, true})
    for (const LoraType type : {LoraType::kLora, LoraType::kCanonical}) {
      spec.linear_in_proj_split = split;
      LoraConfig config;
      config.rank = 2;
      config.alpha = 4;
      config.type = type;
      config.targets = model_lora_targets(spec);
      auto [adapted, merged] = adapted_and_base(spec, config);
      at::NoGradGuard no_grad;
      auto& adapters = adapted->parameter_store();
      // in_proj: each part's B (its pieces' rows) times its A, the parts' rows one after another, then cut by piece.
      const std::string in_proj = "decoder.layers.0.self_attention.in_proj";
      std::vector<at::Tensor> deltas;
      for (const LoraPart& part : lora_parts(spec, 0, "in_proj", type)) {
        std::vector<at::Tensor> b;
        for (const std::string& piece : part.pieces)
          b.push_back(adapters.get(lora_tensor_name(in_proj, part.name, false, piece)));
        deltas.push_back(at::matmul(at::cat(b), adapters.get(lora_tensor_name(in_proj, part.name, true))));
      }
      EXPECT_EQ(deltas.size(), type == LoraType::kLora ? 1u : split ? 4u : 2u);
      const at::Tensor in_delta = at::cat(deltas);
      std::int64_t row = 0;
      for (const auto& [piece, rows] : pieces) {
        merged->parameter_store().get(in_proj + ".weight." + piece).add_(in_delta.narrow(0, row, rows) * 2.0);
        row += rows;
      }
      ASSERT_EQ(row, in_delta.size(0));
      const std::string out_proj = "decoder.layers.0.self_attention.out_proj";
      merged->parameter_store().get(out_proj + ".weight").add_(fused_delta(*adapted, out_proj, spec) * 2.0);
      // The gated attention's linear_qkv: per group [queries; gates; key; value].
      const std::string qkv = "decoder.layers.1.self_attention.linear_qkv";
      at::Tensor qkv_delta;
      if (type == LoraType::kLora) {
        qkv_delta = fused_delta(*adapted, qkv, spec);
      } else {
        auto delta = [&](const std::string& part, std::int64_t rows) {
          return at::matmul(adapters.get(lora_tensor_name(qkv, part, false)),
                            adapters.get(lora_tensor_name(qkv, part, true)))
              .view({2, rows, -1});
        };
        qkv_delta = at::cat({delta("adapter_q", 32), delta("adapter_k", 8), delta("adapter_v", 8)}, 1).reshape({96, -1});
      }
      merged->parameter_store().get(qkv + ".weight").add_(qkv_delta * 2.0);
      for (const std::string module : {"self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"}) {
        for (const std::string layer : {"decoder.layers.0.", "decoder.layers.1."}) {
          if (module == "self_attention.linear_proj" && layer == "decoder.layers.0.") continue;
          merged->parameter_store().get(layer + module + ".weight").add_(fused_delta(*adapted, layer + module, spec) * 2.0);
        }
      }
      EXPECT_FALSE(adapters.get("decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight").defined());
      EXPECT_FALSE(adapters.get("decoder.layers.1.self_attention.in_proj.adapter.linear_in.weight").defined());
      const at::Tensor difference = adapted->forward(tokens, positions) - merged->forward(tokens, positions);
      EXPECT_LT(difference.abs().max().item<double>(), 2e-5) << lora_type_name(type) << (split ? " split" : "");
    }
}

// Multi-latent attention (with and without a query latent; its down projections replicated under Transformer
// Engine's spec, column-parallel under the local one): each projection's adapter equals its merged weight.
TEST(LoraTest, AdaptedLatentAttentionIsTheMergedWeights) {
  const auto [tokens, positions] = random_batch(9);
  for (const std::int64_t q_lora_rank : {12, 0})
    for (const NormNaming norms : {NormNaming::kTransformerEngine, NormNaming::kLocal}) {
      GptModelSpec spec = tiny_spec();
      spec.add_qkv_bias = false;
      spec.num_query_groups = spec.num_attention_heads;
      spec.q_lora_rank = q_lora_rank;
      spec.kv_lora_rank = 8;
      spec.qk_head_dim = 8;
      spec.qk_pos_emb_head_dim = 4;
      spec.v_head_dim = 6;
      spec.norms = norms;
      LoraConfig config;
      config.rank = 2;
      config.alpha = 4;
      config.targets = {"linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1"};
      for (const char* query : q_lora_rank > 0 ? std::vector<const char*>{"linear_q_down_proj", "linear_q_up_proj"}
                                               : std::vector<const char*>{"linear_q_proj"})
        config.targets.push_back(query);
      auto [adapted, merged] = adapted_and_base(spec, config);
      {
        at::NoGradGuard no_grad;
        for (std::int64_t i = 0; i < spec.num_layers; ++i)
          for (const std::string& target : config.targets) {
            const std::string module = "decoder.layers." + std::to_string(i) +
                                       (target == "linear_fc1" ? ".mlp." : ".self_attention.") + target;
            merged->parameter_store().get(module + ".weight").add_(fused_delta(*adapted, module, spec) * 2.0);
          }
      }
      const std::string what = std::to_string(q_lora_rank) + (norms == NormNaming::kLocal ? " local" : " te");
      const at::Tensor logits = adapted->forward(tokens, positions);
      EXPECT_LT((logits - merged->forward(tokens, positions)).abs().max().item<double>(), 2e-5) << what;
      logits.pow(2).mean().backward();
      EXPECT_EQ(adapted->parameters().size(), 2u * 2u * config.targets.size()) << what;
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
