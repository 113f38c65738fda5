// The Megatron side of a GPT model without any Hugging Face plan: its canonical tensors (names, shapes, splits,
// placement) and every rank's pieces of them, which together cover each tensor exactly once per data-parallel replica.
#include "parallel/layout/model_spec.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

#include "parallel/layout/placement.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

GptModelSpec llama_like() {
  GptModelSpec s;
  s.num_layers = 4;
  s.hidden_size = 64;
  s.ffn_hidden_size = 96;
  s.num_attention_heads = 8;
  s.num_query_groups = 4;
  s.kv_channels = 8;
  s.vocab_size = 300;
  return s;
}

std::map<std::string, CanonicalTensor> by_name(const std::vector<CanonicalTensor>& tensors) {
  std::map<std::string, CanonicalTensor> out;
  for (const auto& t : tensors) EXPECT_TRUE(out.emplace(t.name, t).second) << "duplicate " << t.name;
  return out;
}

TEST(ModelSpecTest, DenseModelTensors) {
  const auto tensors = canonical_tensors(llama_like());
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  const auto t = by_name(*tensors);
  EXPECT_EQ(tensors->size(), 1u + 4u * 6u + 2u);  // embedding, 6 per layer, final norm and output layer
  EXPECT_EQ(tensors->front().name, "embedding.word_embeddings.weight");
  EXPECT_EQ(tensors->back().name, "output_layer.weight");
  const auto& qkv = t.at("decoder.layers.2.self_attention.linear_qkv.weight");
  EXPECT_EQ(qkv.shape, (Shape{(8 + 2 * 4) * 8, 64}));
  EXPECT_EQ(qkv.split, TpSplit::kColumn);
  EXPECT_EQ(qkv.layer, 2);
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_proj.weight").shape, (Shape{64, 64}));
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_proj.weight").split, TpSplit::kRow);
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc1.weight").shape, (Shape{192, 64}));
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc1.weight").split, TpSplit::kGatedColumn);
  EXPECT_EQ(t.at("decoder.layers.0.mlp.linear_fc2.weight").shape, (Shape{64, 96}));
  EXPECT_EQ(t.at("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight").shape, (Shape{64}));
  EXPECT_TRUE(t.count("decoder.layers.3.mlp.linear_fc1.layer_norm_weight"));
  EXPECT_EQ(t.at("embedding.word_embeddings.weight").placement, Placement::kFirstStage);
  EXPECT_EQ(t.at("embedding.word_embeddings.weight").shape, (Shape{300, 64}));  // unpadded
  EXPECT_EQ(t.at("decoder.final_layernorm.weight").placement, Placement::kLastStage);
}

TEST(ModelSpecTest, MlpSizesMustSplitOverTheirTensorParallelRanks) {
  GptModelSpec s = llama_like();  // ffn 96
  EXPECT_TRUE(check_mlp_split(s, 4, 4).ok());
  s.ffn_hidden_size = 97;
  EXPECT_TRUE(
      fails_with(check_mlp_split(s, 2, 2),
                 "ffn_hidden_size (the MLP's hidden size: intermediate_size in config.json) 97 is not divisible "
                 "by the tensor-parallel size 2"));
  // MoE: the experts over their own tp, the shared experts and the dense layers over tp.
  s.num_experts = 4;
  s.ffn_hidden_size = 6;
  s.moe_first_dense_layers = 1;
  s.dense_ffn_hidden_size = 96;
  s.shared_expert_ffn_hidden_size = 12;
  EXPECT_TRUE(check_mlp_split(s, 2, 2).ok());
  EXPECT_TRUE(check_mlp_split(s, 4, 2).ok());
  EXPECT_TRUE(fails_with(check_mlp_split(s, 4, 4),
                         "moe_ffn_hidden_size (each routed expert's hidden size) 6 is not "
                         "divisible by the tensor-parallel size 4"));
  EXPECT_TRUE(fails_with(check_mlp_split(s, 2, 4), "6 is not divisible by the experts' tensor-parallel size 4"));
  s.shared_expert_ffn_hidden_size = 10;
  EXPECT_TRUE(fails_with(check_mlp_split(s, 4, 2),
                         "moe_shared_expert_intermediate_size (the shared experts' hidden "
                         "size) 10 is not divisible by the tensor-parallel size 4"));
  s.shared_expert_ffn_hidden_size = 0;
  s.dense_ffn_hidden_size = 98;
  EXPECT_TRUE(fails_with(check_mlp_split(s, 4, 2),
                         "ffn_hidden_size (the MLP's hidden size: intermediate_size in "
                         "config.json) 98 is not divisible by the tensor-parallel size 4"));
}

