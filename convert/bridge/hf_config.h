// config.json of a Hugging Face model: the architecture and the sizes Trestle needs, plus the raw JSON.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

struct HfModelConfig {
  std::string architecture;  // architectures[0], e.g. "LlamaForCausalLM"
  std::string model_type;    // "llama"
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_kv_heads = 0;  // num_key_value_heads, defaulting to num_attention_heads
  std::int64_t head_dim = 0;      // head_dim, defaulting to hidden_size / num_attention_heads
  std::int64_t vocab_size = 0;
  std::int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  std::optional<double> rope_theta;
  std::optional<double> norm_eps;
  std::int64_t num_experts = 0;  // num_local_experts / num_experts; 0 for dense models
  std::int64_t experts_per_token = 0;
  std::int64_t moe_intermediate_size = 0;
  std::string dtype;  // "bfloat16", from dtype or torch_dtype
  std::string source;  // what the config was read from (its file), named in errors about it
  // The language model's config: config.json itself, or (a vision-language model, whose config.json nests its language
  // model's under text_config) text_config with the outer architectures and tie_word_embeddings.
  nlohmann::json raw;
  // A vision-language model's whole config.json (vision_config included; what goes back out); null for text models.
  nlohmann::json outer;
  // A text model's config.json as given, when it leaves out keys that raw holds with transformers' defaults for its
  // class (what goes back out); null when nothing was added.
  nlohmann::json given;
  const nlohmann::json& file() const { return !outer.is_null() ? outer : !given.is_null() ? given : raw; }

  std::int64_t num_query_groups() const { return num_kv_heads; }
};

// Whether config.json of `architecture` nests its language model's config under text_config (Qwen3-VL).
bool nests_text_config(const std::string& architecture);

// The sliding window transformers applies: sliding_window when it is a positive number, unless use_sliding_window says
// no (the Qwen families keep a window they do not use: Qwen2.5's 131072, Qwen2-MoE's 0) or puts it in no layer; none
// otherwise.
std::optional<std::int64_t> hf_sliding_window(const nlohmann::json& config);
// The layers the Qwen families' use_sliding_window = true puts the window in, one flag per layer: transformers'
// layer_types where the config lists them, else the layers from max_window_layers (28 by default) on; and those a
// Mistral config's layer_types marks sliding (transformers loads it as Ministral). Empty otherwise.
std::vector<bool> hf_use_sliding_window_layers(const nlohmann::json& config);

Result<HfModelConfig> parse_hf_config(const nlohmann::json& config, const std::string& source);
Result<HfModelConfig> read_hf_config(const std::string& path);  // a config.json file

}  // namespace trestle
