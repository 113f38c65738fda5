// Architecture tables and conversion plans: the Megatron names each architecture produces, which HF tensors feed them,
// the config checks, and the accounting that names leftovers.
#include "convert/bridge/bridge_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

using json = nlohmann::json;

json config(const std::string& architecture) {
  json c = {{"architectures", {architecture}},
            {"hidden_size", 32},
            {"intermediate_size", 48},
            {"num_hidden_layers", 2},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"head_dim", 8},  // (Qwen3's and Gemma's default is another: 128, 256)
            {"vocab_size", 100},
            {"max_position_embeddings", 64},
            {"tie_word_embeddings", false}};
  if (architecture == "MixtralForCausalLM") {
    c["num_local_experts"] = 4;
    c["num_experts_per_tok"] = 2;
  }
  if (architecture == "Qwen3MoeForCausalLM") {
    c["num_experts"] = 4;
    c["num_experts_per_tok"] = 2;
    c["moe_intermediate_size"] = 24;
  }
  return c;
}

Result<BridgePlan> plan_for(const json& c, NormNaming norms = NormNaming::kTransformerEngine,
                            ExpertLayout experts = ExpertLayout::kOriginal) {
  TRESTLE_ASSIGN_OR_RETURN(auto hf, parse_hf_config(c, "config.json"));
  TRESTLE_ASSIGN_OR_RETURN(auto model, bridge_model_from_config(hf));
  return make_bridge_plan(model, norms, experts);
}

std::set<std::string> megatron_names(const BridgePlan& p) {
  std::set<std::string> out;
  for (const auto& t : p.tensors) out.insert(t.name);
  return out;
}

const BridgeTensor& tensor(const BridgePlan& p, const std::string& name) {
  return *std::find_if(p.tensors.begin(), p.tensors.end(), [&](const BridgeTensor& t) { return t.name == name; });
}

