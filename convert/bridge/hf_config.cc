#include "convert/bridge/hf_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "ckpt/json_file.h"
#include "parallel/layout/model_spec.h"

namespace trestle {
namespace {

using json = nlohmann::json;

// Reads an integer field that may be absent (fallback) but, when present, must be a non-negative integer.
Result<std::int64_t> int_field(const json& config, const char* key, std::int64_t fallback, const std::string& source) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  if (!config[key].is_number_integer() || config[key].get<std::int64_t>() < 0)
    return Status::Error(source + ": '" + key + "' must be a non-negative integer, got " + config[key].dump());
  return config[key].get<std::int64_t>();
}

// A positive number, or absent (missing or null); anything else is an error naming the field.
Result<std::optional<double>> positive_number_field(const json& object, const char* key, const std::string& source) {
  if (!object.is_object() || !object.contains(key) || object[key].is_null()) return std::optional<double>();
  const json& value = object[key];
  if (!value.is_number() || !(value.get<double>() > 0) || !std::isfinite(value.get<double>()))
    return Status::Error(source + ": '" + key + "' must be a positive number, got " + value.dump());
  return std::optional<double>(value.get<double>());
}

enum class KeyKind { kFlag, kText, kPositiveInteger, kCount, kPositiveNumber, kLayerList };

// Optional keys the family readers take where present, by kind. One that is there (and not null) but of another kind
// or out of range is refused naming it: a reader would otherwise take it as absent and build another model.
constexpr std::pair<std::string_view, KeyKind> kOptionalKeys[] = {
    {"attention_bias", KeyKind::kFlag},
    {"mlp_bias", KeyKind::kFlag},
    {"norm_topk_prob", KeyKind::kFlag},
    {"use_qk_norm", KeyKind::kFlag},
    {"use_sliding_window", KeyKind::kFlag},
    {"rope_interleave", KeyKind::kFlag},
    {"attention_k_eq_v", KeyKind::kFlag},
    {"use_double_wide_mlp", KeyKind::kFlag},
    {"enable_moe_block", KeyKind::kFlag},
    {"hidden_act", KeyKind::kText},
    {"hidden_activation", KeyKind::kText},
    {"mamba_hidden_act", KeyKind::kText},
    {"mlp_hidden_act", KeyKind::kText},
    {"scoring_func", KeyKind::kText},
    {"topk_method", KeyKind::kText},
    {"n_group", KeyKind::kPositiveInteger},
    {"topk_group", KeyKind::kPositiveInteger},
    {"decoder_sparse_step", KeyKind::kPositiveInteger},
    {"q_lora_rank", KeyKind::kPositiveInteger},
    {"kv_lora_rank", KeyKind::kPositiveInteger},
    {"qk_nope_head_dim", KeyKind::kPositiveInteger},
    {"qk_rope_head_dim", KeyKind::kPositiveInteger},
    {"v_head_dim", KeyKind::kPositiveInteger},
    {"first_k_dense_replace", KeyKind::kCount},
    {"n_shared_experts", KeyKind::kCount},
    {"num_nextn_predict_layers", KeyKind::kCount},
    {"shared_expert_intermediate_size", KeyKind::kCount},
    {"moe_shared_expert_intermediate_size", KeyKind::kCount},
    {"final_logit_softcapping", KeyKind::kPositiveNumber},
    {"attn_logit_softcapping", KeyKind::kPositiveNumber},
    {"query_pre_attn_scalar", KeyKind::kPositiveNumber},
    {"swiglu_limit", KeyKind::kPositiveNumber},
    {"routed_scaling_factor", KeyKind::kPositiveNumber},
    {"rope_local_base_freq", KeyKind::kPositiveNumber},
    {"mlp_only_layers", KeyKind::kLayerList},
};

Status check_optional_keys(const json& config, const std::string& source) {
  for (const auto& [key, kind] : kOptionalKeys) {
    const auto it = config.find(key);
    if (it == config.end() || it->is_null()) continue;
    const json& v = *it;
    const bool integer = v.is_number_integer();
    const double number = v.is_number() ? v.get<double>() : NAN;
    std::string wanted;
    switch (kind) {
      case KeyKind::kFlag:
        if (!v.is_boolean()) wanted = "true or false";
        break;
      case KeyKind::kText:
        if (!v.is_string()) wanted = "a string";
        break;
      case KeyKind::kPositiveInteger:
        if (!integer || v.get<std::int64_t>() < 1 || v.get<std::int64_t>() > kMaxModelWidth)
          wanted = "an integer from 1 to " + std::to_string(kMaxModelWidth);
        break;
      case KeyKind::kCount:
        if (!integer || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() > kMaxModelWidth)
          wanted = "an integer from 0 to " + std::to_string(kMaxModelWidth);
        break;
      case KeyKind::kPositiveNumber:
        if (!(number > 0) || !std::isfinite(number)) wanted = "a positive number (or null)";
        break;
      case KeyKind::kLayerList:
        if (!v.is_array() || std::any_of(v.begin(), v.end(), [](const json& e) {
              return !e.is_number_integer() || e.get<std::int64_t>() < 0;
            }))
          wanted = "a list of layer numbers";
        break;
    }
    if (!wanted.empty())
      return Status::Error(source + ": '" + std::string(key) + "' must be " + wanted + ", got " + v.dump());
  }
  // (0 is no window, as in Qwen2-MoE's configs; a window use_sliding_window turns off is not read)
  if (const auto w = config.find("sliding_window"); w != config.end() && !w->is_null()) {
    const auto use = config.find("use_sliding_window");
    const bool off = use != config.end() && use->is_boolean() && !use->get<bool>();
    if (!w->is_number_integer() || (!off && w->get<std::int64_t>() < 0))
      return Status::Error(source + ": 'sliding_window' must be an integer, 0 or more (0 or null: no window), got " +
                           w->dump());
  }
  return OkStatus();
}

// One RoPE parameter block: its type (rope_type or type) a string, its scalar parameters finite numbers (the scaling
// factor, the original context and the base positive, the partial rotary factor in (0, 1]), and a factor where the
// type scales by one (transformers computes with it there). Blocks per kind of layer (transformers 5's Gemma
// rope_parameters: full_attention, sliding_attention) are each checked.
Status check_rope_block(const json& r, const std::string& where) {
  if (!r.is_object()) return Status::Error(where + " must be an object (or null), got " + r.dump().substr(0, 120));
  std::string type;
  for (const char* field : {"rope_type", "type"}) {
    const auto it = r.find(field);
    if (it == r.end() || it->is_null()) continue;
    if (!it->is_string())
      return Status::Error(where + ": '" + field + "' must be a string (the RoPE type), got " + it->dump());
    if (type.empty()) type = it->get<std::string>();
  }
  for (const auto& [key, value] : r.items()) {
    if (value.is_object()) {
      TRESTLE_RETURN_IF_ERROR(check_rope_block(value, where + "." + key));
    } else if (key.ends_with("_attention") && !value.is_null()) {  // a kind of layer's own block (Gemma's)
      return Status::Error(where + ": '" + key + "' must be an object (that kind of layer's RoPE), got " +
                           value.dump().substr(0, 120));
    }
  }
  for (const char* key :
       {"factor", "original_max_position_embeddings", "rope_theta", "partial_rotary_factor", "low_freq_factor",
        "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"}) {
    const auto it = r.find(key);
    if (it == r.end() || it->is_null()) continue;
    const std::string_view k = key;
    const bool positive = k == "factor" || k == "rope_theta" || k == "original_max_position_embeddings" ||
                          k == "beta_fast" || k == "beta_slow";
    const bool not_negative = k == "mscale" || k == "mscale_all_dim";
    const bool fraction = k == "partial_rotary_factor";
    const double v = it->is_number() ? it->get<double>() : NAN;
    if (!std::isfinite(v) || (positive && !(v > 0)) || (not_negative && v < 0) || (fraction && !(v > 0 && v <= 1)))
      return Status::Error(where + ": '" + key + "' must be " +
                           (positive       ? "a positive number"
                            : not_negative ? "a number, 0 or more"
                            : fraction     ? "a number in (0, 1]"
                                           : "a finite number") +
                           ", got " + it->dump());
  }
  if ((type == "linear" || type == "llama3" || type == "yarn" || type == "dynamic") && !r.contains("factor"))
    return Status::Error(where + ": RoPE type '" + type + "' needs its scaling 'factor'");
  return OkStatus();
}

// transformers' model_type of each architecture Trestle reads (its AutoModel mappings, transformers 5.x): a config
// whose model_type is one of these but whose architectures names another is one transformers would build as the
// model_type's class. Types transformers does not know here (a fine-tune's own, Kimi K2's) are not checked.
constexpr std::pair<std::string_view, std::string_view> kKnownModelTypes[] = {
    {"llama", "LlamaForCausalLM"},
    {"internlm3", "LlamaForCausalLM"},
    {"mistral", "MistralForCausalLM"},
    {"qwen2", "Qwen2ForCausalLM"},
    {"qwen3", "Qwen3ForCausalLM"},
    {"mixtral", "MixtralForCausalLM"},
    {"qwen3_moe", "Qwen3MoeForCausalLM"},
    {"phi3", "Phi3ForCausalLM"},
    {"qwen2_moe", "Qwen2MoeForCausalLM"},
    {"gemma2", "Gemma2ForCausalLM"},
    {"gemma3_text", "Gemma3ForCausalLM"},
    {"gemma3", "Gemma3ForConditionalGeneration"},
    {"olmo2", "Olmo2ForCausalLM"},
    {"deepseek_v3", "DeepseekV3ForCausalLM"},
    {"gpt_oss", "GptOssForCausalLM"},
    {"glm4_moe", "Glm4MoeForCausalLM"},
    {"qwen3_next", "Qwen3NextForCausalLM"},
    {"qwen3_5", "Qwen3_5ForCausalLM"},
    {"qwen3_5_text", "Qwen3_5ForCausalLM"},
    {"qwen3_5_moe", "Qwen3_5MoeForCausalLM"},
    {"qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"},
    {"nemotron_h", "NemotronHForCausalLM"},
    {"gemma4_text", "Gemma4ForCausalLM"},
    {"gemma4", "Gemma4ForConditionalGeneration"},
    {"qwen3_vl", "Qwen3VLForConditionalGeneration"},
    {"qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"},
};

// A model_type that is not text, or that names another architecture Trestle reads than `architecture`.
Status check_model_type(const json& config, const std::string& architecture, const std::string& source) {
  const auto type = config.find("model_type");
  if (type == config.end() || type->is_null()) return OkStatus();
  if (!type->is_string()) return Status::Error(source + ": 'model_type' must be a string, got " + type->dump());
  const std::string& name = type->get_ref<const std::string&>();
  std::string_view named;
  bool read_here = false;  // (an architecture Trestle does not read is refused as that, naming the ones it does)
  for (const auto& [known, arch] : kKnownModelTypes) {
    read_here |= arch == architecture;
    if (known != name) continue;
    if (arch == architecture) return OkStatus();
    named = arch;
  }
  if (named.empty() || !read_here) return OkStatus();
  return Status::Error(source + ": model_type '" + name + "' is transformers' " + std::string(named) +
                       ", but architectures names " + architecture +
                       " (transformers would build the former from this config, Trestle reads the latter): make the "
                       "two agree");
}

// transformers' defaults (5.x) for the keys of a config.json that change the model Trestle reads, per architecture:
// what transformers uses where config.json leaves the key out (hand-written configs; save_pretrained writes them all).
// Keys whose default derives from others (num_key_value_heads, layer_types; head_dim where the class has no constant
// default) are defaulted where read.
const nlohmann::json* transformers_defaults(const std::string& architecture) {
  static const std::map<std::string, json, std::less<>> kDefaults = [] {
    auto dense = [](double eps, std::int64_t positions, double theta) {
      return json{{"rms_norm_eps", eps},
                  {"max_position_embeddings", positions},
                  {"tie_word_embeddings", false},
                  {"rope_theta", theta}};
    };
    auto with = [](json base, const json& more) {
      base.update(more);
      return base;
    };
    std::map<std::string, json, std::less<>> d;
    d["LlamaForCausalLM"] = dense(1e-6, 2048, 1e4);
    d["MistralForCausalLM"] = with(dense(1e-6, 131072, 1e4), {{"sliding_window", 4096}});
    d["Qwen2ForCausalLM"] = dense(1e-6, 32768, 1e4);
    d["Qwen3ForCausalLM"] = with(dense(1e-6, 32768, 1e4), {{"head_dim", 128}});
    d["MixtralForCausalLM"] = dense(1e-5, 131072, 1e6);
    d["Qwen3MoeForCausalLM"] = with(dense(1e-6, 32768, 1e4), {{"norm_topk_prob", false}});
    d["Phi3ForCausalLM"] = dense(1e-5, 4096, 1e4);
    d["Qwen2MoeForCausalLM"] = with(dense(1e-6, 32768, 1e4), {{"norm_topk_prob", false}});
    d["Gemma2ForCausalLM"] = with(dense(1e-6, 8192, 1e4), {{"tie_word_embeddings", true},
                                                           {"head_dim", 256},
                                                           {"sliding_window", 4096},
                                                           {"attn_logit_softcapping", 50.0},
                                                           {"final_logit_softcapping", 30.0}});
    d["Olmo2ForCausalLM"] = dense(1e-5, 2048, 1e4);
    d["DeepseekV3ForCausalLM"] = with(dense(1e-6, 4096, 1e4), {{"norm_topk_prob", true},
                                                               {"routed_scaling_factor", 2.5},
                                                               {"n_group", 8},
                                                               {"topk_group", 4},
                                                               {"first_k_dense_replace", 3},
                                                               {"n_shared_experts", 1},
                                                               {"q_lora_rank", 1536},
                                                               {"kv_lora_rank", 512},
                                                               {"qk_rope_head_dim", 64},
                                                               {"qk_nope_head_dim", 128},
                                                               {"v_head_dim", 128},
                                                               {"rope_interleave", true}});
    d["Glm4MoeForCausalLM"] = with(dense(1e-5, 131072, 1e4), {{"norm_topk_prob", true}});
    d["Qwen3NextForCausalLM"] = with(dense(1e-6, 32768, 1e4), {{"norm_topk_prob", true}, {"head_dim", 256}});
    d["Qwen3_5ForCausalLM"] = with(dense(1e-6, 32768, 1e4), {{"head_dim", 256}});
    d["Qwen3_5MoeForCausalLM"] = with(dense(1e-6, 32768, 1e4), {{"head_dim", 256}});
    // (their RoPE is per layer type, or YaRN's: a whole rope_parameters, given only when no RoPE key is there)
    const json gemma = {{"rms_norm_eps", 1e-6}, {"max_position_embeddings", 131072}, {"tie_word_embeddings", true}};
    auto rope = [](double theta, const char* type) { return json{{"rope_type", type}, {"rope_theta", theta}}; };
    // (Gemma 3's sizes too: the hub's Gemma 3 vision-language configs leave out of text_config what equals them.)
    d["Gemma3ForCausalLM"] = with(
        gemma,
        {{"vocab_size", 262208},
         {"hidden_size", 2304},
         {"intermediate_size", 9216},
         {"num_hidden_layers", 26},
         {"num_attention_heads", 8},
         {"num_key_value_heads", 4},
         {"head_dim", 256},
         {"query_pre_attn_scalar", 256},
         {"sliding_window", 4096},
         {"rope_parameters", {{"sliding_attention", rope(1e4, "default")}, {"full_attention", rope(1e6, "default")}}}});
    d["Gemma3ForConditionalGeneration"] = d["Gemma3ForCausalLM"];  // its text_config's
    json gemma4_full = rope(1e6, "proportional");
    gemma4_full["partial_rotary_factor"] = 0.25;
    d["Gemma4ForCausalLM"] = with(
        gemma, {{"sliding_window", 512},
                {"head_dim", 256},
                {"rope_parameters", {{"sliding_attention", rope(1e4, "default")}, {"full_attention", gemma4_full}}}});
    json yarn = rope(150000.0, "yarn");
    yarn.update({{"factor", 32.0},
                 {"beta_fast", 32.0},
                 {"beta_slow", 1.0},
                 {"truncate", false},
                 {"original_max_position_embeddings", 4096}});
    d["GptOssForCausalLM"] = {{"rms_norm_eps", 1e-5},
                              {"max_position_embeddings", 131072},
                              {"tie_word_embeddings", false},
                              {"sliding_window", 128},
                              {"head_dim", 64},
                              {"swiglu_limit", 7.0},
                              {"rope_parameters", yarn}};
    d["NemotronHForCausalLM"] = {{"layer_norm_epsilon", 1e-5},
                                 {"head_dim", 128},
                                 {"max_position_embeddings", 4096},
                                 {"tie_word_embeddings", false},
                                 {"norm_topk_prob", true}};
    // The vision-language models' text configs (read under the outer architecture): their head sizes.
    d["Gemma4ForConditionalGeneration"] = {{"head_dim", 256}};
    d["Qwen3VLForConditionalGeneration"] = {{"head_dim", 128}};
    return d;
  }();
  const auto it = kDefaults.find(architecture);
  return it == kDefaults.end() ? nullptr : &it->second;
}

// Whether transformers' model of `architecture` reads sliding_window. Llama's, OLMo 2's, DeepSeek-V3's and the other
// families' configs may carry one (copied from another family's, or written by a tool) that their models never apply.
bool reads_sliding_window(const std::string& architecture) {
  static const std::set<std::string> kWindowed{"MistralForCausalLM",  "MixtralForCausalLM",
                                               "Phi3ForCausalLM",     "Qwen2ForCausalLM",
                                               "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
                                               "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                                               "Gemma3ForCausalLM",   "Gemma3ForConditionalGeneration",
                                               "Gemma4ForCausalLM",   "Gemma4ForConditionalGeneration",
                                               "GptOssForCausalLM"};
  return architecture.empty() || kWindowed.contains(architecture);
}

// `config` as transformers' class reads it: its defaults for the keys it leaves out, without a sliding_window the
// class ignores (one of the wrong kind stays, to be refused as in any config); whether anything changed. RoPE's base
// counts as given when rope_parameters holds one.
bool add_transformers_defaults(const std::string& architecture, json& config) {
  bool added = false;
  if (const auto w = config.find("sliding_window");
      !reads_sliding_window(architecture) && w != config.end() && w->is_number_integer() && *w >= 0) {
    config.erase(w);
    added = true;
  }
  const json* defaults = transformers_defaults(architecture);
  if (!defaults) return added;
  for (const auto& [key, value] : defaults->items()) {
    if (config.contains(key)) continue;
    if (key == "rope_theta")
      if (const auto r = config.find("rope_parameters"); r != config.end() && r->is_object() && r->contains(key))
        continue;
    if (key == "rope_parameters" &&
        (config.contains("rope_scaling") || config.contains("rope_theta") || config.contains("rope_local_base_freq")))
      continue;
    config[key] = value;
    added = true;
  }
  return added;
}

}  // namespace