TEST(ModelSpecTest, OptionsChangeTheTensorSet) {
  GptModelSpec s = llama_like();
  s.tied_embeddings = true;
  s.add_qkv_bias = true;
  s.qk_layernorm = true;
  s.norms = NormNaming::kLocal;
  const auto tensors = canonical_tensors(s);
  ASSERT_TRUE(tensors.ok());
  const auto t = by_name(*tensors);
  EXPECT_FALSE(t.count("output_layer.weight"));
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.linear_qkv.bias").shape, (Shape{128}));
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.q_layernorm.weight").shape, (Shape{8}));
  EXPECT_TRUE(t.count("decoder.layers.1.input_layernorm.weight"));
  EXPECT_TRUE(t.count("decoder.layers.1.pre_mlp_layernorm.weight"));
  s = llama_like();
  s.num_experts = 4;
  const auto moe = canonical_tensors(s);
  ASSERT_TRUE(moe.ok());
  const auto m = by_name(*moe);
  EXPECT_EQ(m.at("decoder.layers.0.mlp.router.weight").shape, (Shape{4, 64}));
  EXPECT_EQ(m.at("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight").expert, 3);
  EXPECT_TRUE(m.count("decoder.layers.0.pre_mlp_layernorm.weight")) << "MoE layers keep pre_mlp_layernorm under TE";
  EXPECT_FALSE(m.count("decoder.layers.0.mlp.linear_fc1.weight"));
}

TEST(ModelSpecTest, Olmo2HasPostNormsOnlyAndWholeProjectionQkNorms) {
  GptModelSpec s = llama_like();  // 8 heads, 4 groups, kv_channels 8
  s.qk_layernorm = s.post_norms = s.qk_norm_full_projection = true;
  s.pre_norms = false;
  const auto tensors = canonical_tensors(s);
  ASSERT_TRUE(tensors.ok());
  const auto t = by_name(*tensors);
  EXPECT_FALSE(t.count("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"));
  EXPECT_FALSE(t.count("decoder.layers.0.mlp.linear_fc1.layer_norm_weight"));
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.q_layernorm.weight").shape, (Shape{64}));
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.k_layernorm.weight").shape, (Shape{32}));
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.k_layernorm.weight").split, TpSplit::kReplicated);
  EXPECT_TRUE(t.count("decoder.layers.0.self_attention.linear_proj.post_layernorm.weight"));
  EXPECT_TRUE(t.count("decoder.layers.0.mlp.linear_fc2.post_layernorm.weight"));
  const auto from_json = gpt_spec_from_json({{"megatron",
                                              {{"num_layers", 4},
                                               {"hidden_size", 64},
                                               {"ffn_hidden_size", 96},
                                               {"num_attention_heads", 8},
                                               {"num_query_groups", 4},
                                               {"vocab_size", 300},
                                               {"qk_layernorm", true},
                                               {"post_layernorms", true},
                                               {"pre_layernorms", false},
                                               {"qk_layernorm_full_projection", true}}}},
                                            "test");
  ASSERT_TRUE(from_json.ok()) << from_json.status().message();
  EXPECT_FALSE(from_json->pre_norms);
  EXPECT_TRUE(from_json->qk_norm_full_projection);
}

TEST(ModelSpecTest, RefusesInconsistentSizes) {
  GptModelSpec s = llama_like();
  s.num_query_groups = 3;
  EXPECT_TRUE(fails_with(canonical_tensors(s), "num_attention_heads (8) is not a multiple of num_query_groups (3)"));
  s = llama_like();
  s.hidden_size = 0;
  EXPECT_TRUE(fails_with(canonical_tensors(s), "model sizes must be positive"));
  // Counts from a file are checked before anything is listed (the fuzzer's Mixtral had 999,999,994 experts).
  s = llama_like();
  s.num_experts = 999'999'994;
  EXPECT_TRUE(fails_with(canonical_tensors(s), "4 layers (+ 0 multi-token-prediction) of 999999994 experts"));
  s.num_experts = 4096;
  s.num_layers = 4096;
  EXPECT_TRUE(fails_with(canonical_tensors(s), "at most 100000 layers, 100000 experts, 10000000 layer x expert pairs"));
  s.num_layers = 1'000'000'000'000;
  EXPECT_TRUE(fails_with(canonical_tensors(s), "more than Trestle lists"));
  // So are the heads, which the converters list by query group (a config's 2^31 heads of width 1 listed 6 billion).
  s = llama_like();
  s.num_attention_heads = s.num_query_groups = std::int64_t{1} << 31;
  s.kv_channels = 1;
  EXPECT_TRUE(fails_with(canonical_tensors(s), "4 layers (+ 0 multi-token-prediction) of 2147483648 attention heads"));
  s.num_attention_heads = s.num_query_groups = 4096;
  s.num_layers = 4096;
  EXPECT_TRUE(fails_with(canonical_tensors(s), "at most 100000 heads, 10000000 layer x head pairs"));
  s.num_layers = 2048;  // 8,388,608 pairs
  EXPECT_TRUE(canonical_tensors(s).ok());
  // And the widths, before a shape multiplies them: kv_channels 2^62 + 16 times 8 heads wrapped to 128 rows.
  s = llama_like();
  s.kv_channels = (std::int64_t{1} << 62) + 16;
  EXPECT_TRUE(fails_with(canonical_tensors(s),
                         "kv_channels 4611686018427387920 is more than Trestle holds (at most "
                         "4194304)"));
  s = llama_like();
  s.vocab_size = std::int64_t{1} << 40;
  EXPECT_TRUE(fails_with(canonical_tensors(s), "vocab_size 1099511627776 is more than Trestle holds"));
  s.vocab_size = std::int64_t{1} << 34;  // a large vocabulary is described (memory is checked where it is allocated)
  EXPECT_TRUE(canonical_tensors(s).ok());
}

