// LoRA adapters as canonical tensors: Megatron-Bridge's names, shapes and this project's tensor-parallel splits, the
// JSON an adapter checkpoint records, and the configurations refused.
#include "parallel/layout/lora_spec.h"

#include <gtest/gtest.h>

#include <map>

#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

GptModelSpec llama_like() {
  GptModelSpec s;
  s.num_layers = 2;
  s.hidden_size = 64;
  s.ffn_hidden_size = 96;
  s.num_attention_heads = 8;
  s.num_query_groups = 2;
  s.kv_channels = 8;
  s.vocab_size = 300;
  return s;
}

std::map<std::string, CanonicalTensor> by_name(const std::vector<CanonicalTensor>& tensors) {
  std::map<std::string, CanonicalTensor> out;
  for (const auto& t : tensors) EXPECT_TRUE(out.emplace(t.name, t).second) << "duplicate " << t.name;
  return out;
}

TEST(LoraSpecTest, FusedAdaptersOnEveryTarget) {
  LoraConfig c;
  c.rank = 4;
  c.alpha = 8;
  const auto tensors = lora_tensors(llama_like(), c);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  EXPECT_EQ(tensors->size(), 2u * 4u * 2u);
  const auto t = by_name(*tensors);
  const auto& qkv_in = t.at("decoder.layers.1.self_attention.linear_qkv.adapter.linear_in.weight");
  EXPECT_EQ(qkv_in.shape, (Shape{4, 64}));
  EXPECT_EQ(qkv_in.split, TpSplit::kColumn);  // along the rank, gathered (Megatron-Bridge's linear_in)
  EXPECT_EQ(qkv_in.layer, 1);
  const auto& qkv_out = t.at("decoder.layers.1.self_attention.linear_qkv.adapter.linear_out.weight");
  EXPECT_EQ(qkv_out.shape, (Shape{(8 + 2 * 2) * 8, 4}));
  EXPECT_EQ(qkv_out.split, TpSplit::kColumn);
  const auto& proj_in = t.at("decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight");
  EXPECT_EQ(proj_in.shape, (Shape{4, 64}));
  EXPECT_EQ(proj_in.split, TpSplit::kRow);
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_proj.adapter.linear_out.weight").split,
            TpSplit::kReplicated);
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight").shape, (Shape{192, 4}));
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight").split, TpSplit::kGatedColumn);
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight").shape, (Shape{4, 96}));
  EXPECT_DOUBLE_EQ(c.scale(), 2.0);
}

TEST(LoraSpecTest, CanonicalAdaptersSplitQkvAndGateUp) {
  LoraConfig c;
  c.rank = 2;
  c.alpha = 2;
  c.type = LoraType::kCanonical;
  c.targets = {"linear_qkv", "linear_fc1"};
  const auto tensors = lora_tensors(llama_like(), c);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  const auto t = by_name(*tensors);
  EXPECT_EQ(tensors->size(), 2u * 5u * 2u);
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_qkv.adapter.adapter_q.linear_out.weight").shape,
            (Shape{64, 2}));
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_qkv.adapter.adapter_v.linear_out.weight").shape,
            (Shape{16, 2}));
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc1.adapter.adapter_up.linear_out.weight").shape, (Shape{96, 2}));
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc1.adapter.adapter_gate.linear_in.weight").shape, (Shape{2, 64}));
  EXPECT_FALSE(t.contains("decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight"));
}