bool nests_text_config(const std::string& architecture) {
  return architecture == "Qwen3VLForConditionalGeneration" || architecture == "Qwen3VLMoeForConditionalGeneration" ||
         architecture == "Gemma3ForConditionalGeneration" || architecture == "Gemma4ForConditionalGeneration";
}

Result<HfModelConfig> parse_hf_config(const json& config, const std::string& source) {
  if (!config.is_object()) return Status::Error(source + ": config is not a JSON object");
  if (const auto a = config.find("architectures");
      a != config.end() && a->is_array() && !a->empty() && (*a)[0].is_string() &&
      nests_text_config((*a)[0].get<std::string>()) && (config.contains("text_config") || !config.contains("hidden_size"))) {
    // (the language model's own config, parsed below, names the same architecture and has its sizes)
    const auto text = config.find("text_config");
    if (text == config.end() || !text->is_object())
      return Status::Error(source + ": " + (*a)[0].get<std::string>() +
                           " needs its language model's config in text_config (an object)");
    json inner = *text;
    inner["architectures"] = *a;
    // transformers ties by the outer config's tie_word_embeddings, else its class's default (Qwen3-VL's false, the
    // Gemmas' true), whatever text_config says.
    const auto tie = config.find("tie_word_embeddings");
    inner["tie_word_embeddings"] = tie != config.end() ? *tie : json((*a)[0].get<std::string>().starts_with("Gemma"));
    if (const auto vision = config.find("vision_config"); vision == config.end() || !vision->is_object())
      return Status::Error(source + ": " + (*a)[0].get<std::string>() + " needs vision_config (an object)");
    TRESTLE_ASSIGN_OR_RETURN(HfModelConfig c, parse_hf_config(inner, source + " (text_config)"));
    c.outer = config;
    c.source = source;
    if (const auto t = config.find("model_type"); t != config.end() && t->is_string()) c.model_type = *t;
    TRESTLE_RETURN_IF_ERROR(check_model_type(config, c.architecture, source));
    return c;
  }
  HfModelConfig c;
  c.raw = config;
  c.source = source;
  if (config.contains("architectures") && config["architectures"].is_array() && !config["architectures"].empty() &&
      config["architectures"][0].is_string())
    c.architecture = config["architectures"][0].get<std::string>();
  if (config.contains("model_type") && config["model_type"].is_string())
    c.model_type = config["model_type"].get<std::string>();
  // (a nested text config's own model_type is the text model's: the outer config's is checked above)
  if (!nests_text_config(c.architecture)) TRESTLE_RETURN_IF_ERROR(check_model_type(config, c.architecture, source));
  if (json filled = config; add_transformers_defaults(c.architecture, filled)) {
    TRESTLE_ASSIGN_OR_RETURN(HfModelConfig with_defaults, parse_hf_config(filled, source));
    with_defaults.given = config;
    return with_defaults;
  }
  TRESTLE_RETURN_IF_ERROR(check_optional_keys(config, source));
  TRESTLE_ASSIGN_OR_RETURN(c.hidden_size, int_field(config, "hidden_size", 0, source));
  TRESTLE_ASSIGN_OR_RETURN(c.intermediate_size, int_field(config, "intermediate_size", 0, source));
  TRESTLE_ASSIGN_OR_RETURN(c.num_layers, int_field(config, "num_hidden_layers", 0, source));
  // Configs that list their layers (Nemotron-H's layers_block_type or hybrid_override_pattern) need not count them.
  if (c.num_layers == 0) {
    if (const auto t = config.find("layers_block_type"); t != config.end() && t->is_array())
      c.num_layers = static_cast<std::int64_t>(t->size());
    else if (const auto p = config.find("hybrid_override_pattern"); p != config.end() && p->is_string())
      c.num_layers = static_cast<std::int64_t>(p->get<std::string>().size());
  }
  TRESTLE_ASSIGN_OR_RETURN(c.num_attention_heads, int_field(config, "num_attention_heads", 0, source));
  TRESTLE_ASSIGN_OR_RETURN(c.num_kv_heads, int_field(config, "num_key_value_heads", c.num_attention_heads, source));
  // Multi-latent attention (DeepSeek) has no key-value heads of its own: every head reads the shared latent.
  if (config.contains("kv_lora_rank") && config["kv_lora_rank"].is_number_integer()) c.num_kv_heads = c.num_attention_heads;
  const std::int64_t default_head_dim = c.num_attention_heads ? c.hidden_size / c.num_attention_heads : 0;
  TRESTLE_ASSIGN_OR_RETURN(c.head_dim, int_field(config, "head_dim", default_head_dim, source));
  TRESTLE_ASSIGN_OR_RETURN(c.vocab_size, int_field(config, "vocab_size", 0, source));
  TRESTLE_ASSIGN_OR_RETURN(c.max_position_embeddings, int_field(config, "max_position_embeddings", 0, source));
  TRESTLE_ASSIGN_OR_RETURN(std::int64_t local_experts, int_field(config, "num_local_experts", 0, source));
  TRESTLE_ASSIGN_OR_RETURN(std::int64_t routed_experts, int_field(config, "n_routed_experts", local_experts, source));
  TRESTLE_ASSIGN_OR_RETURN(c.num_experts, int_field(config, "num_experts", routed_experts, source));
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t top_k, int_field(config, "top_k_experts", 0, source));  // Gemma 4's
  TRESTLE_ASSIGN_OR_RETURN(c.experts_per_token, int_field(config, "num_experts_per_tok", top_k, source));
  TRESTLE_ASSIGN_OR_RETURN(c.moe_intermediate_size, int_field(config, "moe_intermediate_size", 0, source));
  // json::value() throws on a non-boolean; null counts as absent, anything else is an error.
  if (config.contains("tie_word_embeddings") && !config["tie_word_embeddings"].is_null()) {
    if (!config["tie_word_embeddings"].is_boolean())
      return Status::Error(source + ": 'tie_word_embeddings' must be true or false, got " +
                           config["tie_word_embeddings"].dump());
    c.tie_word_embeddings = config["tie_word_embeddings"].get<bool>();
  }
  for (const char* key : {"rope_scaling", "rope_parameters"})
    if (config.contains(key) && !config[key].is_null())
      TRESTLE_RETURN_IF_ERROR(check_rope_block(config[key], source + ": " + key));
  // transformers 5 moved rope_theta into rope_parameters; older configs keep it at the top level.
  TRESTLE_ASSIGN_OR_RETURN(c.rope_theta, positive_number_field(config, "rope_theta", source));
  if (!c.rope_theta && config.contains("rope_parameters")) {
    TRESTLE_ASSIGN_OR_RETURN(
        c.rope_theta, positive_number_field(config["rope_parameters"], "rope_theta", source + ": rope_parameters"));
  }
  for (const char* key : {"rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"}) {  // the last: Nemotron-H
    if (c.norm_eps) break;
    TRESTLE_ASSIGN_OR_RETURN(c.norm_eps, positive_number_field(config, key, source));
  }
  for (const char* key : {"dtype", "torch_dtype"})
    if (c.dtype.empty() && config.contains(key) && config[key].is_string()) c.dtype = config[key].get<std::string>();
  // (the widths bounded before anything multiplies them: parallel/layout's bounds)
  for (const auto& [key, value, most] : {std::tuple{"hidden_size", c.hidden_size, kMaxModelWidth},
                                         {"intermediate_size", c.intermediate_size, kMaxModelWidth},
                                         {"head_dim", c.head_dim, kMaxModelWidth},
                                         {"moe_intermediate_size", c.moe_intermediate_size, kMaxModelWidth},
                                         {"vocab_size", c.vocab_size, kMaxVocabSize}})
    if (value > most)
      return Status::Error(source + ": '" + std::string(key) + "' is " + std::to_string(value) +
                           ", more than Trestle converts (at most " + std::to_string(most) + ")");
  // Counts the bridge loops over (per layer, per expert) are bounded before anything loops over them.
  for (const auto& [key, value] : {std::pair{"num_hidden_layers", c.num_layers},
                                   {"num_experts", c.num_experts},
                                   {"num_attention_heads", c.num_attention_heads},
                                   {"num_key_value_heads", c.num_kv_heads}})
    if (value > 100'000)
      return Status::Error(source + ": '" + std::string(key) + "' is " + std::to_string(value) +
                           ", more than Trestle converts (at most 100000)");
  if (c.num_experts > 0 && c.experts_per_token > c.num_experts)
    return Status::Error(source + ": num_experts_per_tok (" + std::to_string(c.experts_per_token) +
                         ") is more than the model's " + std::to_string(c.num_experts) + " experts");
  if (c.num_kv_heads > 0 && c.num_attention_heads % c.num_kv_heads != 0)
    return Status::Error(source + ": num_attention_heads (" + std::to_string(c.num_attention_heads) +
                         ") is not a multiple of num_key_value_heads (" + std::to_string(c.num_kv_heads) + ")");
  return c;
}