// The converters' model JSON ("megatron" block, "parallel".norm_naming) gives the spec the forward needs.
TEST(ModelSpecTest, SpecFromConvertedModelJson) {
  const nlohmann::json model = {{"megatron",
                                 {{"num_layers", 2},
                                  {"hidden_size", 64},
                                  {"ffn_hidden_size", 96},
                                  {"num_attention_heads", 8},
                                  {"num_query_groups", 2},
                                  {"kv_channels", 16},
                                  {"vocab_size", 1000},
                                  {"untie_embeddings_and_output_weights", false},
                                  {"add_qkv_bias", true},
                                  {"qk_layernorm", true},
                                  {"norm_epsilon", 1e-6},
                                  {"rotary_base", 500000.0},
                                  {"rope_scaling",
                                   {{"type", "llama3"},
                                    {"factor", 8.0},
                                    {"low_freq_factor", 2.0},
                                    {"high_freq_factor", 4.0},
                                    {"original_max_position_embeddings", 64}}},
                                  {"window_size", {4, 0}}}},
                                {"parallel", {{"tp", 2}, {"norm_naming", "local"}}}};
  auto spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->num_layers, 2);
  EXPECT_EQ(spec->num_query_groups, 2);
  EXPECT_EQ(spec->kv_channels, 16);
  EXPECT_TRUE(spec->tied_embeddings);
  EXPECT_TRUE(spec->add_qkv_bias);
  EXPECT_TRUE(spec->qk_layernorm);
  EXPECT_DOUBLE_EQ(spec->norm_epsilon, 1e-6);
  EXPECT_DOUBLE_EQ(spec->rotary_base, 500000.0);
  EXPECT_EQ(spec->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(spec->rope_scaling.low_freq_factor, 2.0);
  EXPECT_EQ(spec->rope_scaling.original_max_position_embeddings, 64);
  EXPECT_EQ(spec->window_size, 5);  // Megatron's (4, 0): the query and the 4 before it
  EXPECT_EQ(spec->norms, NormNaming::kLocal);

  nlohmann::json plain = model;
  plain["megatron"].erase("rope_scaling");
  plain["megatron"].erase("window_size");
  plain["megatron"].erase("norm_epsilon");
  plain.erase("parallel");
  spec = gpt_spec_from_json(plain, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->rope_scaling.type, RopeScalingType::kNone);
  EXPECT_EQ(spec->window_size, 0);
  EXPECT_DOUBLE_EQ(spec->norm_epsilon, 1e-5);
  EXPECT_EQ(spec->norms, NormNaming::kTransformerEngine);
}

// Gemma's description: windows on some layers only (Megatron's window_attn_skip_freq, as a frequency or one 0/1 per
// layer), its attention scale, the scaled embedding and the windowed layers' own RoPE base.
TEST(ModelSpecTest, GemmaWindowsPerLayerAndItsScales) {
  nlohmann::json model = {{"megatron",
                           {{"num_layers", 4},
                            {"hidden_size", 64},
                            {"ffn_hidden_size", 96},
                            {"num_attention_heads", 4},
                            {"vocab_size", 100},
                            {"window_size", {7, 0}},
                            {"mixed_attention", true},
                            {"window_attn_skip_freq", {1, 1, 0, 1}},
                            {"query_pre_attn_scalar", 24.0},
                            {"scale_embeddings", true},
                            {"rope_local_base_freq", 10000.0}}}};
  auto spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->window_size, 8);
  EXPECT_EQ(spec->window_layers, (std::vector<bool>{true, true, false, true}));
  EXPECT_TRUE(spec->layer_has_window(1));
  EXPECT_FALSE(spec->layer_has_window(2));
  EXPECT_DOUBLE_EQ(spec->query_pre_attn_scalar, 24.0);
  EXPECT_TRUE(spec->scale_embeddings);
  EXPECT_DOUBLE_EQ(spec->rotary_base_local, 10000.0);

  model["megatron"]["window_attn_skip_freq"] = 2;  // every 2nd layer (counting from 1) is a full one
  spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->window_layers, (std::vector<bool>{true, false, true, false}));

  model["megatron"]["mixed_attention"] = false;  // a window in every layer
  spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_TRUE(spec->layer_has_window(3));

  model["megatron"]["mixed_attention"] = true;
  for (const nlohmann::json& bad :
       {nlohmann::json{1, 0}, nlohmann::json{1, 0, 2, 1}, nlohmann::json(0), nlohmann::json("2"), nlohmann::json()}) {
    model["megatron"]["window_attn_skip_freq"] = bad;
    spec = gpt_spec_from_json(model, "m.json");
    ASSERT_FALSE(spec.ok()) << bad.dump();
    EXPECT_NE(spec.status().message().find("window_attn_skip_freq"), std::string::npos) << spec.status().message();
  }
}

