// Where LoRA adapters sit on the Hugging Face side (lora_modules): Llama's fused QKV rows in Megatron's per-group order
// split into q/k/v modules of one part each, Phi-3's fused projections as one module spanning the parts, Mixtral's
// experts in the per-expert layout, DeepSeek's multi-latent attention projections row for row; and the PEFT names
// and configuration checks (peft_files).
#include "convert/lora_modules.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <tuple>

#include "convert/bridge/hf_config.h"
#include "convert/peft_files.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

using json = nlohmann::json;

BridgedModel model_of(const std::string& architecture) {
  json c = {{"architectures", {architecture}},
            {"hidden_size", 32},
            {"intermediate_size", 48},
            {"num_hidden_layers", 2},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"vocab_size", 100},
            {"max_position_embeddings", 64},
            {"tie_word_embeddings", false}};
  if (architecture == "MixtralForCausalLM" || architecture == "GptOssForCausalLM") {
    c["num_local_experts"] = 4;
    c["num_experts_per_tok"] = 2;
  }
  if (architecture == "GptOssForCausalLM") {
    c["head_dim"] = 8;
    c["sliding_window"] = 16;
    c["layer_types"] = {"sliding_attention", "full_attention"};
  }
  if (architecture == "DeepseekV3ForCausalLM") {  // dense multi-latent attention
    c["num_key_value_heads"] = 4;
    c["q_lora_rank"] = 12;
    c["kv_lora_rank"] = 8;
    c["qk_nope_head_dim"] = 8;
    c["qk_rope_head_dim"] = 4;
    c["v_head_dim"] = 6;
    c["first_k_dense_replace"] = 2;
    c["n_routed_experts"] = 4;
    c["num_experts_per_tok"] = 2;
    c["moe_intermediate_size"] = 16;
    c["n_group"] = c["topk_group"] = 1;  // (transformers' defaults, 8 groups, do not fit 4 experts)
  }
  auto hf = parse_hf_config(c, "config.json");
  EXPECT_TRUE(hf.ok()) << hf.status().message();
  auto model = bridge_model_from_config(*hf);
  EXPECT_TRUE(model.ok()) << model.status().message();
  BridgedModel bridged;
  bridged.model = *model;
  return bridged;
}

const LoraModule& find(const std::vector<LoraModule>& modules, const std::string& name) {
  for (const LoraModule& m : modules)
    if (m.module == name) return m;
  ADD_FAILURE() << "no module " << name;
  return modules.front();
}

TEST(LoraModulesTest, LlamaQkvRowsSplitIntoOnePartPerProjection) {
  auto modules = lora_modules(model_of("LlamaForCausalLM"));
  ASSERT_TRUE(modules.ok()) << modules.status().message();
  ASSERT_EQ(modules->size(), 2u * 4u);  // four linears per layer
  const LoraModule& qkv = find(*modules, "decoder.layers.1.self_attention.linear_qkv");
  EXPECT_EQ(qkv.out, 64);  // 4 heads of 8 + 2 · 2 KV heads of 8
  EXPECT_EQ(qkv.in, 32);
  ASSERT_EQ(qkv.parts, (std::vector<std::string>{"adapter_q", "adapter_k", "adapter_v"}));
  ASSERT_EQ(qkv.hf.size(), 3u);
  const std::string names[] = {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                               "model.layers.1.self_attn.v_proj"};
  for (int p = 0; p < 3; ++p) {
    const HfLoraModule& hf = qkv.hf[static_cast<std::size_t>(p)];
    EXPECT_EQ(hf.name, names[p]);
    EXPECT_EQ(hf.part, p);
    EXPECT_TRUE(hf.problem.empty()) << hf.problem;
    // HF row h of each projection is its part's row h.
    for (std::size_t h = 0; h < hf.rows.size(); ++h)
      EXPECT_EQ(qkv.row_in_part[static_cast<std::size_t>(hf.rows[h])], static_cast<std::int64_t>(h));
  }
  // Megatron's group order: group 0 is q heads 0-1 (rows 0-15), k head 0 (16-23), v head 0 (24-31).
  EXPECT_EQ(qkv.hf[0].rows[0], 0);
  EXPECT_EQ(qkv.hf[1].rows[0], 16);
  EXPECT_EQ(qkv.hf[2].rows[0], 24);
  EXPECT_EQ(qkv.hf[0].rows[16], 32);  // q head 2 opens group 1
  const LoraModule& fc1 = find(*modules, "decoder.layers.0.mlp.linear_fc1");
  ASSERT_EQ(fc1.hf.size(), 2u);
  EXPECT_EQ(fc1.hf[0].name, "model.layers.0.mlp.gate_proj");
  EXPECT_EQ(fc1.hf[1].rows.front(), 48);  // up_proj: the second half
  const LoraModule& proj = find(*modules, "decoder.layers.0.self_attention.linear_proj");
  EXPECT_TRUE(proj.parts.empty());
  ASSERT_EQ(proj.hf.size(), 1u);
  EXPECT_EQ(proj.hf[0].name, "model.layers.0.self_attn.o_proj");
}