std::optional<std::int64_t> hf_sliding_window(const json& config) {
  if (const auto use = config.find("use_sliding_window"); use != config.end() && use->is_boolean() && !use->get<bool>())
    return std::nullopt;
  const auto w = config.find("sliding_window");
  if (w == config.end() || !w->is_number_integer() || w->get<std::int64_t>() <= 0) return std::nullopt;
  if (const auto layers = hf_use_sliding_window_layers(config);
      !layers.empty() && std::none_of(layers.begin(), layers.end(), [](bool windowed) { return windowed; }))
    return std::nullopt;
  return w->get<std::int64_t>();
}

std::vector<bool> hf_use_sliding_window_layers(const json& config) {
  const auto use = config.find("use_sliding_window");
  const auto count = config.find("num_hidden_layers");
  if (count == config.end() || !count->is_number_integer() || count->get<std::int64_t>() < 1 ||
      count->get<std::int64_t>() > kMaxModelWidth)
    return {};
  const std::int64_t layers = count->get<std::int64_t>();
  const auto t = config.find("layer_types");
  const bool typed = t != config.end() && t->is_array() && static_cast<std::int64_t>(t->size()) == layers;
  // transformers' AutoConfig loads a Mistral config that lists layer_types as Ministral's: windowed where it says.
  const auto model_type = config.find("model_type");
  const bool mistral_types = typed && model_type != config.end() && *model_type == "mistral";
  if (!mistral_types && (use == config.end() || !use->is_boolean() || !use->get<bool>())) return {};
  std::vector<bool> windowed;
  if (typed) {
    for (const auto& type : *t) windowed.push_back(type == "sliding_attention");
    return windowed;
  }
  const auto from = config.find("max_window_layers");
  const std::int64_t first = from != config.end() && from->is_number_integer() ? from->get<std::int64_t>() : 28;
  for (std::int64_t i = 0; i < layers; ++i) windowed.push_back(i >= first);
  return windowed;
}

Result<HfModelConfig> read_hf_config(const std::string& path) {
  TRESTLE_ASSIGN_OR_RETURN(const json config, read_json_file(path));
  return parse_hf_config(config, path);
}

}  // namespace trestle
