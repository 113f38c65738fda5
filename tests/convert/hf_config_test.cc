// config.json parsing: the sizes Trestle needs, their defaults, and errors that name the file.
#include "convert/bridge/hf_config.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>

#include "convert/bridge/architectures.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

using json = nlohmann::json;

json llama_config() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "dtype": "bfloat16",
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}})");
}

TEST(HfConfigTest, ReadsLlamaSizes) {
  auto c = parse_hf_config(llama_config(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->intermediate_size, 176);
  EXPECT_EQ(c->num_layers, 2);
  EXPECT_EQ(c->num_attention_heads, 4);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->num_query_groups(), 2);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->vocab_size, 1000);
  EXPECT_EQ(c->max_position_embeddings, 128);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->norm_eps, 1e-6);
  EXPECT_EQ(c->dtype, "bfloat16");
  EXPECT_EQ(c->num_experts, 0);
  EXPECT_EQ(c->raw, llama_config());
}

TEST(HfConfigTest, DefaultsAndAlternativeKeys) {
  json config = llama_config();
  config.erase("num_key_value_heads");
  config.erase("dtype");
  config.erase("rope_parameters");
  config["torch_dtype"] = "float16";
  config["rope_theta"] = 500000.0;
  config["head_dim"] = 32;
  config["num_local_experts"] = 8;
  config["num_experts_per_tok"] = 2;
  auto c = parse_hf_config(config, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->num_kv_heads, 4) << "defaults to num_attention_heads";
  EXPECT_EQ(c->head_dim, 32) << "explicit head_dim wins over hidden / heads";
  EXPECT_EQ(c->dtype, "float16");
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->experts_per_token, 2);
  config["num_experts"] = 16;  // Qwen-MoE spelling takes precedence
  EXPECT_EQ(parse_hf_config(config, "config.json")->num_experts, 16);
}

TEST(HfConfigTest, ErrorsNameTheSource) {
  for (const char* key : {"hidden_size", "num_hidden_layers", "vocab_size", "num_key_value_heads"}) {
    SCOPED_TRACE(key);
    json config = llama_config();
    config[key] = -1;
    auto c = parse_hf_config(config, "/models/x/config.json");
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("/models/x/config.json"), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find(key), std::string::npos) << c.status().message();
    config[key] = "64";
    EXPECT_TRUE(fails_with(parse_hf_config(config, "config.json"),
                           std::string("'") + key + "' must be a non-negative integer"));
    config[key] = 1.5;
    EXPECT_TRUE(fails_with(parse_hf_config(config, "config.json"),
                           std::string("'") + key + "' must be a non-negative integer"));
  }
  json uneven = llama_config();
  uneven["num_key_value_heads"] = 3;
  auto c = parse_hf_config(uneven, "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("not a multiple"), std::string::npos) << c.status().message();
  EXPECT_TRUE(fails_with(parse_hf_config(json::array(), "config.json"), "config.json: config is not a JSON object"));
}

// Number fields that are present but not positive numbers are errors naming the field, not dropped for Megatron's
// defaults; experts per token cannot pass the experts.
TEST(HfConfigTest, BadNumbersAndExpertCountsAreRefused) {
  for (const auto& [key, value] : {std::pair<const char*, json>{"rms_norm_eps", "1e-6"},
                                   {"rms_norm_eps", -1.0},
                                   {"rms_norm_eps", 0},
                                   {"rope_theta", "abc"}}) {
    SCOPED_TRACE(key);
    json config = llama_config();
    config[key] = value;
    EXPECT_TRUE(fails_with(parse_hf_config(config, "config.json"),
                           std::string("config.json: '") + key + "' must be a positive number"));
  }
  json nested = llama_config();
  nested["rope_parameters"]["rope_theta"] = "abc";
  EXPECT_TRUE(fails_with(parse_hf_config(nested, "config.json"), "rope_parameters: 'rope_theta' must be a positive"));
  json absent = llama_config();
  absent["rms_norm_eps"] = nullptr;
  EXPECT_TRUE(parse_hf_config(absent, "config.json").ok()) << "null counts as absent";

  json moe = llama_config();
  moe["num_local_experts"] = 4;
  moe["num_experts_per_tok"] = 8;
  EXPECT_TRUE(fails_with(parse_hf_config(moe, "config.json"),
                         "config.json: num_experts_per_tok (8) is more than the model's 4 experts"));
  moe["num_experts_per_tok"] = 2;
  EXPECT_TRUE(parse_hf_config(moe, "config.json").ok());
}