TEST(LoraSpecTest, MoeLayersAdaptEachExpertAndTheSharedOne) {
  GptModelSpec s = llama_like();
  s.num_experts = 3;
  s.ffn_hidden_size = 16;
  s.shared_expert_ffn_hidden_size = 24;
  s.moe_first_dense_layers = 1;
  s.dense_ffn_hidden_size = 40;
  LoraConfig c;
  c.rank = 2;
  c.alpha = 2;
  c.targets = {"linear_fc1", "linear_fc2"};
  const auto tensors = lora_tensors(s, c);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  const auto t = by_name(*tensors);
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight").shape, (Shape{80, 2}));
  const auto& expert = t.at("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.adapter.linear_out.weight");
  EXPECT_EQ(expert.shape, (Shape{32, 2}));
  EXPECT_EQ(expert.expert, 2);
  EXPECT_EQ(t.at("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.adapter.linear_in.weight").shape,
            (Shape{2, 16}));
  EXPECT_EQ(t.at("decoder.layers.1.mlp.shared_experts.linear_fc2.adapter.linear_in.weight").shape, (Shape{2, 24}));
  EXPECT_EQ(t.at("decoder.layers.1.mlp.shared_experts.linear_fc2.adapter.linear_in.weight").expert, -1);
  EXPECT_FALSE(t.contains("decoder.layers.1.mlp.linear_fc1.adapter.linear_in.weight"));
  EXPECT_EQ(tensors->size(), 2u * 2u + (3u + 1u) * 2u * 2u);
  // peft: the routed experts' gate and up share one adapter (transformers 5's fused gate_up_proj), the dense MLP's and
  // the shared expert's are canonical.
  c.type = LoraType::kPeft;
  const auto peft = lora_tensors(s, c);
  ASSERT_TRUE(peft.ok()) << peft.status().message();
  const auto p = by_name(*peft);
  EXPECT_EQ(p.at("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.adapter.linear_out.weight").shape,
            (Shape{32, 2}));
  EXPECT_FALSE(
      p.contains("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.adapter.adapter_gate.linear_in.weight"));
  EXPECT_EQ(p.at("decoder.layers.1.mlp.shared_experts.linear_fc1.adapter.adapter_up.linear_out.weight").shape,
            (Shape{24, 2}));
  EXPECT_EQ(p.at("decoder.layers.0.mlp.linear_fc1.adapter.adapter_gate.linear_out.weight").shape, (Shape{40, 2}));
  EXPECT_EQ(peft->size(), (4u + 2u) + 3u * (2u + 2u) + (4u + 2u));  // dense, routed experts, shared expert
  EXPECT_EQ(lora_parts(s, 1, "linear_fc1", module_lora_type(LoraType::kPeft, true)).size(), 1u);
  EXPECT_EQ(lora_parts(s, 1, "linear_fc1", module_lora_type(LoraType::kPeft, false)).size(), 2u);
}

// TinyLlama's shape (hidden 2048, 22 layers, ffn 5632, 32 heads, 4 KV heads, vocab 32000) at rank 16 on every
// target: the adapters hold under 1% of the base's elements (an adapter checkpoint's weights, in the same dtype, are
// that share of the base's bytes; Adam's fp32 state adds three copies of them).
// Gemma 4: attention sizes per layer; the full-attention layer's keys are its values (no adapter_v); the KV-sharing
// last layer's linear_qkv target adapts its linear_q_proj, its queries alone, and its MLP is twice as wide.
TEST(LoraSpecTest, Gemma4LayersAdaptTheirOwnProjections) {
  GptModelSpec s = llama_like();
  s.num_layers = 3;
  s.window_size = 4;
  s.mixed_attention = true;
  s.window_layers = {true, false, true};
  s.layer_kv_channels = {8, 16, 8};
  s.layer_query_groups = {2, 1, 2};
  s.attention_k_eq_v = true;
  s.kv_shared_layers = 1;
  s.double_wide_mlp = true;
  ASSERT_FALSE(s.layer_has_window(1));
  LoraConfig c;
  c.rank = 2;
  c.alpha = 4;
  c.type = LoraType::kCanonical;
  const auto tensors = lora_tensors(s, c);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  const auto t = by_name(*tensors);
  const std::string full = "decoder.layers.1.self_attention.linear_qkv.adapter.";
  EXPECT_EQ(t.at(full + "adapter_q.linear_out.weight").shape, (Shape{8 * 16, 2}));
  EXPECT_EQ(t.at(full + "adapter_k.linear_out.weight").shape, (Shape{16, 2}));
  EXPECT_FALSE(t.count(full + "adapter_v.linear_out.weight"));
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.linear_proj.adapter.linear_in.weight").shape, (Shape{2, 8 * 16}));
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_qkv.adapter.adapter_v.linear_out.weight").shape,
            (Shape{16, 2}));
  const std::string shared = "decoder.layers.2.self_attention.";
  EXPECT_EQ(t.at(shared + "linear_q_proj.adapter.adapter_q.linear_out.weight").shape, (Shape{64, 2}));
  EXPECT_FALSE(t.count(shared + "linear_qkv.adapter.adapter_q.linear_out.weight"));
  EXPECT_FALSE(t.count(shared + "linear_q_proj.adapter.adapter_k.linear_out.weight"));
  EXPECT_EQ(t.at("decoder.layers.2.mlp.linear_fc2.adapter.linear_in.weight").shape, (Shape{2, 2 * 96}));
  EXPECT_EQ(t.at("decoder.layers.1.mlp.linear_fc2.adapter.linear_in.weight").shape, (Shape{2, 96}));
  c.type = LoraType::kLora;
  const auto fused = by_name(*lora_tensors(s, c));
  EXPECT_EQ(fused.at(full + "linear_out.weight").shape, (Shape{8 * 16 + 16, 2}));
  EXPECT_EQ(fused.at(shared + "linear_q_proj.adapter.linear_out.weight").shape, (Shape{64, 2}));
}