// Qwen3-Next / Qwen3.5: Gated DeltaNet layers where linear_attention_freq has a 1, with in_proj and conv1d as
// Megatron-Core saves them (split into their parts, each split over tp by heads), and gated attention elsewhere.
TEST(ModelSpecTest, GatedDeltaNetLayersAndGatedAttention) {
  nlohmann::json model = {{"megatron",
                           {{"num_layers", 4},
                            {"hidden_size", 32},
                            {"ffn_hidden_size", 40},
                            {"num_attention_heads", 4},
                            {"num_query_groups", 2},
                            {"kv_channels", 16},
                            {"vocab_size", 100},
                            {"attention_output_gate", true},
                            {"experimental_attention_variant", "gated_delta_net"},
                            {"linear_attention_freq", {1, 0, 1, 0}},
                            {"linear_conv_kernel_dim", 4},
                            {"linear_key_head_dim", 8},
                            {"linear_value_head_dim", 6},
                            {"linear_num_key_heads", 2},
                            {"linear_num_value_heads", 4}}},
                          {"parallel", {{"norm_naming", "transformer_engine"}}}};
  auto spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->linear_attention_layers, (std::vector<bool>{true, false, true, false}));
  const auto tensors = canonical_tensors(*spec);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  const auto t = by_name(*tensors);
  const std::string gdn = "decoder.layers.0.self_attention.";
  EXPECT_EQ(t.at(gdn + "in_proj.layer_norm_weight").shape, (Shape{32}));
  for (const auto& [part, rows] : std::map<std::string, std::int64_t>{
           {"query", 16}, {"key", 16}, {"value", 24}, {"z", 24}, {"beta", 4}, {"alpha", 4}}) {
    EXPECT_EQ(t.at(gdn + "in_proj.weight." + part).shape, (Shape{rows, 32})) << part;
    EXPECT_EQ(t.at(gdn + "in_proj.weight." + part).split, TpSplit::kColumn) << part;
  }
  EXPECT_EQ(t.at(gdn + "conv1d.weight.value").shape, (Shape{24, 1, 4}));
  EXPECT_EQ(t.at(gdn + "A_log").split, TpSplit::kColumn);
  EXPECT_EQ(t.at(gdn + "out_norm.weight").shape, (Shape{6}));
  EXPECT_EQ(t.at(gdn + "out_proj.weight").split, TpSplit::kRow);
  EXPECT_FALSE(t.count(gdn + "linear_qkv.weight"));
  // Gated attention: per group 2 query heads, their 2 gates, a key and a value, of 16 dims each.
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.linear_qkv.weight").shape, (Shape{(2 * 4 + 2 * 2) * 16, 32}));
  EXPECT_FALSE(t.count("decoder.layers.1.self_attention.in_proj.weight.query"));

  model["megatron"]["linear_attention_freq"] = 2;  // every 2nd layer (counting from 1) is a full-attention one
  spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->linear_attention_layers, (std::vector<bool>{true, false, true, false}));
  model["megatron"]["linear_num_value_heads"] = 3;  // not a multiple of the key heads
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "the value heads a multiple of the key heads"));
  model["megatron"]["linear_num_value_heads"] = 4;
  model["megatron"].erase("linear_conv_kernel_dim");
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "gated_delta_net needs linear_conv_kernel_dim"));
  model["megatron"]["linear_conv_kernel_dim"] = 4;
  model["megatron"]["linear_attention_freq"] = {1, 0};
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "linear_attention_freq must be"));
  model["megatron"]["experimental_attention_variant"] = "dsa";
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "experimental_attention_variant \"dsa\""));
}