// A RoPE block whose fields have the wrong type or value is refused naming the field, not read as no scaling.
TEST(HfConfigTest, AMistypedRopeBlockIsRefusedNotDropped) {
  const std::pair<json, const char*> cases[] = {
      {json::parse(R"({"rope_type": "linear", "factor": "4"})"), "rope_scaling: 'factor' must be a positive number"},
      {json::parse(R"({"rope_type": "linear"})"), "rope_scaling: RoPE type 'linear' needs its scaling 'factor'"},
      {json::parse(R"({"rope_type": "linear", "factor": 0})"),
       "rope_scaling: 'factor' must be a positive number, got 0"},
      {json::parse(R"({"rope_type": "linear", "factor": -4.0})"), "rope_scaling: 'factor' must be a positive number"},
      {json::parse(R"({"rope_type": 5, "factor": 4.0})"), "rope_scaling: 'rope_type' must be a string"},
      {json::parse(R"([{"rope_type": "linear", "factor": 4.0}])"), "rope_scaling must be an object (or null)"},
      {json("x"), "rope_scaling must be an object (or null)"},
      {json::parse(R"({"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"})"),
       "rope_scaling: 'beta_fast' must be a positive number"},
      {json::parse(R"({"rope_type": "yarn", "factor": 4.0, "mscale": -1.0})"),
       "rope_scaling: 'mscale' must be a number, 0 or more"},
      {json::parse(R"({"rope_type": "yarn", "factor": 4.0, "attention_factor": "1"})"),
       "rope_scaling: 'attention_factor' must be a finite"},
      {json::parse(R"({"full_attention": {"rope_type": "linear", "factor": "8"}})"),
       "rope_scaling.full_attention: 'factor' must be a positive number"},
  };
  for (const auto& [rope, words] : cases) {
    SCOPED_TRACE(rope.dump());
    json config = llama_config();
    config["rope_scaling"] = rope;
    EXPECT_TRUE(fails_with(parse_hf_config(config, "config.json"), std::string("config.json: ") + words));
  }
  json scaled = llama_config();
  scaled["rope_scaling"] = json::parse(R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})");
  EXPECT_TRUE(parse_hf_config(scaled, "config.json").ok());
  scaled["rope_scaling"] = nullptr;
  EXPECT_TRUE(parse_hf_config(scaled, "config.json").ok()) << "null counts as absent";
}

// A size that is zero or missing is named, with its value.
TEST(HfConfigTest, AMissingSizeIsNamed) {
  for (const char* key : {"num_key_value_heads", "vocab_size", "intermediate_size", "head_dim"}) {
    SCOPED_TRACE(key);
    json config = llama_config();
    config[key] = 0;
    auto parsed = parse_hf_config(config, "config.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status().message();
    EXPECT_TRUE(fails_with(bridge_model_from_config(*parsed), std::string("config's ") + key));
  }
}

TEST(HfConfigTest, OddlyTypedTieWordEmbeddingsIsAnErrorNotAnException) {
  // Parsing must return a Result, never throw: null counts as absent, other non-booleans are reported.
  json config = llama_config();
  config["tie_word_embeddings"] = nullptr;
  Result<HfModelConfig> c = Status::Error("not run");
  ASSERT_NO_THROW(c = parse_hf_config(config, "config.json"));
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_FALSE(c->tie_word_embeddings);
  config["tie_word_embeddings"] = true;
  EXPECT_TRUE(parse_hf_config(config, "config.json")->tie_word_embeddings);
  for (const json& value : {json(1), json("true")}) {
    SCOPED_TRACE(value.dump());
    config["tie_word_embeddings"] = value;
    ASSERT_NO_THROW(c = parse_hf_config(config, "/m/config.json"));
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("/m/config.json"), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("tie_word_embeddings"), std::string::npos) << c.status().message();
  }
}

TEST(HfConfigTest, ReadsFromAFile) {
  std::string pattern = (std::filesystem::temp_directory_path() / "trestle_cfg_XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::filesystem::path dir = pattern;
  std::ofstream(dir / "config.json") << llama_config().dump(2);
  auto c = read_hf_config((dir / "config.json").string());
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->vocab_size, 1000);
  std::ofstream(dir / "broken.json") << "{\"hidden_size\": ";
  auto broken = read_hf_config((dir / "broken.json").string());
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find((dir / "broken.json").string()), std::string::npos);
  EXPECT_NE(broken.status().message().find("not valid JSON"), std::string::npos);
  auto missing = read_hf_config((dir / "absent.json").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("absent.json"), std::string::npos);
  std::filesystem::remove_all(dir);
}