// Qwen3-Next / Qwen3.5: Gated DeltaNet layers take in_proj (B in the base's six pieces, each split by heads) and
// out_proj, attention layers linear_qkv (queries with their gates) and linear_proj; the canonical in_proj has one
// adapter per Hugging Face projection.
TEST(LoraSpecTest, GatedDeltaNetLayersAdaptInProjInItsPieces) {
  GptModelSpec s = llama_like();
  s.attention_output_gate = true;
  s.linear_attention_layers = {true, false};
  s.linear_conv_kernel_dim = 4;
  s.linear_key_head_dim = 8;
  s.linear_value_head_dim = 12;
  s.linear_num_key_heads = 2;
  s.linear_num_value_heads = 4;
  LoraConfig c;
  c.rank = 2;
  c.alpha = 2;
  c.targets = model_lora_targets(s);
  auto tensors = lora_tensors(s, c);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  auto t = by_name(*tensors);
  const std::string in_proj = "decoder.layers.0.self_attention.in_proj.adapter.";
  EXPECT_EQ(t.at(in_proj + "linear_in.weight").shape, (Shape{2, 64}));
  EXPECT_EQ(t.at(in_proj + "linear_in.weight").split, TpSplit::kColumn);
  for (const auto& [piece, rows] : std::map<std::string, std::int64_t>{
           {"query", 16}, {"key", 16}, {"value", 48}, {"z", 48}, {"beta", 4}, {"alpha", 4}}) {
    EXPECT_EQ(t.at(in_proj + "linear_out.weight." + piece).shape, (Shape{rows, 2})) << piece;
    EXPECT_EQ(t.at(in_proj + "linear_out.weight." + piece).split, TpSplit::kColumn) << piece;
  }
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.out_proj.adapter.linear_in.weight").shape, (Shape{2, 48}));
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.out_proj.adapter.linear_in.weight").split, TpSplit::kRow);
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.linear_qkv.adapter.linear_out.weight").shape,
            (Shape{(2 * 8 + 2 * 2) * 8, 2}));
  EXPECT_FALSE(t.count("decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"));
  EXPECT_FALSE(t.count("decoder.layers.1.self_attention.in_proj.adapter.linear_in.weight"));
  EXPECT_EQ(tensors->size(), (1u + 6u) + 3u * 2u + 4u * 2u);  // in_proj, out_proj and the MLP; attention and MLP

  c.type = LoraType::kCanonical;
  for (const bool split : {false, true}) {
    s.linear_in_proj_split = split;
    tensors = lora_tensors(s, c);
    ASSERT_TRUE(tensors.ok()) << tensors.status().message();
    t = by_name(*tensors);
    const std::vector<LoraPart> parts = lora_parts(s, 0, "in_proj", LoraType::kCanonical);
    std::vector<std::string> names;
    for (const LoraPart& part : parts) {
      names.push_back(part.name);
      EXPECT_TRUE(t.count(in_proj + part.name + ".linear_in.weight")) << part.name;
      for (const std::string& piece : part.pieces)
        EXPECT_TRUE(t.count(in_proj + part.name + ".linear_out.weight." + piece)) << part.name << " " << piece;
    }
    EXPECT_EQ(names, split ? std::vector<std::string>({"adapter_qkv", "adapter_z", "adapter_b", "adapter_a"})
                           : std::vector<std::string>({"adapter_qkvz", "adapter_ba"}));
    EXPECT_EQ(t.at("decoder.layers.1.self_attention.linear_qkv.adapter.adapter_q.linear_out.weight").shape,
              (Shape{2 * 8 * 8, 2}));  // the queries and their gates
  }
  EXPECT_TRUE(lora_parts(s, 1, "in_proj", LoraType::kLora).empty());
  EXPECT_TRUE(lora_parts(s, 0, "linear_qkv", LoraType::kLora).empty());
  c.targets = {"in_proj"};
  EXPECT_TRUE(fails_with(check_lora_config(c, llama_like()), "LoRA target in_proj: the model has no Gated DeltaNet layers or Mamba mixers"));
}