TEST(ModelSpecTest, NemotronHHybridLayersHoldOneMixerEach) {
  nlohmann::json model = {{"megatron",
                           {{"num_layers", 3},
                            {"hidden_size", 32},
                            {"ffn_hidden_size", 40},
                            {"num_attention_heads", 4},
                            {"num_query_groups", 2},
                            {"kv_channels", 8},
                            {"vocab_size", 100},
                            {"activation", "squared_relu"},
                            {"hybrid_override_pattern", "M*-"},
                            {"mamba_num_heads", 4},
                            {"mamba_head_dim", 6},
                            {"mamba_state_dim", 5},
                            {"mamba_num_groups", 2}}},
                          {"parallel", {{"norm_naming", "transformer_engine"}}}};
  auto spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_TRUE(spec->hybrid() && spec->squared_relu);
  EXPECT_EQ(spec->mamba_conv_kernel, 4);  // Megatron-Core's MambaMixer's
  auto tensors = canonical_tensors(*spec);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  auto t = by_name(*tensors);
  const std::string m = "decoder.layers.0.mixer.";
  EXPECT_EQ(t.at(m + "in_proj.layer_norm_weight").shape, (Shape{32}));
  for (const auto& [part, rows] : std::map<std::string, std::int64_t>{{"z", 24}, {"x", 24}, {"B", 10}, {"C", 10}, {"dt", 4}}) {
    EXPECT_EQ(t.at(m + "in_proj.weight." + part).shape, (Shape{rows, 32})) << part;
    EXPECT_EQ(t.at(m + "in_proj.weight." + part).split, TpSplit::kColumn) << part;
  }
  EXPECT_EQ(t.at(m + "conv1d.weight.B").shape, (Shape{10, 1, 4}));
  EXPECT_EQ(t.at(m + "conv1d.bias.x").shape, (Shape{24}));
  for (const char* v : {"A_log", "D", "dt_bias"}) EXPECT_EQ(t.at(m + v).shape, (Shape{4})) << v;
  EXPECT_EQ(t.at(m + "norm.weight").split, TpSplit::kColumn);
  EXPECT_EQ(t.at(m + "out_proj.weight").split, TpSplit::kRow);
  EXPECT_FALSE(t.count("decoder.layers.0.self_attention.linear_qkv.weight"));
  EXPECT_FALSE(t.count("decoder.layers.0.mlp.linear_fc1.weight"));
  // Attention alone (no MLP), an MLP alone (not gated: fc1 has ffn rows), the MambaModel's final norm.
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.linear_qkv.weight").shape, (Shape{(4 + 2 * 2) * 8, 32}));
  EXPECT_FALSE(t.count("decoder.layers.1.mlp.linear_fc1.weight"));
  EXPECT_EQ(t.at("decoder.layers.2.mlp.linear_fc1.weight").shape, (Shape{40, 32}));
  EXPECT_EQ(t.at("decoder.layers.2.mlp.linear_fc1.weight").split, TpSplit::kColumn);
  EXPECT_FALSE(t.count("decoder.layers.2.self_attention.linear_qkv.weight"));
  EXPECT_TRUE(t.count("decoder.final_norm.weight") && !t.count("decoder.final_layernorm.weight"));
  EXPECT_EQ(tensors->size(), 1 + (1 + 5 + 6 + 5) + 3 + 3 + 1 + 1);

  model["parallel"]["norm_naming"] = "local";
  spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  t = by_name(*canonical_tensors(*spec));
  EXPECT_TRUE(t.count("decoder.layers.0.norm.weight") && t.count("decoder.layers.1.input_layernorm.weight") &&
              t.count("decoder.layers.2.pre_mlp_layernorm.weight"));

  model["megatron"]["hybrid_override_pattern"] = "M*X";
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "hybrid_override_pattern holds 'X'"));
  model["megatron"]["hybrid_override_pattern"] = "M*E";  // an MoE layer in a model without experts
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "experts exactly when it has E layers"));
  model["megatron"]["hybrid_override_pattern"] = "M*";
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "one M, *, - or E per layer (3)"));
  model["megatron"]["hybrid_override_pattern"] = "M*-";
  model["megatron"].erase("mamba_state_dim");
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "a hybrid model needs mamba_state_dim"));
  model["megatron"]["mamba_state_dim"] = 5;
  model["megatron"]["mamba_num_heads"] = 3;
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "the heads a multiple of the groups"));
}

TEST(ModelSpecTest, NemotronHMoeLayersWithLatentExperts) {
  nlohmann::json model = {{"megatron",
                           {{"num_layers", 3},
                            {"hidden_size", 32},
                            {"ffn_hidden_size", 16},
                            {"dense_ffn_hidden_size", 40},
                            {"num_attention_heads", 4},
                            {"num_query_groups", 2},
                            {"kv_channels", 8},
                            {"vocab_size", 100},
                            {"activation", "squared_relu"},
                            {"hybrid_override_pattern", "M-E"},
                            {"mamba_num_heads", 4},
                            {"mamba_head_dim", 6},
                            {"mamba_state_dim", 5},
                            {"mamba_num_groups", 2},
                            {"num_experts", 4},
                            {"moe_shared_expert_intermediate_size", 24},
                            {"moe_router_enable_expert_bias", true},
                            {"moe_latent_size", 12}}},
                          {"parallel", {{"norm_naming", "transformer_engine"}}}};
  auto spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_FALSE(spec->layer_is_moe(0) || spec->layer_is_moe(1));
  EXPECT_TRUE(spec->layer_is_moe(2));
  const auto tensors = canonical_tensors(*spec);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  const auto t = by_name(*tensors);
  EXPECT_EQ(t.at("decoder.layers.1.mlp.linear_fc1.weight").shape, (Shape{40, 32}));  // the MLP layer's own size
  const std::string p = "decoder.layers.2.";
  EXPECT_TRUE(t.count(p + "pre_mlp_layernorm.weight"));  // not fused in an MoE layer
  EXPECT_EQ(t.at(p + "mlp.router.expert_bias").shape, (Shape{4}));
  EXPECT_EQ(t.at(p + "mlp.experts.local_experts.3.linear_fc1.weight").shape, (Shape{16, 12}));  // not gated, latent
  EXPECT_EQ(t.at(p + "mlp.experts.local_experts.3.linear_fc1.weight").expert, 3);
  EXPECT_EQ(t.at(p + "mlp.experts.local_experts.0.linear_fc2.weight").shape, (Shape{12, 16}));
  EXPECT_EQ(t.at(p + "mlp.shared_experts.linear_fc1.weight").shape, (Shape{24, 32}));
  EXPECT_EQ(t.at(p + "mlp.fc1_latent_proj.weight").shape, (Shape{12, 32}));
  EXPECT_EQ(t.at(p + "mlp.fc2_latent_proj.weight").split, TpSplit::kReplicated);
  EXPECT_FALSE(t.count(p + "mlp.linear_fc1.weight"));
  model["megatron"].erase("num_experts");
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "experts exactly when it has E layers"));
}