TEST(LoraModulesTest, Phi3FusedProjectionsSpanTheParts) {
  auto modules = lora_modules(model_of("Phi3ForCausalLM"));
  ASSERT_TRUE(modules.ok()) << modules.status().message();
  const LoraModule& qkv = find(*modules, "decoder.layers.0.self_attention.linear_qkv");
  ASSERT_EQ(qkv.hf.size(), 1u);
  EXPECT_EQ(qkv.hf[0].name, "model.layers.0.self_attn.qkv_proj");
  EXPECT_EQ(qkv.hf[0].part, -1);
  EXPECT_EQ(qkv.hf[0].rows.size(), 64u);
  EXPECT_EQ(qkv.hf[0].rows[32], 16);  // qkv_proj's first k row is Megatron's row 16
}

TEST(LoraModulesTest, MixtralExpertsUseThePerExpertLayoutAndHaveTheirFusedSlice) {
  auto modules = lora_modules(model_of("MixtralForCausalLM"));
  ASSERT_TRUE(modules.ok()) << modules.status().message();
  const LoraModule& fc1 = find(*modules, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1");
  ASSERT_EQ(fc1.hf.size(), 3u);
  EXPECT_EQ(fc1.hf[0].name, "model.layers.1.block_sparse_moe.experts.3.w1");
  EXPECT_EQ(fc1.hf[1].name, "model.layers.1.block_sparse_moe.experts.3.w3");
  // transformers 5 builds the experts fused: expert 3's slice of gate_up_proj [E, 2I, H], gate rows then up rows.
  const HfLoraModule& fused = fc1.hf[2];
  EXPECT_EQ(fused.parameter, "model.layers.1.mlp.experts.gate_up_proj");
  EXPECT_EQ(fused.name, "model.layers.1.mlp.experts");
  EXPECT_EQ(fused.expert, 3);
  EXPECT_EQ(fused.num_experts, 4);
  EXPECT_FALSE(fused.linear);
  EXPECT_TRUE(fused.problem.empty()) << fused.problem;
  ASSERT_EQ(fused.rows.size(), 96u);
  for (std::int64_t r = 0; r < 96; ++r) EXPECT_EQ(fused.rows[static_cast<std::size_t>(r)], r);
  // Exported, the per-expert linears are the adapter's form.
  const auto form = peft_form(fc1, false);
  ASSERT_EQ(form.size(), 2u);
  EXPECT_EQ(form[0]->name, fc1.hf[0].name);
  ASSERT_EQ(peft_form(fc1, true).size(), 1u);  // --hf-expert-layout fused
  EXPECT_EQ(peft_form(fc1, true).front(), &fused);
  const LoraModule& fc2 = find(*modules, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2");
  EXPECT_EQ(fc2.hf.at(0).name, "model.layers.1.block_sparse_moe.experts.3.w2");
  EXPECT_EQ(fc2.hf.at(1).parameter, "model.layers.1.mlp.experts.down_proj");
}

TEST(LoraModulesTest, GptOssExpertsAreSlicesOfItsTransposedInterleavedParameters) {
  auto modules = lora_modules(model_of("GptOssForCausalLM"));
  ASSERT_TRUE(modules.ok()) << modules.status().message();
  const LoraModule& fc1 = find(*modules, "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1");
  ASSERT_EQ(fc1.hf.size(), 1u);
  const HfLoraModule& fused = fc1.hf[0];
  EXPECT_EQ(fused.parameter, "model.layers.0.mlp.experts.gate_up_proj");
  EXPECT_EQ(fused.expert, 2);
  EXPECT_TRUE(fused.problem.empty()) << fused.problem;
  // gate_up_proj [E, H, 2I] holds gate j in column 2j and up j in column 2j + 1; Megatron's fc1 is [gate; up].
  ASSERT_EQ(fused.rows.size(), 2u * 48u);
  for (std::int64_t j = 0; j < 48; ++j) {
    EXPECT_EQ(fused.rows[static_cast<std::size_t>(2 * j)], j);
    EXPECT_EQ(fused.rows[static_cast<std::size_t>(2 * j + 1)], 48 + j);
  }
  const LoraModule& fc2 = find(*modules, "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2");
  ASSERT_EQ(fc2.hf.size(), 1u);
  EXPECT_EQ(fc2.hf[0].parameter, "model.layers.0.mlp.experts.down_proj");
  ASSERT_EQ(fc2.hf[0].rows.size(), 32u);  // down_proj [E, I, H]: its outputs are the hidden size
  EXPECT_EQ(fc2.hf[0].rows[5], 5);
  EXPECT_EQ(peft_form(fc2, false).front(), &fc2.hf[0]);
}

TEST(LoraModulesTest, LatentAttentionProjectionsAreDeepSeeksOwn) {
  auto modules = lora_modules(model_of("DeepseekV3ForCausalLM"));
  ASSERT_TRUE(modules.ok()) << modules.status().message();
  ASSERT_EQ(modules->size(), 2u * 7u);  // four latent projections, linear_proj, fc1, fc2 per layer
  for (const auto& [module, hf, out, in] : {std::tuple{"linear_q_down_proj", "q_a_proj", 12, 32},
                                            {"linear_q_up_proj", "q_b_proj", 4 * 12, 12},
                                            {"linear_kv_down_proj", "kv_a_proj_with_mqa", 8 + 4, 32},
                                            {"linear_kv_up_proj", "kv_b_proj", 4 * 14, 8}}) {
    const LoraModule& m = find(*modules, std::string("decoder.layers.1.self_attention.") + module);
    EXPECT_EQ(m.target, module);
    EXPECT_EQ(m.out, out);
    EXPECT_EQ(m.in, in);
    EXPECT_TRUE(m.parts.empty());
    ASSERT_EQ(m.hf.size(), 1u);
    EXPECT_EQ(m.hf[0].name, std::string("model.layers.1.self_attn.") + hf);
    EXPECT_TRUE(m.hf[0].problem.empty()) << m.hf[0].problem;
    ASSERT_EQ(m.hf[0].rows.size(), static_cast<std::size_t>(out));
    for (int r = 0; r < out; ++r) EXPECT_EQ(m.hf[0].rows[static_cast<std::size_t>(r)], r) << module;
  }
}

TEST(PeftFilesTest, KeysAndTargetMatching) {
  EXPECT_EQ(peft_key("model.layers.0.self_attn.q_proj", true),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  const auto key = parse_peft_key("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight");
  ASSERT_TRUE(key.has_value());
  EXPECT_EQ(key->module, "model.layers.0.mlp.down_proj");
  EXPECT_FALSE(key->a);
  EXPECT_FALSE(parse_peft_key("model.layers.0.mlp.down_proj.weight").has_value());
  EXPECT_FALSE(parse_peft_key("base_model.model.x.lora_embedding_A").has_value());
  EXPECT_TRUE(peft_targets({"q_proj"}, "model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(peft_targets({"proj"}, "model.layers.0.self_attn.q_proj"));  // whole components only
  EXPECT_TRUE(peft_targets({"self_attn.q_proj"}, "model.layers.0.self_attn.q_proj"));
}

TEST(PeftFilesTest, ConfigRefusesWhatPlainLoraLacks) {
  testing::TempDir dir;
  auto write = [&](const json& j) { std::ofstream(dir / "adapter_config.json") << j.dump(); };
  const json plain = {{"peft_type", "LORA"},
                      {"r", 8},
                      {"lora_alpha", 16},
                      {"target_modules", {"q_proj"}},
                      {"bias", "none"},
                      {"use_dora", false},
                      {"rank_pattern", json::object()},
                      {"modules_to_save", nullptr}};
  write(plain);
  auto ok = read_peft_config(dir.str());
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->r, 8);
  EXPECT_EQ(ok->alpha, 16);
  // target_modules as PEFT's regular expression (full match) or all-linear.
  json regex = plain;
  regex["target_modules"] = R"(.*language_model.*\.(q_proj|v_proj))";
  write(regex);
  ok = read_peft_config(dir.str());
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_TRUE(ok->target_modules.empty());
  EXPECT_TRUE(peft_targets(*ok, "model.language_model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(peft_targets(*ok, "model.vision_tower.encoder.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(peft_targets(*ok, "model.language_model.layers.0.self_attn.q_proj.x"));  // the whole name
  EXPECT_EQ(peft_config_json(*ok)["target_modules"], regex["target_modules"]);
  regex["target_modules"] = R"((?:model\.layers\.\d+\.self_attn\.q_proj|[a-z_.]+\.(v_proj)))";  // what export writes
  write(regex);
  EXPECT_TRUE(read_peft_config(dir.str()).ok());
  // Braces, parentheses and quantifiers inside a class are plain characters; lazy quantifiers are single ones.
  regex["target_modules"] = R"(.*[{(*]?\.(?:q|v)_proj.*?)";
  write(regex);
  ok = read_peft_config(dir.str());
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_TRUE(peft_targets(*ok, "model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(peft_pattern_readable(R"((a.*|b)c.*.*)"));  // the group's longest alternative, then two more: 3
  EXPECT_FALSE(peft_pattern_readable(R"((a.*|b)c.*.*.*)"));
  // Per-module ranks and alphas (PEFT's get_pattern_key: the name's end after a '.'), fused expert parameters.
  json patterned = plain;
  patterned["rank_pattern"] = {{R"(.*\.experts\.gate_up_proj)", 16}, {"q_proj", 4}};
  patterned["alpha_pattern"] = {{R"(.*\.experts\.gate_up_proj)", 32}};
  patterned["target_parameters"] = {"mlp.experts.gate_up_proj"};
  write(patterned);
  ok = read_peft_config(dir.str());
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(peft_rank(*ok, "model.layers.2.mlp.experts.gate_up_proj"), 16);
  EXPECT_EQ(peft_alpha(*ok, "model.layers.2.mlp.experts.gate_up_proj"), 32);
  EXPECT_EQ(peft_rank(*ok, "model.layers.2.self_attn.q_proj"), 4);
  EXPECT_EQ(peft_alpha(*ok, "model.layers.2.self_attn.q_proj"), 16);
  EXPECT_EQ(peft_rank(*ok, "model.layers.2.self_attn.xq_proj"), 8);  // not at a component boundary
  EXPECT_TRUE(peft_targets_parameter(*ok, "model.layers.2.mlp.experts.gate_up_proj"));
  EXPECT_FALSE(peft_targets_parameter(*ok, "model.layers.2.mlp.experts.down_proj"));
  EXPECT_EQ(peft_config_json(*ok)["rank_pattern"].dump(), R"({".*\\.experts\\.gate_up_proj":16,"q_proj":4})");
  EXPECT_EQ(peft_config_json(*ok)["target_parameters"], patterned["target_parameters"]);
  regex["target_modules"] = "all-linear";
  write(regex);
  ok = read_peft_config(dir.str());
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_TRUE(peft_targets(*ok, "model.layers.3.mlp.down_proj"));
  // 20 groups nested, each after 300 terms: std::regex's recursion adds the terms of the enclosing groups up (found by
  // fuzz_peft_config as runs of under 1000 terms between groups).
  std::string nested_runs;
  for (int i = 0; i < 20; ++i) nested_runs += std::string(300, 'q') + "(";
  nested_runs += std::string(20, ')');
  for (const auto& [field, value, says] : std::vector<std::tuple<std::string, json, std::string>>{
           {"use_dora", true, "DoRA"},
           {"use_rslora", true, "rsLoRA"},
           {"bias", "all", "biases"},
           {"rank_pattern", {{"q_proj", 0}}, "not a positive integer rank"},
           {"rank_pattern", {{"(a+)+", 4}}, "repeats a repetition"},
           {"target_modules", "sel***f_attn", "repeats a repetition"},  // found by fuzz_peft_config
           {"target_modules", "a?+", "repeats a repetition"},
           {"target_modules", R"(a\77777777777777777777)", "backreferences are not read"},  // found by fuzz_peft_config
           {"target_modules", "a{77777777777777777777}", "of at most 4 digits"},
           {"target_modules", "a\\5;;;;;\xc5\xba", "backreferences are not read"},  // quoted up to inside 'ź'
           {"target_modules", "a{1,;;;;;;;;\xc5\xba}", "of at most 4 digits"},
           {"target_modules", "a{2,x}", "of at most 4 digits"},
           {"target_modules", "a{,2}", "of at most 4 digits"},
           {"target_modules", "[(]*[a\\1]", "backreferences are not read"},
           {"target_modules", std::string(40, '(') + "q" + std::string(40, ')'), "nests 40 groups"},
           {"target_modules", std::string(4001, 'q'), "4001 terms; at most 4000"},  // found by fuzz_peft_config
           {"target_modules", "(?:" + std::string(1001, '|') + ")", "1002 alternatives; at most 1000"},
           {"target_modules", nested_runs, "6020 terms; at most 4000"},
           {"target_modules", "a{1,3}*", "repeats a repetition"},
           {"target_modules", ".*.*.*.*q_proj", "repeats 4 times in a row"},
           {"target_modules", R"(.*(a|b.*c.*)d.*q_proj)", "repeats 4 times in a row"},
           {"rank_pattern", {{".*x.*y.*", 4}}, "repeats 4 times in a row"},  // PEFT's match adds one
           {"alpha_pattern", {{"q_proj", "x"}}, "not a positive number"},
           {"target_parameters", "experts.gate_up_proj", "a list of parameter names"},
           {"exclude_modules", {"q_proj"}, "exclude_modules"},
           {"target_modules", "(q_proj", "is not a regular expression Trestle reads"},
           // Read differently by Python's re, as peft matches them, and by ECMAScript: refused, not misread.
           {"alpha_pattern", {{R"(q_proj\Z)", 16}}, "is an escape ECMAScript lacks"},
           {"rank_pattern", {{R"(layers\.[[:digit:]]\.self_attn\.q_proj)", 4}}, "opens a bracket inside a class"},
           {"target_modules", R"(\Aq_proj)", "is an escape ECMAScript lacks"},
           {"target_modules", "[]q]_proj", "is a ']' first in a class"},
           {"target_modules", "[^]q]_proj", "is a ']' first in a class"},
           {"target_modules", "(.*)*x", "repeats a repetition"},
           {"target_modules", R"(model\.(layers\.\d+\.)+q_proj)", "repeats a repetition"},
           {"target_modules", "", "a regular expression of 1 to"},
           {"target_modules", json::array(), "an empty list"},
           {"r", 0, "positive integer rank"},
           {"peft_type", "IA3", "only LORA"}}) {
    json bad = plain;
    bad[field] = value;
    write(bad);
    auto refused = read_peft_config(dir.str());
    ASSERT_FALSE(refused.ok()) << field;
    EXPECT_NE(refused.status().message().find(says), std::string::npos) << refused.status().message();
    EXPECT_NE(refused.status().message().find("adapter_config.json"), std::string::npos);
  }
}

TEST(PeftFilesTest, RepeatedGroupsThatMatchInSeveralWaysAreRefused) {
  // Each takes exponential time in std::regex (and in Python's re) on a module's name.
  for (const std::string pattern :
       {"(.|.)*q_proj", "(.?){30}.*q_proj", "(a|b)+q_proj", "((a|b)c){2}q_proj", "(a.?){0,2}q_proj", "(a|b){2,}"}) {
    EXPECT_FALSE(peft_pattern_readable(pattern)) << pattern;
    EXPECT_FALSE(peft_pattern_key_readable(pattern)) << pattern;
  }
  // What PEFT users and Trestle's export write.
  for (const std::string pattern :
       {R"(.*\.(q_proj|v_proj)$)", "model.layers.(0|1).self_attn.(q|k)_proj", R"(.*layers\.\d+\.mlp\..*)",
        "(q|k|v)_proj", R"((?:model\.layers\.\d+\.self_attn\.q_proj|[a-z_.]+\.(v_proj)))", "(ab)*q", "(a){1}|b",
        "[(|)]*q_proj",
        // made optional, a group matches at most once: at most twice the ways, not a product
        R"((.*\.)?q_proj)", "(?:x.*)?q_proj", "(a.?){0,1}q_proj"}) {
    EXPECT_TRUE(peft_pattern_readable(pattern)) << pattern;
  }
  // The optional prefix PEFT matches rank_pattern keys with, (?:.*\.)?, is not refused as such a group.
  for (const std::string key : {"q_proj", "(q|k|v)_proj", R"(.*\.experts\.gate_up_proj)", "layers.(0|1).mlp.down_proj"})
    EXPECT_TRUE(peft_pattern_key_readable(key)) << key;
  const json config = {{"peft_type", "LORA"}, {"r", 8}, {"lora_alpha", 16}, {"target_modules", {"q_proj"}}};
  for (const char* field : {"target_modules", "rank_pattern", "alpha_pattern"}) {
    json bad = config;
    bad[field] = std::string(field) == "target_modules" ? json("(.|.)*q_proj") : json({{"(.|.)*q_proj", 4}});
    const auto refused = parse_peft_config(bad.dump(), "adapter_config.json");
    ASSERT_FALSE(refused.ok()) << field;
    EXPECT_NE(refused.status().message().find(std::string("adapter_config.json (") + field + ")"), std::string::npos)
        << refused.status().message();
    EXPECT_NE(refused.status().message().find(R"("(.|.)*q_proj" repeats a group that can match in more than one way)"),
              std::string::npos)
        << refused.status().message();
  }
}

TEST(PeftFilesTest, AdaptersPeftAppliesDifferentlyAreRefused) {
  const json config = {{"peft_type", "LORA"}, {"r", 8}, {"lora_alpha", 16}, {"target_modules", {"q_proj"}}};
  for (const auto& [field, value, says] : std::vector<std::tuple<std::string, json, std::string>>{
           {"layer_replication", {{0, 2}, {1, 2}}, "layer_replication"},
           {"init_lora_weights", "pissa", "changes the base model's weights"},
           {"init_lora_weights", "pissa_niter_4", "changes the base model's weights"},
           {"init_lora_weights", "olora", "changes the base model's weights"},
           {"init_lora_weights", "lora_ga", "changes the base model's weights"},
           {"init_lora_weights", "corda", "changes the base model's weights"},
           {"init_lora_weights", "loftq", "changes the base model's weights"},
           {"alora_invocation_tokens", {5, 6}, "aLoRA"}}) {
    json bad = config;
    bad[field] = value;
    const auto refused = parse_peft_config(bad.dump(), "adapter_config.json");
    ASSERT_FALSE(refused.ok()) << field << " " << value;
    EXPECT_NE(refused.status().message().find("adapter_config.json (" + field + ") = " + value.dump()),
              std::string::npos)
        << refused.status().message();
    EXPECT_NE(refused.status().message().find(says), std::string::npos) << refused.status().message();
  }
  // Initialisations of A and B alone: the saved weights replace them.
  for (const json& init : {json(true), json(false), json("gaussian"), json("eva"), json("orthogonal")}) {
    json ok = config;
    ok["init_lora_weights"] = init;
    ok["layer_replication"] = nullptr;
    ok["alora_invocation_tokens"] = nullptr;
    EXPECT_TRUE(parse_peft_config(ok.dump(), "adapter_config.json").ok()) << init;
  }
}

TEST(PeftFilesTest, ConfigErrorsSayWhatIsWrongWithTheFile) {
  auto message = [](std::string_view text) {
    return parse_peft_config(text, "adapter_config.json").status().message();
  };
  EXPECT_NE(message("{\n  \"r\": 8,\n  \"lora_alpha\": NaN\n}")
                .find("adapter_config.json: not valid JSON at line 3, column "),
            std::string::npos)
      << message("{\n  \"r\": 8,\n  \"lora_alpha\": NaN\n}");
  EXPECT_NE(message(R"({"lora_alpha": Infinity})").find("not valid JSON at line 1, column"), std::string::npos);
  EXPECT_EQ(message("[1, 2]"), "adapter_config.json: not a JSON object");
  EXPECT_NE(message(R"({"r": 8, "r": 4})").find("the key 'r' appears twice"), std::string::npos);

  testing::TempDir dir;
  ASSERT_EQ(::mkfifo((dir / "adapter_config.json").c_str(), 0600), 0);
  const auto fifo = read_peft_config(dir.str());
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.status().message().find("adapter_config.json: not a regular file (a FIFO)"), std::string::npos)
      << fifo.status().message();
}

}  // namespace
}  // namespace trestle