// Nemotron-H: a Mamba mixer takes in_proj (B in the base's pieces z, x, B, C, dt) and out_proj, an attention layer
// linear_qkv and linear_proj, an MLP layer its ungated fc1 and fc2, an MoE layer its experts' (in the latent space)
// and its shared expert's; one adapter per linear in either type (Hugging Face's model has no split projections).
TEST(LoraSpecTest, HybridLayersAdaptTheirOneMixer) {
  GptModelSpec s = llama_like();
  s.num_layers = 4;
  s.hybrid_layers = "M*-E";
  s.mamba_num_heads = 4;
  s.mamba_head_dim = 8;
  s.mamba_state_dim = 8;
  s.mamba_num_groups = 2;
  s.squared_relu = true;
  s.num_experts = 2;
  s.dense_ffn_hidden_size = 96;
  s.ffn_hidden_size = 32;
  s.shared_expert_ffn_hidden_size = 48;
  s.moe_latent_size = 24;
  for (const LoraType type : {LoraType::kLora, LoraType::kCanonical}) {
    LoraConfig c;
    c.rank = 2;
    c.alpha = 2;
    c.type = type;
    c.targets = model_lora_targets(s);
    const auto tensors = lora_tensors(s, c);
    ASSERT_TRUE(tensors.ok()) << tensors.status().message();
    const auto t = by_name(*tensors);
    const std::string in_proj = "decoder.layers.0.mixer.in_proj.adapter.";
    for (const auto& [piece, rows] :
         std::map<std::string, std::int64_t>{{"z", 32}, {"x", 32}, {"B", 16}, {"C", 16}, {"dt", 4}})
      EXPECT_EQ(t.at(in_proj + "linear_out.weight." + piece).shape, (Shape{rows, 2})) << piece;
    EXPECT_EQ(t.at("decoder.layers.0.mixer.out_proj.adapter.linear_in.weight").shape, (Shape{2, 32}));
    const bool canonical = type == LoraType::kCanonical;  // attention's q, k and v are separate in Hugging Face's
    EXPECT_EQ(t.at(std::string("decoder.layers.1.self_attention.linear_qkv.adapter.") +
                   (canonical ? "adapter_k." : "") + "linear_out.weight")
                  .shape,
              (Shape{canonical ? 16 : 96, 2}));
    EXPECT_EQ(t.at("decoder.layers.2.mlp.linear_fc1.adapter.linear_out.weight").shape, (Shape{96, 2}));
    EXPECT_EQ(t.at("decoder.layers.2.mlp.linear_fc1.adapter.linear_out.weight").split, TpSplit::kColumn);
    const std::string expert = "decoder.layers.3.mlp.experts.local_experts.1.";
    EXPECT_EQ(t.at(expert + "linear_fc1.adapter.linear_in.weight").shape, (Shape{2, 24}));
    EXPECT_EQ(t.at(expert + "linear_fc2.adapter.linear_out.weight").shape, (Shape{24, 2}));
    EXPECT_EQ(t.at("decoder.layers.3.mlp.shared_experts.linear_fc1.adapter.linear_in.weight").shape, (Shape{2, 64}));
    // Per layer: 1 + 5 and 2 (mixer), 2 (x 3 canonical) + 2 (attention), 2 + 2 (MLP), 2 x 4 + 4 (experts and shared
    // expert): the mixer's in_proj is one adapter in either type.
    EXPECT_EQ(tensors->size(), 8u + (canonical ? 8u : 4u) + 4u + 12u) << lora_type_name(type);
  }
  EXPECT_TRUE(model_has_lora_target(s, "in_proj"));
  EXPECT_FALSE(model_has_lora_target(llama_like(), "out_proj"));
}