TEST(ModelSpecTest, CarriedTensorsTravelReplicatedOnTheFirstStage) {
  // A vision-language model's vision tower (Qwen3-VL's vision_model.*): listed after the output layer, whole on every
  // tp rank of the first stage; names and shapes checked as they come from a file.
  nlohmann::json model = {{"megatron",
                           {{"num_layers", 2},
                            {"hidden_size", 32},
                            {"ffn_hidden_size", 40},
                            {"num_attention_heads", 4},
                            {"num_query_groups", 2},
                            {"kv_channels", 8},
                            {"vocab_size", 100},
                            {"carried_tensors",
                             {{{"name", "vision_model.patch_embed.proj.weight"}, {"shape", {16, 3, 2, 4, 4}}},
                              {{"name", "vision_model.merger.norm.bias"}, {"shape", {16}}}}}}}};
  auto spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  const auto tensors = canonical_tensors(*spec);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  EXPECT_EQ(tensors->back().name, "vision_model.merger.norm.bias");
  const auto t = by_name(*tensors);
  const CanonicalTensor& patch = t.at("vision_model.patch_embed.proj.weight");
  EXPECT_EQ(patch.shape, (Shape{16, 3, 2, 4, 4}));
  EXPECT_EQ(patch.split, TpSplit::kReplicated);
  EXPECT_EQ(patch.placement, Placement::kFirstStage);
  model["megatron"]["carried_tensors"][1]["name"] = "decoder.final_layernorm.weight";  // one the model has
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "is not a printable name of its own"));
  model["megatron"]["carried_tensors"][1] = {{"name", "vision_model.x"}, {"shape", {16, 0}}};
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "vision_model.x's shape [16,0] is not of positive"));
  model["megatron"]["carried_tensors"][1] = {{"name", "vision_model.x"}, {"shape", {1LL << 40, 1LL << 20}}};
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "not positive or too large"));
  model["megatron"]["carried_tensors"] = "vision";
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "carried_tensors must be a list"));
}

TEST(ModelSpecTest, Gemma4LayersDifferByLayer) {
  // Gemma 4: layers 1 and 3 full-attention with heads 16 wide and one KV head whose keys are its values ([queries;
  // key] per group), the last layer sharing keys and values (queries alone) with a double-wide MLP, per-layer inputs
  // and layer scalars; with experts, the MLP as shared experts beside them with the router's scales and extra norms.
  nlohmann::json model = {{"megatron",
                           {{"num_layers", 4},
                            {"hidden_size", 32},
                            {"ffn_hidden_size", 40},
                            {"num_attention_heads", 4},
                            {"num_query_groups", 2},
                            {"kv_channels", 8},
                            {"vocab_size", 100},
                            {"window_size", {3, 0}},
                            {"mixed_attention", true},
                            {"window_attn_skip_freq", {1, 0, 1, 0}},
                            {"qk_layernorm", true},
                            {"layer_kv_channels", {8, 16, 8, 16}},
                            {"layer_query_groups", {2, 1, 2, 1}},
                            {"attention_k_eq_v", true},
                            {"kv_shared_layers", 1},
                            {"double_wide_mlp", true},
                            {"layer_scalar", true},
                            {"per_layer_input_size", 6},
                            {"per_layer_vocab_size", 50},
                            {"post_layernorms", true}}}};
  auto spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  auto tensors = canonical_tensors(*spec);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  auto t = by_name(*tensors);
  EXPECT_EQ(t.at("decoder.layers.0.self_attention.linear_qkv.weight").shape, (Shape{4 * 8 + 2 * 2 * 8, 32}));
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.linear_qkv.weight").shape, (Shape{4 * 16 + 16, 32}));
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.k_layernorm.weight").shape, (Shape{16}));
  EXPECT_EQ(t.at("decoder.layers.1.self_attention.linear_proj.weight").shape, (Shape{32, 64}));
  EXPECT_EQ(t.at("decoder.layers.3.self_attention.linear_q_proj.weight").shape, (Shape{64, 32}));
  EXPECT_FALSE(t.count("decoder.layers.3.self_attention.linear_qkv.weight"));
  EXPECT_FALSE(t.count("decoder.layers.3.self_attention.k_layernorm.weight"));
  EXPECT_TRUE(t.count("decoder.layers.3.input_layernorm.weight"));
  EXPECT_EQ(t.at("decoder.layers.3.mlp.linear_fc1.weight").shape, (Shape{160, 32}));
  EXPECT_EQ(t.at("decoder.layers.2.mlp.linear_fc1.weight").shape, (Shape{80, 32}));
  EXPECT_EQ(t.at("per_layer_embedding.weight").shape, (Shape{50, 24}));
  EXPECT_EQ(t.at("per_layer_model_proj.weight").placement, Placement::kFirstStage);
  EXPECT_EQ(t.at("decoder.layers.2.per_layer_input_gate.weight").shape, (Shape{6, 32}));
  EXPECT_EQ(t.at("decoder.layers.2.layer_scalar").shape, (Shape{1}));
  // A dense Gemma 4's norms after attention and the MLP: Megatron-Bridge's names for it.
  EXPECT_TRUE(t.count("decoder.layers.0.post_self_attn_layernorm.weight"));
  EXPECT_TRUE(t.count("decoder.layers.3.post_mlp_layernorm.weight"));
  EXPECT_FALSE(t.count("decoder.layers.0.self_attention.linear_proj.post_layernorm.weight"));
  // Layer 3 (full attention) reuses layer 1's keys and values, the last full-attention layer before it.
  EXPECT_EQ(spec->kv_source_layer(3), 1);
  EXPECT_EQ(spec->kv_source_layer(2), -1);
  EXPECT_EQ(spec->softmax_scale, 0.0);
  EXPECT_FALSE(spec->value_norm);

  model["megatron"].update({{"softmax_scale", 1.0}, {"value_norm", true}, {"global_rope_fraction", 0.25}});
  spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->softmax_scale, 1.0);
  EXPECT_TRUE(spec->value_norm);
  EXPECT_EQ(spec->global_rope_fraction, 0.25);
  model["megatron"]["global_rope_fraction"] = 1.5;
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "global_rope_fraction must be in [0, 1]"));
  model["megatron"]["global_rope_fraction"] = 0.25;

  model["megatron"].update({{"num_experts", 4}, {"moe_ffn_hidden_size", 12}, {"ffn_hidden_size", 12},
                            {"moe_shared_expert_intermediate_size", 40}, {"moe_beside_mlp", true},
                            {"post_layernorms", true}, {"per_layer_input_size", 0}, {"per_layer_vocab_size", 0}});
  spec = gpt_spec_from_json(model, "m.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  tensors = canonical_tensors(*spec);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  t = by_name(*tensors);
  EXPECT_EQ(t.at("decoder.layers.0.mlp.router.scale").shape, (Shape{32}));
  EXPECT_EQ(t.at("decoder.layers.0.mlp.router.per_expert_scale").shape, (Shape{4}));
  EXPECT_EQ(t.at("decoder.layers.3.mlp.shared_experts.linear_fc1.weight").shape, (Shape{160, 32}));
  for (const char* name : {"pre_shared_expert_layernorm.weight", "mlp.post_shared_expert_layernorm.weight",
                           "mlp.post_moe_layernorm.weight", "post_ffn_layernorm.weight", "pre_mlp_layernorm.weight",
                           "self_attention.linear_proj.post_layernorm.weight"})
    EXPECT_TRUE(t.count(std::string("decoder.layers.0.") + name)) << name;
  EXPECT_FALSE(t.count("per_layer_embedding.weight"));

  model["megatron"]["layer_query_groups"] = {2, 3, 2, 1};  // 3 does not divide 4 heads
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "dividing the attention heads"));
  model["megatron"]["layer_query_groups"] = {2, 1};
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "m.json"), "layer_query_groups must list one positive integer"));
}