// transformers builds the class of a config's model_type: one naming another architecture Trestle reads than the
// config's architectures (a Llama labelled qwen2 would load as a Qwen2 with random biases) is refused; a model_type
// transformers does not know for these (a fine-tune's own) is not.
TEST(HfConfigTest, ModelTypeOfAnotherArchitectureIsRefused) {
  json config = llama_config();
  config["model_type"] = "qwen2";
  EXPECT_TRUE(fails_with(parse_hf_config(config, "config.json"),
                         "config.json: model_type 'qwen2' is transformers' Qwen2ForCausalLM, but architectures names "
                         "LlamaForCausalLM"));
  config["model_type"] = 5;
  EXPECT_TRUE(fails_with(parse_hf_config(config, "config.json"), "config.json: 'model_type' must be a string, got 5"));
  for (const char* fine : {"llama", "internlm3", "my_llama_finetune"}) {
    config["model_type"] = fine;
    EXPECT_TRUE(parse_hf_config(config, "config.json").ok()) << fine;
  }
  config.erase("model_type");
  EXPECT_TRUE(parse_hf_config(config, "config.json").ok());
  config["architectures"] = {"GPT2LMHeadModel"};  // (refused later as an architecture Trestle does not read)
  config["model_type"] = "llama";
  EXPECT_TRUE(parse_hf_config(config, "config.json").ok());
  // A vision-language config: the outer model_type is checked, its text config's own (gemma3_text) is the text model's.
  json vl = {{"architectures", {"Gemma3ForConditionalGeneration"}},
             {"model_type", "gemma3"},
             {"text_config", llama_config()},
             {"vision_config", json::object()}};
  vl["text_config"]["model_type"] = "gemma3_text";
  EXPECT_TRUE(parse_hf_config(vl, "config.json").ok()) << parse_hf_config(vl, "config.json").status().message();
  vl["model_type"] = "qwen3_vl";
  EXPECT_TRUE(fails_with(parse_hf_config(vl, "config.json"), "model_type 'qwen3_vl' is transformers' Qwen3VL"));
}