GptModelSpec latent_attention(std::int64_t q_lora_rank) {
  GptModelSpec s = llama_like();
  s.num_query_groups = s.num_attention_heads;
  s.q_lora_rank = q_lora_rank;
  s.kv_lora_rank = 16;
  s.qk_head_dim = 8;
  s.qk_pos_emb_head_dim = 4;
  s.v_head_dim = 6;
  return s;
}

// Multi-latent attention: Megatron-Bridge's targets on its projections, the up projections' adapters column-parallel
// by heads, the down projections' replicated as their bases are under Transformer Engine's spec (column-parallel under
// the local spec); linear_q_proj where there is no query latent.
TEST(LoraSpecTest, LatentAttentionAdaptsItsProjections) {
  LoraConfig c;
  c.rank = 4;
  c.alpha = 8;
  c.targets = {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"};
  GptModelSpec s = latent_attention(24);
  for (const NormNaming norms : {NormNaming::kTransformerEngine, NormNaming::kLocal}) {
    s.norms = norms;
    const auto tensors = lora_tensors(s, c);
    ASSERT_TRUE(tensors.ok()) << tensors.status().message();
    EXPECT_EQ(tensors->size(), 2u * 5u * 2u);
    const auto t = by_name(*tensors);
    const std::string a = "decoder.layers.1.self_attention.";
    const TpSplit down = norms == NormNaming::kLocal ? TpSplit::kColumn : TpSplit::kReplicated;
    EXPECT_EQ(t.at(a + "linear_q_down_proj.adapter.linear_in.weight").shape, (Shape{4, 64}));
    EXPECT_EQ(t.at(a + "linear_q_down_proj.adapter.linear_in.weight").split, down);
    EXPECT_EQ(t.at(a + "linear_q_down_proj.adapter.linear_out.weight").shape, (Shape{24, 4}));
    EXPECT_EQ(t.at(a + "linear_q_down_proj.adapter.linear_out.weight").split, down);
    EXPECT_EQ(t.at(a + "linear_kv_down_proj.adapter.linear_out.weight").shape, (Shape{16 + 4, 4}));
    EXPECT_EQ(t.at(a + "linear_kv_down_proj.adapter.linear_in.weight").split, down);
    EXPECT_EQ(t.at(a + "linear_q_up_proj.adapter.linear_in.weight").shape, (Shape{4, 24}));
    EXPECT_EQ(t.at(a + "linear_q_up_proj.adapter.linear_in.weight").split, TpSplit::kColumn);
    EXPECT_EQ(t.at(a + "linear_q_up_proj.adapter.linear_out.weight").shape, (Shape{8 * (8 + 4), 4}));
    EXPECT_EQ(t.at(a + "linear_kv_up_proj.adapter.linear_in.weight").shape, (Shape{4, 16}));
    EXPECT_EQ(t.at(a + "linear_kv_up_proj.adapter.linear_out.weight").shape, (Shape{8 * (8 + 6), 4}));
    EXPECT_EQ(t.at(a + "linear_kv_up_proj.adapter.linear_out.weight").split, TpSplit::kColumn);
    EXPECT_EQ(t.at(a + "linear_proj.adapter.linear_in.weight").shape, (Shape{4, 8 * 6}));
    // The module order: queries', keys' and values', then the output projection.
    EXPECT_EQ((*tensors)[10].name, "decoder.layers.1.self_attention.linear_q_down_proj.adapter.linear_in.weight");
    EXPECT_EQ((*tensors)[18].name, "decoder.layers.1.self_attention.linear_proj.adapter.linear_in.weight");
    // Canonical: the same single adapters (nothing is fused).
    c.type = LoraType::kCanonical;
    const auto canonical = lora_tensors(s, c);
    ASSERT_TRUE(canonical.ok());
    EXPECT_EQ(canonical->size(), tensors->size());
    c.type = LoraType::kLora;
  }
  EXPECT_TRUE(model_has_lora_target(s, "linear_q_up_proj"));
  EXPECT_FALSE(model_has_lora_target(s, "linear_q_proj"));
  EXPECT_FALSE(model_has_lora_target(s, "linear_qkv"));
  EXPECT_FALSE(model_has_lora_target(llama_like(), "linear_kv_up_proj"));

  const GptModelSpec no_query_latent = latent_attention(0);
  c.targets = {"linear_q_proj", "linear_kv_up_proj"};
  const auto tensors = lora_tensors(no_query_latent, c);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  const auto t = by_name(*tensors);
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_q_proj.adapter.linear_in.weight").shape, (Shape{4, 64}));
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_q_proj.adapter.linear_out.weight").shape,
            (Shape{8 * 12, 4}));
  EXPECT_EQ(lora_parts(no_query_latent, 0, "linear_q_proj", LoraType::kCanonical).size(), 1u);
  EXPECT_TRUE(lora_parts(no_query_latent, 0, "linear_q_down_proj", LoraType::kLora).empty());
}