TEST(ModelSpecTest, SpecFromJsonNamesWhatIsWrong) {
  nlohmann::json model = {
      {"megatron", {{"num_layers", 2}, {"hidden_size", 64}, {"num_attention_heads", 8}, {"vocab_size", 100}}}};
  auto spec = gpt_spec_from_json(model, "m.json");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("ffn_hidden_size"), std::string::npos) << spec.status().message();
  model["megatron"]["ffn_hidden_size"] = "96";
  spec = gpt_spec_from_json(model, "m.json");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("ffn_hidden_size has the wrong type"), std::string::npos);
  model["megatron"]["ffn_hidden_size"] = 96;
  model["megatron"]["rope_scaling"] = {{"type", "yarn"}};
  spec = gpt_spec_from_json(model, "m.json");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(spec.status().message().find("yarn"), std::string::npos);
  EXPECT_TRUE(fails_with(gpt_spec_from_json(nlohmann::json::object(), "m.json"),
                         "m.json: the model has no \"megatron\" block"));
}

// Every element of every weight is held by exactly one rank of each data-parallel replica, and each rank holds only
// its own stage's layers and its own experts.
TEST(PlacementTest, PiecesCoverEveryTensorOncePerReplica) {
  GptModelSpec s = llama_like();
  s.num_experts = 4;
  ParallelLayout l;
  l.tp = 2;
  l.pp = 2;
  l.ep = 2;
  l.data_parallel = 4;
  const auto tensors = canonical_tensors(s);
  ASSERT_TRUE(tensors.ok());
  std::vector<PlacedTensor> placed;
  for (const auto& t : *tensors) placed.push_back({&t, Holding::kModelWeight, t.shape});
  const auto ranks = place_on_ranks(placed, s, l);
  ASSERT_TRUE(ranks.ok()) << ranks.status().message();
  ASSERT_EQ(ranks->size(), 16u);
  const auto stages = pipeline_layers(l, s.num_layers);
  ASSERT_TRUE(stages.ok());
  for (int dp_rank = 0; dp_rank < l.dp(); dp_rank += l.ep) {  // one expert group: dp ranks 0..ep-1 hold all experts
    std::map<std::size_t, std::int64_t> covered;
    for (int ep = 0; ep < l.ep; ++ep)
      for (int pp = 0; pp < l.pp; ++pp)
        for (int tp = 0; tp < l.tp; ++tp) {
          const int rank = global_rank(l, {.tp_rank = tp, .dp_rank = dp_rank + ep, .pp_rank = pp});
          const auto mine = pieces_of_rank(placed, s, l, rank);
          ASSERT_TRUE(mine.ok());
          ASSERT_EQ(mine->size(), (*ranks)[static_cast<std::size_t>(rank)].size());
          for (const auto& p : *mine) {
            const CanonicalTensor& t = (*tensors)[p.tensor];
            if (t.layer >= 0) {
              EXPECT_EQ(stage_of_layer(*stages, t.layer), pp) << t.name;
            }
            if (t.expert >= 0) {
              EXPECT_EQ(t.expert / 2, ep) << t.name;
            }
            covered[p.tensor] += p.piece.box.numel();
          }
        }
    for (std::size_t i = 0; i < tensors->size(); ++i) {
      const CanonicalTensor& t = (*tensors)[i];
      // Replicated tensors are held whole by every TP rank; the rest exactly once over the TP ranks.
      const std::int64_t copies =
          t.split == TpSplit::kReplicated ? l.tp * (t.expert >= 0 ? 1 : l.ep) : (t.expert >= 0 ? 1 : l.ep);
      EXPECT_EQ(covered[i], numel(t.shape) * copies) << t.name;
    }
  }
  EXPECT_TRUE(fails_with(pieces_of_rank(placed, s, l, 16), "rank 16 is outside the layout's 16 ranks"));
}