// The window transformers applies: none where use_sliding_window is false (Qwen2.5 keeps 131072 unused) or the
// window is 0 (Qwen2-MoE's "none"); Mistral's otherwise.
TEST(HfConfigTest, SlidingWindowAsTransformersAppliesIt) {
  EXPECT_EQ(hf_sliding_window(json{{"sliding_window", 4096}}), 4096);
  EXPECT_EQ(hf_sliding_window(json{{"sliding_window", 4}, {"use_sliding_window", false}}), std::nullopt);
  EXPECT_EQ(hf_sliding_window(json{{"sliding_window", 4}, {"use_sliding_window", true}}), 4);
  EXPECT_EQ(hf_sliding_window(json{{"sliding_window", 0}}), std::nullopt);
  EXPECT_EQ(hf_sliding_window(json{{"sliding_window", nullptr}}), std::nullopt);
  EXPECT_EQ(hf_sliding_window(json::object()), std::nullopt);
  // The Qwen families' use_sliding_window: the window in the layers from max_window_layers (28 by default) on, or
  // those transformers' layer_types lists; none where that is no layer.
  const json qwen = {{"sliding_window", 4}, {"use_sliding_window", true}, {"num_hidden_layers", 3}};
  EXPECT_EQ(hf_use_sliding_window_layers(qwen), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(hf_sliding_window(qwen), std::nullopt);
  json from = qwen;
  from["max_window_layers"] = 1;
  EXPECT_EQ(hf_use_sliding_window_layers(from), (std::vector<bool>{false, true, true}));
  EXPECT_EQ(hf_sliding_window(from), 4);
  from["max_window_layers"] = 0;
  EXPECT_EQ(hf_use_sliding_window_layers(from), (std::vector<bool>{true, true, true}));
  from["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};
  EXPECT_EQ(hf_use_sliding_window_layers(from), (std::vector<bool>{false, true, false}));
  from["use_sliding_window"] = false;
  EXPECT_TRUE(hf_use_sliding_window_layers(from).empty());
  EXPECT_TRUE(hf_use_sliding_window_layers(json{{"sliding_window", 4}}).empty());  // Mistral's: not this rule
  // ... unless a Mistral config lists layer_types (transformers loads it as Ministral, windowed where they say).
  const json ministral = {{"model_type", "mistral"},
                          {"sliding_window", 4},
                          {"num_hidden_layers", 2},
                          {"layer_types", {"full_attention", "sliding_attention"}}};
  EXPECT_EQ(hf_use_sliding_window_layers(ministral), (std::vector<bool>{false, true}));
  json full = ministral;
  full["layer_types"] = {"full_attention", "full_attention"};
  EXPECT_EQ(hf_sliding_window(full), std::nullopt);
}

// A sliding_window in the config of a family whose transformers model ignores it (Llama, OLMo 2, DeepSeek-V3) is no
// window: the model as transformers runs it; the file written back out keeps the key.
TEST(HfConfigTest, ASlidingWindowTheFamilyIgnoresIsNoWindow) {
  for (const auto& [architecture, type] : std::vector<std::pair<std::string, std::string>>{
           {"LlamaForCausalLM", "llama"}, {"Olmo2ForCausalLM", "olmo2"}, {"DeepseekV3ForCausalLM", "deepseek_v3"}}) {
    json config = llama_config();
    config["architectures"] = {architecture};
    config["model_type"] = type;
    config["sliding_window"] = 4;
    auto c = parse_hf_config(config, "config.json");
    ASSERT_TRUE(c.ok()) << architecture << ": " << c.status().message();
    EXPECT_EQ(hf_sliding_window(c->raw), std::nullopt) << architecture;
    EXPECT_EQ(c->file()["sliding_window"], 4) << architecture;
  }
  json mistral = llama_config();
  mistral["architectures"] = {"MistralForCausalLM"};
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = 4;
  EXPECT_EQ(hf_sliding_window(parse_hf_config(mistral, "config.json")->raw), 4);
}

// Keys a config.json leaves out take transformers' defaults for its class; what goes back out (file()) is the
// config as given.
TEST(HfConfigTest, LeftOutKeysTakeTransformersDefaults) {
  json config = llama_config();
  for (const char* key : {"rms_norm_eps", "rope_parameters", "max_position_embeddings"}) config.erase(key);
  auto c = parse_hf_config(config, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->norm_eps, 1e-6);
  EXPECT_EQ(c->rope_theta, 1e4);
  EXPECT_EQ(c->max_position_embeddings, 2048);
  EXPECT_EQ(c->file(), config);
  EXPECT_EQ(c->raw["rms_norm_eps"], 1e-6);

  config["architectures"] = {"MistralForCausalLM"};
  config["model_type"] = "mistral";
  c = parse_hf_config(config, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(hf_sliding_window(c->raw), 4096);  // MistralConfig's default window
  EXPECT_FALSE(c->file().contains("sliding_window"));
  config["sliding_window"] = nullptr;  // given: no window
  EXPECT_EQ(hf_sliding_window(parse_hf_config(config, "config.json")->raw), std::nullopt);

  config = llama_config();
  config["architectures"] = {"Gemma2ForCausalLM"};
  config["model_type"] = "gemma2";
  config.erase("tie_word_embeddings");
  c = parse_hf_config(config, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->raw["final_logit_softcapping"], 30.0);
  // A config that gives every key is read as it is.
  c = parse_hf_config(llama_config(), "config.json");
  EXPECT_TRUE(c->given.is_null());
}

// transformers' constant head sizes where config.json leaves head_dim out (Qwen3 128, Gemma 256, GPT-OSS 64), not
// hidden / heads; Llama's derives from the sizes.
TEST(HfConfigTest, ALeftOutHeadDimIsTheClassDefault) {
  for (const auto& [architecture, model_type, head_dim] : {std::tuple{"LlamaForCausalLM", "llama", 16},
                                                           {"Qwen3ForCausalLM", "qwen3", 128},
                                                           {"Gemma2ForCausalLM", "gemma2", 256},
                                                           {"Gemma3ForCausalLM", "gemma3_text", 256},
                                                           {"GptOssForCausalLM", "gpt_oss", 64},
                                                           {"Qwen3NextForCausalLM", "qwen3_next", 256}}) {
    json config = llama_config();
    config["architectures"] = {architecture};
    config["model_type"] = model_type;
    auto c = parse_hf_config(config, "config.json");
    ASSERT_TRUE(c.ok()) << architecture << ": " << c.status().message();
    EXPECT_EQ(c->head_dim, head_dim) << architecture;
    config["head_dim"] = 8;  // given: as given
    EXPECT_EQ(parse_hf_config(config, "config.json")->head_dim, 8) << architecture;
  }
}

// The hub's Gemma 3 vision-language configs leave out of text_config what equals Gemma3TextConfig's defaults (heads,
// KV heads, head_dim, vocabulary): those are transformers' defaults, not hidden / heads.
TEST(HfConfigTest, AGemma3VisionConfigsSparseTextConfigTakesTheTextDefaults) {
  const json config = json::parse(R"({
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": false}})");
  auto c = parse_hf_config(config, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->hidden_size, 2560);
  EXPECT_EQ(c->num_layers, 34);
  EXPECT_EQ(c->num_attention_heads, 8);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->vocab_size, 262208);
  EXPECT_EQ(hf_sliding_window(c->raw), 1024);
  EXPECT_TRUE(c->tie_word_embeddings);
}

// A family's optional key of the wrong kind or out of range is refused naming it, never read as absent (no window,
// no soft-cap, no group routing, ...); null stays "absent".
TEST(HfConfigTest, AnOptionalKeyOfTheWrongKindIsRefusedNotDropped) {
  for (const auto& [key, value, expected] :
       {std::tuple{"sliding_window", json("4"), "'sliding_window' must be an integer, 0 or more"},
        {"sliding_window", json(4.5), "'sliding_window' must be an integer, 0 or more"},
        {"sliding_window", json(-8), "'sliding_window' must be an integer, 0 or more"},
        {"final_logit_softcapping", json(-5.0), "'final_logit_softcapping' must be a positive number"},
        {"final_logit_softcapping", json("5"), "'final_logit_softcapping' must be a positive number"},
        {"query_pre_attn_scalar", json(0), "'query_pre_attn_scalar' must be a positive number"},
        {"swiglu_limit", json("7"), "'swiglu_limit' must be a positive number"},
        {"n_group", json(0), "'n_group' must be an integer from 1"},
        {"routed_scaling_factor", json("2.5"), "'routed_scaling_factor' must be a positive number"},
        {"hidden_act", json(3), "'hidden_act' must be a string"},
        {"attention_bias", json("false"), "'attention_bias' must be true or false"},
        {"mlp_only_layers", json("0"), "'mlp_only_layers' must be a list of layer numbers"},
        {"kv_lora_rank", json(std::int64_t{1} << 40), "'kv_lora_rank' must be an integer from 1 to 4194304"}}) {
    json config = llama_config();
    config[key] = value;
    EXPECT_TRUE(fails_with(parse_hf_config(config, "dir/config.json"), std::string("dir/config.json: ") + expected))
        << value.dump();
    config[key] = nullptr;
    EXPECT_TRUE(parse_hf_config(config, "dir/config.json").ok()) << key;
  }
  json off = llama_config();  // 0 is no window (Qwen2-MoE's); one use_sliding_window turns off is not read (Qwen2's)
  off["sliding_window"] = 0;
  EXPECT_TRUE(parse_hf_config(off, "config.json").ok());
  off["sliding_window"] = -1;
  off["use_sliding_window"] = false;
  EXPECT_TRUE(parse_hf_config(off, "config.json").ok());
  json rope = llama_config();  // a kind of layer's RoPE block that is not one
  rope["rope_parameters"] = {{"full_attention", "linear"}};
  EXPECT_TRUE(fails_with(parse_hf_config(rope, "config.json"), "'full_attention' must be an object"));
  rope["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", -32.0}};
  EXPECT_TRUE(fails_with(parse_hf_config(rope, "config.json"), "'beta_fast' must be a positive number"));
}

// Sizes past any model's are refused before they are multiplied: a head_dim of 2^62 + 16 times 4 heads wrapped to
// 64 rows, and the model converted as one with 16-wide heads.
TEST(HfConfigTest, SizesPastAnyModelsAreRefusedBeforeTheyWrap) {
  for (const auto& [key, most] : {std::pair{"hidden_size", "4194304"},
                                  {"intermediate_size", "4194304"},
                                  {"head_dim", "4194304"},
                                  {"vocab_size", "68719476736"}}) {
    json config = llama_config();
    config[key] = (std::int64_t{1} << 62) + 16;
    EXPECT_TRUE(fails_with(
        parse_hf_config(config, "config.json"),
        std::string("'") + key + "' is 4611686018427387920, more than Trestle converts (at most " + most + ")"));
  }
}

}  // namespace
}  // namespace trestle