TEST(LoraSpecTest, RankSixteenAdaptersOfAOneBillionModelAreUnderOnePercent) {
  GptModelSpec s;
  s.num_layers = 22;
  s.hidden_size = 2048;
  s.ffn_hidden_size = 5632;
  s.num_attention_heads = 32;
  s.num_query_groups = 4;
  s.kv_channels = 64;
  s.vocab_size = 32000;
  LoraConfig c;
  c.rank = 16;
  c.alpha = 32;
  auto count = [](const std::vector<CanonicalTensor>& tensors) {
    std::int64_t n = 0;
    for (const auto& t : tensors) n += numel(t.shape);
    return n;
  };
  const auto adapters = lora_tensors(s, c);
  const auto base = canonical_tensors(s);
  ASSERT_TRUE(adapters.ok() && base.ok());
  const double share = static_cast<double>(count(*adapters)) / static_cast<double>(count(*base));
  EXPECT_LT(share, 0.01) << share;
  EXPECT_GT(share, 0.009) << share;  // 10.5 M of 1.1 B
}

TEST(LoraSpecTest, JsonRoundTrip) {
  LoraConfig c;
  c.rank = 16;
  c.alpha = 32;
  c.dropout = 0.05;
  c.type = LoraType::kCanonical;
  c.targets = {"linear_proj"};
  const auto j = lora_to_json(c, LoraBase{"/ckpt/iter_0000010", "0123456789abcdef", "fedcba9876543210"});
  const auto back = lora_config_from_json(j, "m");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->rank, 16);
  EXPECT_DOUBLE_EQ(back->alpha, 32);
  EXPECT_DOUBLE_EQ(back->dropout, 0.05);
  EXPECT_EQ(back->type, LoraType::kCanonical);
  EXPECT_EQ(back->targets, std::vector<std::string>{"linear_proj"});
  c.type = LoraType::kPeft;
  EXPECT_EQ(lora_config_from_json(lora_to_json(c, LoraBase{}), "m")->type, LoraType::kPeft);
  const auto base = lora_base_from_json(j, "m");
  ASSERT_TRUE(base.ok());
  EXPECT_EQ(base->path, "/ckpt/iter_0000010");
  EXPECT_EQ(base->manifest_digest, "0123456789abcdef");
  EXPECT_EQ(base->weights_origin, "fedcba9876543210");
  // Written before the origin was recorded: the base is its own origin.
  auto older = j;
  older["base"].erase("weights_origin_xxh3_64");
  EXPECT_EQ(lora_base_from_json(older, "m")->weights_origin, "0123456789abcdef");
  for (const nlohmann::json& bad : {nlohmann::json(7), nlohmann::json("FEDCBA9876543210"), nlohmann::json("fedcba98"),
                                    nlohmann::json("fedcba987654321g")}) {
    older["base"]["weights_origin_xxh3_64"] = bad;
    EXPECT_TRUE(fails_with(lora_base_from_json(older, "m"),
                           "m (model.lora.base).weights_origin_xxh3_64 is " + bad.dump() +
                               ", expected the 16 lower-case hexadecimal digits of a manifest's digest"));
  }
  older = j;
  older["base"]["manifest_xxh3_64"] = "0123456789ABCDEF";
  EXPECT_TRUE(
      fails_with(lora_base_from_json(older, "m"), "m (model.lora.base).manifest_xxh3_64 is \"0123456789ABCDEF\""));
  auto broken = j;
  broken.erase("rank");
  EXPECT_TRUE(fails_with(lora_config_from_json(broken, "m"), "m (model.lora) has no integer rank"));
  broken = j;
  broken["type"] = "dora";
  const auto refused = lora_config_from_json(broken, "m");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("dora"), std::string::npos);
}