TEST(PlacementTest, ExpertsSplitOverTheirOwnTensorParallelRanks) {
  // tp 2 with whole experts (etp 1) over ep 2, and tp 1 with experts split over two data-parallel ranks (etp 2): in
  // each stage every expert element is held once per expert-data-parallel replica, every dense one as at tp.
  GptModelSpec s = llama_like();
  s.num_experts = 4;
  const auto tensors = canonical_tensors(s);
  ASSERT_TRUE(tensors.ok());
  std::vector<PlacedTensor> placed;
  for (const auto& t : *tensors) placed.push_back({&t, Holding::kModelWeight, t.shape});
  ParallelLayout whole;
  whole.tp = 2;
  whole.ep = 2;
  whole.etp = 1;
  whole.data_parallel = 2;
  ParallelLayout split;
  split.etp = 2;
  split.data_parallel = 4;
  for (const ParallelLayout& l : {whole, split}) {
    const auto ranks = place_on_ranks(placed, s, l);
    ASSERT_TRUE(ranks.ok()) << ranks.status().message();
    std::map<std::size_t, std::int64_t> covered;
    for (const auto& mine : *ranks)
      for (const auto& p : mine) covered[p.tensor] += p.piece.box.numel();
    for (std::size_t i = 0; i < tensors->size(); ++i) {
      const CanonicalTensor& t = (*tensors)[i];
      const int tp = t.expert >= 0 ? l.expert_tp() : l.tp;
      const std::int64_t replicas = t.expert >= 0 ? l.expert_dp() : l.dp();
      EXPECT_EQ(covered[i], numel(t.shape) * replicas * (t.split == TpSplit::kReplicated ? tp : 1))
          << t.name << " etp " << l.expert_tp();
    }
  }
  // At etp 1 beside tp 2 rank 1 (ep rank 1) holds experts 2 and 3 whole (a gated fc1 as its gate and up boxes).
  const auto rank1 = pieces_of_rank(placed, s, whole, 1);
  ASSERT_TRUE(rank1.ok());
  std::map<std::size_t, std::int64_t> held;
  for (const auto& p : *rank1)
    if ((*tensors)[p.tensor].expert >= 0) held[p.tensor] += p.piece.box.numel();
  EXPECT_FALSE(held.empty());
  for (const auto& [i, n] : held) {
    EXPECT_EQ(n, numel((*tensors)[i].shape)) << (*tensors)[i].name;
    EXPECT_EQ((*tensors)[i].expert / 2, 1) << (*tensors)[i].name;
  }
}

TEST(PlacementTest, OptimizerShardsSplitEachPieceOverDataParallelRanks) {
  const GptModelSpec s = llama_like();
  ParallelLayout l;
  l.tp = 2;
  l.data_parallel = 3;
  const auto tensors = canonical_tensors(s);
  ASSERT_TRUE(tensors.ok());
  const CanonicalTensor& fc2 = *std::find_if(tensors->begin(), tensors->end(), [](const CanonicalTensor& t) {
    return t.name == "decoder.layers.0.mlp.linear_fc2.weight";
  });
  const std::vector<PlacedTensor> placed{{&fc2, Holding::kOptimizerShard, fc2.shape}};
  std::int64_t total = 0;
  for (int rank = 0; rank < l.world_size(); ++rank) {
    const auto mine = pieces_of_rank(placed, s, l, rank);
    ASSERT_TRUE(mine.ok());
    ASSERT_EQ(mine->size(), 1u);
    ASSERT_TRUE((*mine)[0].piece.flat.has_value());
    total += (*mine)[0].piece.flat->stop - (*mine)[0].piece.flat->start;
  }
  EXPECT_EQ(total, numel(fc2.shape));
}

}  // namespace
}  // namespace trestle