TEST(BridgePlanTest, LlamaNamesShapesAndSplits) {
  auto p = plan_for(config("LlamaForCausalLM"));
  ASSERT_TRUE(p.ok()) << p.status().message();
  const std::set<std::string> expected = {"embedding.word_embeddings.weight",
                                          "decoder.final_layernorm.weight",
                                          "output_layer.weight",
                                          "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                                          "decoder.layers.0.self_attention.linear_qkv.weight",
                                          "decoder.layers.0.self_attention.linear_proj.weight",
                                          "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                                          "decoder.layers.0.mlp.linear_fc1.weight",
                                          "decoder.layers.0.mlp.linear_fc2.weight",
                                          "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
                                          "decoder.layers.1.self_attention.linear_qkv.weight",
                                          "decoder.layers.1.self_attention.linear_proj.weight",
                                          "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
                                          "decoder.layers.1.mlp.linear_fc1.weight",
                                          "decoder.layers.1.mlp.linear_fc2.weight"};
  EXPECT_EQ(megatron_names(*p), expected);
  const auto& qkv = tensor(*p, "decoder.layers.1.self_attention.linear_qkv.weight");
  EXPECT_EQ(qkv.shape, (Shape{64, 32}));  // 4 query heads + 2 KV groups × 2 of head dim 8
  EXPECT_EQ(qkv.split, TpSplit::kColumn);
  EXPECT_EQ(qkv.layer, 1);
  ASSERT_EQ(qkv.runs.size(), 6u);  // q, k, v per group
  EXPECT_EQ(p->hf[qkv.runs[1].hf_index].name, "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(qkv.runs[1].canonical_offset, 16 * 32);
  const auto& fc1 = tensor(*p, "decoder.layers.0.mlp.linear_fc1.weight");
  EXPECT_EQ(fc1.shape, (Shape{96, 32}));
  EXPECT_EQ(fc1.split, TpSplit::kGatedColumn);
  EXPECT_EQ(p->hf[fc1.runs[1].hf_index].name, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(tensor(*p, "output_layer.weight").split, TpSplit::kVocab);
  EXPECT_EQ(tensor(*p, "output_layer.weight").placement, Placement::kLastStage);
  EXPECT_EQ(tensor(*p, "decoder.layers.0.mlp.linear_fc2.weight").split, TpSplit::kRow);
  EXPECT_EQ(p->hf.size(), 3u + 2 * 9);
}

TEST(BridgePlanTest, TiedLocalNormsBiasAndQkNorm) {
  json c = config("Qwen2ForCausalLM");
  c["tie_word_embeddings"] = true;
  auto p = plan_for(c, NormNaming::kLocal);
  ASSERT_TRUE(p.ok()) << p.status().message();
  const auto names = megatron_names(*p);
  EXPECT_FALSE(names.count("output_layer.weight"));
  EXPECT_TRUE(names.count("decoder.layers.0.input_layernorm.weight"));
  EXPECT_TRUE(names.count("decoder.layers.0.pre_mlp_layernorm.weight"));
  EXPECT_EQ(tensor(*p, "decoder.layers.0.self_attention.linear_qkv.bias").shape, (Shape{64}));

  auto q3 = plan_for(config("Qwen3ForCausalLM"));
  ASSERT_TRUE(q3.ok());
  EXPECT_EQ(tensor(*q3, "decoder.layers.1.self_attention.k_layernorm.weight").shape, (Shape{8}));
  EXPECT_FALSE(megatron_names(*q3).count("decoder.layers.0.self_attention.linear_qkv.bias"));
}

TEST(BridgePlanTest, MixtralBothExpertLayouts) {
  auto original = plan_for(config("MixtralForCausalLM"));
  ASSERT_TRUE(original.ok()) << original.status().message();
  const auto& fc1 = tensor(*original, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight");
  EXPECT_EQ(fc1.expert, 3);
  EXPECT_EQ(fc1.shape, (Shape{96, 32}));
  EXPECT_EQ(original->hf[fc1.runs[0].hf_index].name, "model.layers.1.block_sparse_moe.experts.3.w1.weight");
  EXPECT_EQ(original->hf[fc1.runs[1].hf_index].name, "model.layers.1.block_sparse_moe.experts.3.w3.weight");
  EXPECT_TRUE(megatron_names(*original).count("decoder.layers.0.mlp.router.weight"));
  EXPECT_TRUE(megatron_names(*original).count("decoder.layers.0.pre_mlp_layernorm.weight"))
      << "MoE keeps pre_mlp_layernorm";

  auto fused = plan_for(config("MixtralForCausalLM"), NormNaming::kTransformerEngine, ExpertLayout::kFused);
  ASSERT_TRUE(fused.ok()) << fused.status().message();
  const auto& f = tensor(*fused, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight");
  ASSERT_EQ(f.runs.size(), 1u);
  EXPECT_EQ(fused->hf[f.runs[0].hf_index].name, "model.layers.1.mlp.experts.gate_up_proj");
  EXPECT_EQ(fused->hf[f.runs[0].hf_index].shape, (Shape{4, 96, 32}));
  EXPECT_EQ(f.runs[0].hf_offset, 3 * 96 * 32);
  EXPECT_EQ(megatron_names(*original), megatron_names(*fused)) << "the Megatron side does not depend on the HF layout";

  // Stored transposed (Qwen3-VL-MoE as published): gate_up_proj [E, H, 2I], down_proj [E, I, H].
  auto transposed = plan_for(config("MixtralForCausalLM"), NormNaming::kTransformerEngine,
                             ExpertLayout::kFusedTransposed);
  ASSERT_TRUE(transposed.ok()) << transposed.status().message();
  const auto& t1 = tensor(*transposed, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight");
  const auto& t2 = tensor(*transposed, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight");
  ASSERT_EQ(t1.runs.size(), 1u);
  EXPECT_EQ(transposed->hf[t1.runs[0].hf_index].shape, (Shape{4, 32, 96}));
  EXPECT_EQ(transposed->hf[t2.runs[0].hf_index].shape, (Shape{4, 48, 32}));
  EXPECT_EQ(t1.runs[0].order, RunOrder::kTransposed);
  // Canonical fc1 element (row 50: up row 2, column 7) is stored at [expert 3][column 7][row 50].
  EXPECT_EQ(t1.runs[0].hf_offset + run_hf_element(t1.runs[0], 50 * 32 + 7), 3 * 32 * 96 + 7 * 96 + 50);

  auto model = [](const json& c) {
    auto hf = parse_hf_config(c, "config.json");
    return *bridge_model_from_config(*hf);
  };
  const BridgeModel mixtral = model(config("MixtralForCausalLM"));  // hidden 32, ffn 48
  const std::string g = "model.layers.0.mlp.experts.gate_up_proj", d = "model.layers.0.mlp.experts.down_proj";
  EXPECT_EQ(detect_expert_layout(mixtral, {{"model.layers.0.mlp.gate.weight", {4, 32}}}), ExpertLayout::kOriginal);
  EXPECT_EQ(detect_expert_layout(mixtral, {{g, {4, 96, 32}}, {d, {4, 32, 48}}}), ExpertLayout::kFused);
  EXPECT_EQ(detect_expert_layout(mixtral, {{g, {4, 32, 96}}, {d, {4, 48, 32}}}), ExpertLayout::kFusedTransposed);
  // An expert width equal to the hidden size: gate_up_proj tells.
  EXPECT_EQ(detect_expert_layout(mixtral, {{g, {4, 64, 32}}, {d, {4, 32, 32}}}), ExpertLayout::kFused);
  EXPECT_EQ(detect_expert_layout(mixtral, {{g, {4, 32, 64}}, {d, {4, 32, 32}}}), ExpertLayout::kFusedTransposed);
  for (const ExpertLayout layout : {ExpertLayout::kOriginal, ExpertLayout::kFused, ExpertLayout::kFusedTransposed})
    EXPECT_EQ(expert_layout_from_name(expert_layout_name(layout)), layout);
  EXPECT_FALSE(expert_layout_from_name("transposed"));

  auto qwen = plan_for(config("Qwen3MoeForCausalLM"));
  ASSERT_TRUE(qwen.ok()) << qwen.status().message();
  EXPECT_EQ(tensor(*qwen, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight").shape, (Shape{32, 24}));
}

TEST(BridgePlanTest, UnsupportedConfigsAreRefusedClearly) {
  auto unknown = plan_for(config("GPTNeoXForCausalLM"));
  ASSERT_FALSE(unknown.ok());
  for (const auto& name : supported_architectures())
    EXPECT_NE(unknown.status().message().find(name), std::string::npos);
  json window = config("MistralForCausalLM");
  window["sliding_window"] = 16;  // every layer's: carried over as Megatron's window_size
  EXPECT_TRUE(plan_for(window).ok());
  // A Mistral config listing layer_types is Ministral's to transformers: the window where the list says.
  window["model_type"] = "mistral";
  window["layer_types"] = {"sliding_attention", "full_attention"};
  EXPECT_TRUE(fails_with(plan_for(window), "the sliding window in 1 of 2 layers"));
  window["layer_types"] = {"full_attention", "full_attention"};
  EXPECT_TRUE(plan_for(window).ok());
  // Biases where transformers builds them: Llama's attention_bias and mlp_bias, Qwen3's attention_bias (refused);
  // Mistral's, Mixtral's and Phi-3's attention and every MLP but Llama's have none whatever the config says.
  for (const auto& [architecture, key, refused] :
       std::vector<std::tuple<std::string, std::string, bool>>{{"LlamaForCausalLM", "attention_bias", true},
                                                               {"LlamaForCausalLM", "mlp_bias", true},
                                                               {"Qwen3ForCausalLM", "attention_bias", true},
                                                               {"Qwen3ForCausalLM", "mlp_bias", false},
                                                               {"MistralForCausalLM", "attention_bias", false},
                                                               {"MixtralForCausalLM", "attention_bias", false},
                                                               {"Phi3ForCausalLM", "attention_bias", false},
                                                               {"MistralForCausalLM", "mlp_bias", false}}) {
    json biased = config(architecture);
    biased[key] = true;
    if (refused) EXPECT_TRUE(fails_with(plan_for(biased), key + " = true")) << architecture << " " << key;
    else
      EXPECT_TRUE(plan_for(biased).ok()) << architecture << " " << key << ": " << plan_for(biased).status().message();
  }
  json qwen = config("Qwen2ForCausalLM");
  qwen["use_sliding_window"] = true;
  qwen["sliding_window"] = 16;
  qwen["max_window_layers"] = 1;  // the window from the second of 2 layers: Megatron's window cannot say that
  EXPECT_TRUE(fails_with(plan_for(qwen), "the sliding window in 1 of 2 layers"));
  qwen["layer_types"] = {"sliding_attention", "full_attention"};  // transformers' list, when given, says which
  EXPECT_TRUE(fails_with(plan_for(qwen), "the sliding window in 1 of 2 layers"));
  qwen.erase("layer_types");
  for (const int from : {0, 2, 28}) {  // every layer windowed (Megatron's window_size), or none
    qwen["max_window_layers"] = from;
    EXPECT_TRUE(plan_for(qwen).ok()) << from;
  }
  // counts past what Trestle lists are refused naming the config they came from
  json many = config("LlamaForCausalLM");
  many["num_hidden_layers"] = 100000;
  many["num_attention_heads"] = many["num_key_value_heads"] = 100000;
  many["head_dim"] = 8;
  EXPECT_TRUE(fails_with(plan_for(many), "config.json: the model describes 100000 layers"));
  json rope = config("LlamaForCausalLM");
  rope["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  EXPECT_TRUE(plan_for(rope).ok());
  rope["rope_scaling"]["low_freq_factor"] = 4.0;  // Llama 3's smoothing divides by high - low (4 by default)
  EXPECT_TRUE(fails_with(plan_for(rope), "config.json: rope_scaling {"));
  EXPECT_TRUE(fails_with(plan_for(rope), "high_freq_factor above low_freq_factor"));
  rope["rope_scaling"]["high_freq_factor"] = 8.0;
  EXPECT_TRUE(plan_for(rope).ok());
  rope["rope_scaling"] = {{"rope_type", "longrope"}};
  EXPECT_NE(plan_for(rope).status().message().find("longrope"), std::string::npos);
  json sparse = config("Qwen3MoeForCausalLM");
  sparse["mlp_only_layers"] = {1};
  EXPECT_TRUE(fails_with(plan_for(sparse), "mlp_only_layers [1] (every layer must be MoE) is not supported"));
  // Partial rotary outside GLM-4.5: refused wherever transformers keeps the factor (rope_parameters, or the top level).
  json phi = config("Phi3ForCausalLM");
  phi["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.75}};
  EXPECT_TRUE(fails_with(plan_for(phi), "partial_rotary_factor 0.75 (rotary over whole heads only)"));
  phi.erase("rope_parameters");
  phi["partial_rotary_factor"] = 0.5;
  EXPECT_TRUE(fails_with(plan_for(phi), "partial_rotary_factor 0.5 (rotary over whole heads only)"));
  phi["partial_rotary_factor"] = 1.0;
  EXPECT_TRUE(plan_for(phi).ok());
  // Counts the bridge loops over are bounded first (the fuzzer's Gemma 2 had 266,666,666,666 layers).
  json huge = config("LlamaForCausalLM");
  huge["num_hidden_layers"] = 266'666'666'666;
  EXPECT_TRUE(fails_with(plan_for(huge), "config.json: 'num_hidden_layers' is 266666666666, more than Trestle converts"));
  huge = config("Qwen3MoeForCausalLM");
  huge["num_experts"] = 999'999'994;
  EXPECT_TRUE(fails_with(plan_for(huge), "'num_experts' is 999999994"));
  // And the heads, listed by query group: 2^31 of them (width 0 or 1) took the memory before any shape was checked.
  for (const char* key : {"num_attention_heads", "num_key_value_heads"}) {
    huge = config("LlamaForCausalLM");
    huge["num_attention_heads"] = huge["num_key_value_heads"] = std::int64_t{1} << 31;
    if (std::string(key) == "num_key_value_heads") huge["num_attention_heads"] = 4;
    huge["head_dim"] = 1;
    EXPECT_TRUE(fails_with(plan_for(huge),
                           "config.json: '" + std::string(key) + "' is 2147483648, more than Trestle converts"));
  }
}

TEST(BridgePlanTest, AccountingNamesLeftoversAndMissing) {
  const std::map<std::string, Shape> planned = {{"a", {2}}, {"b", {3}}};
  EXPECT_TRUE(check_accounting(planned, {{"a", {2}}, {"b", {3}}, {"model.rotary_emb.inv_freq", {4}}}, "src").ok());
  const auto s = check_accounting(planned, {{"a", {2}}, {"c", {1}}}, "src");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not consumed by the mapping: c"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("missing: b"), std::string::npos) << s.message();
  EXPECT_NE(check_accounting(planned, {{"a", {5}}, {"b", {3}}}, "src").message().find("wrong shape"),
            std::string::npos);
}

json glm4_moe_config() {
  json c = config("Glm4MoeForCausalLM");
  c.update({{"num_hidden_layers", 3}, {"head_dim", 12}, {"n_routed_experts", 4}, {"num_experts_per_tok", 2},
            {"moe_intermediate_size", 16}, {"n_shared_experts", 2}, {"first_k_dense_replace", 1},
            {"attention_bias", true}, {"use_qk_norm", true}, {"n_group", 2}, {"topk_group", 1},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}}});
  return c;
}

TEST(BridgePlanTest, Glm4MoeFollowsItsConfig) {
  json c = glm4_moe_config();
  const auto p = plan_for(c);
  ASSERT_TRUE(p.ok()) << p.status().message();
  const auto names = megatron_names(*p);
  // The dense first layer: its fused pre-MLP norm and MLP, no router; the MoE layers: router, expert bias, ungated
  // shared experts (two of 16), routed experts.
  EXPECT_TRUE(names.count("decoder.layers.0.mlp.linear_fc1.layer_norm_weight"));
  EXPECT_FALSE(names.count("decoder.layers.0.mlp.router.weight"));
  EXPECT_TRUE(names.count("decoder.layers.1.pre_mlp_layernorm.weight"));
  EXPECT_TRUE(names.count("decoder.layers.2.mlp.router.expert_bias"));
  EXPECT_FALSE(names.count("decoder.layers.2.mlp.shared_experts.gate_weight"));
  EXPECT_EQ(tensor(*p, "decoder.layers.2.mlp.shared_experts.linear_fc1.weight").shape, (Shape{64, 32}));
  EXPECT_TRUE(names.count("decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"));
  // Grouped-query attention with biases and per-head q/k norms: 4 query heads + 2 × 2 KV heads of 12.
  EXPECT_EQ(tensor(*p, "decoder.layers.1.self_attention.linear_qkv.bias").shape, (Shape{96}));
  EXPECT_EQ(tensor(*p, "decoder.layers.1.self_attention.linear_qkv.bias").runs.size(), 6u);
  EXPECT_EQ(tensor(*p, "decoder.layers.1.self_attention.q_layernorm.weight").shape, (Shape{12}));
  EXPECT_FALSE(names.count("mtp.layers.0.eh_proj.weight"));  // no MTP layer in the checkpoint

  auto hf = parse_hf_config(c, "config.json");
  ASSERT_TRUE(hf.ok());
  auto model = bridge_model_from_config(*hf);
  ASSERT_TRUE(model.ok()) << model.status().message();
  EXPECT_EQ(model->family, "GLM-4.5 (MoE)");
  EXPECT_EQ(model->rotary_percent, 0.5);
  model->mtp_layers = count_mtp_layers(*model, {"model.layers.3.eh_proj.weight", "model.layers.4.eh_proj.weight"});
  EXPECT_EQ(model->mtp_layers, 1);  // num_nextn_predict_layers absent: transformers' default 1
  const GptModelSpec spec = megatron_spec(*model, NormNaming::kLocal);
  EXPECT_EQ(spec.rotary_percent, 0.5);
  EXPECT_EQ(spec.moe_first_dense_layers, 1);
  EXPECT_EQ(spec.dense_ffn_hidden_size, 48);
  EXPECT_EQ(spec.shared_expert_ffn_hidden_size, 32);
  EXPECT_FALSE(spec.shared_expert_gate);
  EXPECT_TRUE(spec.moe_router_expert_bias && spec.add_qkv_bias && spec.qk_layernorm);
  EXPECT_FALSE(spec.multi_latent_attention());
  EXPECT_EQ(spec.mtp_num_layers, 1);
  const auto with_mtp = make_bridge_plan(*model, NormNaming::kLocal, ExpertLayout::kFused);
  ASSERT_TRUE(with_mtp.ok()) << with_mtp.status().message();
  const auto mtp_names = megatron_names(*with_mtp);
  EXPECT_TRUE(mtp_names.count("mtp.layers.0.eh_proj.weight"));
  EXPECT_TRUE(mtp_names.count("mtp.layers.0.transformer_layer.self_attention.k_layernorm.weight"));
  EXPECT_TRUE(mtp_names.count("mtp.layers.0.transformer_layer.mlp.router.expert_bias"));
  EXPECT_EQ(with_mtp->hf[tensor(*with_mtp, "mtp.layers.0.final_layernorm.weight").runs[0].hf_index].name,
            "model.layers.3.shared_head.norm.weight");

  // Without biases or norms, their tensors are not expected.
  c["attention_bias"] = false;
  c["use_qk_norm"] = false;
  const auto plain = plan_for(c);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(megatron_names(*plain).count("decoder.layers.0.self_attention.linear_qkv.bias"));
  EXPECT_FALSE(megatron_names(*plain).count("decoder.layers.0.self_attention.k_layernorm.weight"));
}

TEST(BridgePlanTest, AnEmptySharedExpertIsRefusedNamingItsKey) {
  // Qwen2-MoE (and Qwen3-Next / Qwen3.5-MoE, the same block) builds its shared expert whatever its size.
  json c = config("Qwen2MoeForCausalLM");
  c["num_experts"] = 4;
  c["num_experts_per_tok"] = 2;
  c["moe_intermediate_size"] = 24;
  c["shared_expert_intermediate_size"] = 48;
  EXPECT_TRUE(plan_for(c).ok()) << plan_for(c).status().message();
  c["shared_expert_intermediate_size"] = 0;
  EXPECT_TRUE(fails_with(plan_for(c), "Qwen2MoeForCausalLM: shared_expert_intermediate_size 0 (an empty shared-expert "
                                      "MLP, which transformers still builds with its gate)"));
}

TEST(BridgePlanTest, Glm4MoeRefusesWhatMegatronComputesDifferently) {
  auto with = [](json changes) {
    json c = glm4_moe_config();
    c.update(changes);
    return plan_for(c);
  };
  EXPECT_TRUE(fails_with(with({{"norm_topk_prob", false}}), "Glm4MoeForCausalLM: norm_topk_prob = false"));
  EXPECT_TRUE(fails_with(with({{"topk_group", 2}}), "group-limited routing with n_group 2, topk_group 2"));
  EXPECT_TRUE(fails_with(with({{"n_shared_experts", 0}}), "n_shared_experts 0"));
  EXPECT_TRUE(fails_with(with({{"first_k_dense_replace", -1}}), "'first_k_dense_replace' must be an integer from 0"));
  EXPECT_TRUE(fails_with(with({{"rope_parameters", {{"rope_type", "linear"}, {"factor", 2.0}}}}), "rope type 'linear'"));
  // The rotary part of a head must be whole, even dims: 12 × 0.25 = 3 is not.
  EXPECT_TRUE(fails_with(with({{"rope_parameters", {{"rope_type", "default"}, {"partial_rotary_factor", 0.25}}}}),
                         "partial_rotary_factor 0.250000 with head_dim 12"));
  // rope_parameters' factor wins over the top level's, as in transformers; absent, it is Glm4MoeConfig's 0.5.
  json both = glm4_moe_config();
  both["partial_rotary_factor"] = 0.25;
  auto hf = parse_hf_config(both, "config.json");
  ASSERT_TRUE(hf.ok());
  auto model = bridge_model_from_config(*hf);
  ASSERT_TRUE(model.ok()) << model.status().message();
  EXPECT_EQ(model->rotary_percent, 0.5);
  both.erase("rope_parameters");
  both.erase("partial_rotary_factor");
  hf = parse_hf_config(both, "config.json");
  ASSERT_TRUE(hf.ok());
  model = bridge_model_from_config(*hf);
  ASSERT_TRUE(model.ok()) << model.status().message();
  EXPECT_EQ(model->rotary_percent, 0.5);
}

TEST(BridgePlanTest, RotaryPercentReadsBackFromTheModelJson) {
  json model = {{"megatron",
                 {{"num_layers", 1}, {"hidden_size", 32}, {"ffn_hidden_size", 48}, {"num_attention_heads", 4},
                  {"vocab_size", 100}, {"rotary_percent", 0.5}}}};
  const auto spec = gpt_spec_from_json(model, "manifest.json");
  ASSERT_TRUE(spec.ok()) << spec.status().message();
  EXPECT_EQ(spec->rotary_percent, 0.5);
  model["megatron"]["rotary_percent"] = 0.0;
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "manifest.json"), "manifest.json"));
  EXPECT_TRUE(fails_with(gpt_spec_from_json(model, "manifest.json"), "rotary_percent 0.000000 is not in (0, 1]"));
}

}  // namespace
}  // namespace trestle

namespace trestle {
namespace {

TEST(RunOrder, MapsEachCanonicalElementToItsHuggingFacePlace) {
  // A [gate; up] block of 4 rows x 3 columns; stored transposed ([3, 4]) with gate / up interleaved (g0 u0 g1 u1).
  ElementRun run{0, 0, 0, 12, RunOrder::kTransposedInterleavedHalves, 4, 3};
  EXPECT_EQ(run_hf_element(run, 0), 0);   // gate 0, column 0 -> hf (0, 0)
  EXPECT_EQ(run_hf_element(run, 3), 2);   // gate 1, column 0 -> hf (0, 2)
  EXPECT_EQ(run_hf_element(run, 6), 1);   // up 0, column 0 -> hf (0, 1)
  EXPECT_EQ(run_hf_element(run, 11), 11);  // up 1, column 2 -> hf (2, 3)
  run.order = RunOrder::kTransposed;
  EXPECT_EQ(run_hf_element(run, 1), 4);  // (0, 1) -> hf (1, 0)
  run.order = RunOrder::kInterleavedHalves;
  EXPECT_EQ(run_hf_element(run, 6), 3);  // up 0 = row 2 -> hf row 1
  std::vector<bool> seen(12);
  for (const RunOrder order : {RunOrder::kTransposed, RunOrder::kInterleavedHalves,
                               RunOrder::kTransposedInterleavedHalves}) {
    run.order = order;
    std::fill(seen.begin(), seen.end(), false);
    for (std::int64_t k = 0; k < 12; ++k) seen[static_cast<std::size_t>(run_hf_element(run, k))] = true;
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](bool b) { return b; })) << "a permutation";
  }
}

TEST(BridgePlanTest, GptOssAndDeepSeekPlansAccountForEveryTensor) {
  json gpt = config("GptOssForCausalLM");
  gpt["num_local_experts"] = 4;
  gpt["num_experts_per_tok"] = 2;
  gpt["head_dim"] = 8;
  gpt["sliding_window"] = 4;
  gpt["layer_types"] = {"sliding_attention", "full_attention"};
  const auto g = plan_for(gpt);
  ASSERT_TRUE(g.ok()) << g.status().message();
  EXPECT_EQ(tensor(*g, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight").runs[0].order,
            RunOrder::kTransposedInterleavedHalves);
  EXPECT_TRUE(megatron_names(*g).count("decoder.layers.0.self_attention.core_attention.softmax_offset"));
  gpt["layer_types"] = {"full_attention", "sliding_attention"};
  EXPECT_TRUE(fails_with(plan_for(gpt), "layer_types [\"full_attention\",\"sliding_attention\"]"));

  json ds = config("DeepseekV3ForCausalLM");
  ds.update({{"n_routed_experts", 4},
             {"num_experts_per_tok", 2},
             {"moe_intermediate_size", 16},
             {"n_shared_experts", 1},
             {"first_k_dense_replace", 1},
             {"q_lora_rank", 24},
             {"kv_lora_rank", 16},
             {"qk_nope_head_dim", 8},
             {"qk_rope_head_dim", 4},
             {"v_head_dim", 8},
             {"num_key_value_heads", 128},
             {"n_group", 1},
             {"topk_group", 1}});  // (transformers' defaults, 8 groups, do not fit 4 experts)
  const auto d = plan_for(ds, NormNaming::kLocal);
  ASSERT_TRUE(d.ok()) << d.status().message();
  const auto names = megatron_names(*d);
  EXPECT_TRUE(names.count("decoder.layers.0.mlp.linear_fc1.weight"));  // the dense first layer
  EXPECT_TRUE(names.count("decoder.layers.1.mlp.router.expert_bias"));
  EXPECT_TRUE(names.count("decoder.layers.1.self_attention.kv_layernorm.weight"));
  EXPECT_EQ(tensor(*d, "decoder.layers.1.self_attention.linear_kv_down_proj.weight").split, TpSplit::kColumn);
  EXPECT_EQ(tensor(*d, "decoder.layers.1.self_attention.linear_kv_up_proj.weight").shape, (Shape{64, 16}));
  const auto te = plan_for(ds);
  ASSERT_TRUE(te.ok());
  EXPECT_EQ(tensor(*te, "decoder.layers.1.self_attention.linear_kv_down_proj.weight").split, TpSplit::kReplicated);
  EXPECT_TRUE(megatron_names(*te).count("decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight"));
  ds["norm_topk_prob"] = false;
  EXPECT_TRUE(fails_with(plan_for(ds), "norm_topk_prob = false"));
  // One expert per token: Megatron-Core's sigmoid router keeps its score, which only norm_topk_prob false matches.
  ds["num_experts_per_tok"] = 1;
  EXPECT_TRUE(plan_for(ds).ok());
  ds["norm_topk_prob"] = true;
  EXPECT_TRUE(fails_with(plan_for(ds), "one expert per token with norm_topk_prob = true"));
}

}  // namespace
}  // namespace trestle