TEST(LoraSpecTest, RefusesWhatTheModelCannotTake) {
  LoraConfig c;
  c.rank = 4;
  c.alpha = 4;
  GptModelSpec s = llama_like();
  c.targets = {"linear_q"};
  EXPECT_NE(check_lora_config(c, s).message().find("linear_q'"), std::string::npos);
  c.targets = {"linear_qkv", "linear_qkv"};
  EXPECT_TRUE(fails_with(check_lora_config(c, s), "LoRA target module 'linear_qkv' is given twice"));
  c.targets = {"linear_qkv"};
  c.rank = 0;
  EXPECT_TRUE(fails_with(check_lora_config(c, s), "the LoRA rank must be positive, not 0"));
  c.rank = 4;
  c.dropout = 1.0;
  EXPECT_TRUE(fails_with(check_lora_config(c, s), "the LoRA dropout must be in [0, 1)"));
  c.dropout = 0;
  c.targets = {"linear_kv_up_proj"};
  EXPECT_TRUE(fails_with(check_lora_config(c, s), "LoRA target linear_kv_up_proj: the model has no multi-latent "
                                                 "attention"));
  s = latent_attention(24);
  c.targets = {"linear_qkv"};
  EXPECT_TRUE(fails_with(check_lora_config(c, s), "the model's multi-latent attention has no linear_qkv (its "
                                                 "projections are linear_q_down_proj, linear_q_up_proj"));
  c.targets = {"linear_q_proj"};
  EXPECT_TRUE(fails_with(check_lora_config(c, s), "projects its queries through a latent"));
  s = latent_attention(0);
  c.targets = {"linear_q_up_proj"};
  EXPECT_TRUE(fails_with(check_lora_config(c, s), "has no query latent (q_lora_rank 0)"));
  c.targets = {"linear_q_proj", "linear_kv_down_proj"};
  EXPECT_TRUE(check_lora_config(c, s).ok());
}

}  // namespace
}  // namespace trestle
