#include "parallel/layout/model_spec.h"

#include <algorithm>
#include <set>
#include <type_traits>
#include <utility>

namespace trestle {

std::string_view norm_naming_name(NormNaming naming) {
  return naming == NormNaming::kLocal ? "local" : "transformer_engine";
}

std::string input_norm_name(NormNaming naming) {
  return naming == NormNaming::kTransformerEngine ? "self_attention.linear_qkv.layer_norm_weight"
                                                  : "input_layernorm.weight";
}

std::string pre_mlp_norm_name(NormNaming naming, bool moe) {
  return naming == NormNaming::kTransformerEngine && !moe ? "mlp.linear_fc1.layer_norm_weight"
                                                          : "pre_mlp_layernorm.weight";
}

std::string linear_attention_input_norm_name(NormNaming naming) {
  return naming == NormNaming::kTransformerEngine ? "self_attention.in_proj.layer_norm_weight" : "input_layernorm.weight";
}

std::string post_attention_norm_name(const GptModelSpec& spec) {
  // layer_scalar: Gemma 4's alone.
  return spec.layer_scalar && !spec.is_moe() ? "post_self_attn_layernorm.weight"
                                             : "self_attention.linear_proj.post_layernorm.weight";
}

std::string post_mlp_norm_name(const GptModelSpec& spec) {
  return spec.layer_scalar && !spec.is_moe() ? "post_mlp_layernorm.weight" : "mlp.linear_fc2.post_layernorm.weight";
}

NormNaming detect_norm_naming(const std::vector<std::string>& tensor_names) {
  for (const auto& name : tensor_names)
    if (name.ends_with(".self_attention.linear_qkv.layer_norm_weight") ||
        name.ends_with(".self_attention.in_proj.layer_norm_weight") ||  // Gated DeltaNet's
        name.ends_with(".self_attention.linear_kv_up_proj.layer_norm_weight") ||  // multi-latent attention's
        name.ends_with(".mixer.in_proj.layer_norm_weight") ||                     // a Mamba layer's
        name.ends_with(".mlp.linear_fc1.layer_norm_weight"))                      // a dense MLP's
      return NormNaming::kTransformerEngine;
  return NormNaming::kLocal;
}

std::string_view rope_scaling_name(RopeScalingType type) {
  switch (type) {
    case RopeScalingType::kNone:
      return "none";
    case RopeScalingType::kLinear:
      return "linear";
    case RopeScalingType::kLlama3:
      return "llama3";
    case RopeScalingType::kYarn:
      return "yarn";
  }
  return "?";
}

namespace {

using json = nlohmann::json;

// Reads an optional field of `object` into `out`; an error names the field when it has the wrong type.
template <typename T>
Status read_field(const json& object, const char* key, T& out, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return OkStatus();
  const bool ok = std::is_same_v<T, bool> ? it->is_boolean()
                  : std::is_integral_v<T> ? it->is_number_integer()
                                          : it->is_number();
  if (!ok) return Status::Error(where + "." + key + " has the wrong type: " + it->dump());
  out = it->get<T>();
  return OkStatus();
}

Result<RopeScaling> rope_scaling_from_json(const json& rope, const std::string& where) {
  RopeScaling r;
  if (rope.is_null()) return r;
  if (!rope.is_object() || !rope.contains("type") || !rope["type"].is_string())
    return Status::Error(where + " must be an object with a \"type\" (none, linear, llama3)");
  const std::string type = rope["type"].get<std::string>();
  if (type == "none") return r;
  if (type == "linear") r.type = RopeScalingType::kLinear;
  else if (type == "llama3") r.type = RopeScalingType::kLlama3;
  else return Status::Error(where + ".type '" + type + "' is not a RoPE scaling Trestle knows (none, linear, llama3)");
  TRESTLE_RETURN_IF_ERROR(read_field(rope, "factor", r.factor, where));
  TRESTLE_RETURN_IF_ERROR(read_field(rope, "low_freq_factor", r.low_freq_factor, where));
  TRESTLE_RETURN_IF_ERROR(read_field(rope, "high_freq_factor", r.high_freq_factor, where));
  TRESTLE_RETURN_IF_ERROR(
      read_field(rope, "original_max_position_embeddings", r.original_max_position_embeddings, where));
  if (r.factor <= 0 || (r.type == RopeScalingType::kLlama3 && r.high_freq_factor <= r.low_freq_factor))
    return Status::Error(where + ": factor must be positive and high_freq_factor above low_freq_factor");
  return r;
}

// Which layers of a mixed_attention model have the window: Megatron's window_attn_skip_freq, an integer N (layer i,
// counting from 1, is full when N divides it) or one 0/1 per layer (1: windowed). Empty without mixed attention.
Result<std::vector<bool>> window_layers_from_json(const json& m, const GptModelSpec& s, const std::string& where) {
  std::vector<bool> layers;
  if (!s.mixed_attention) return layers;
  const auto it = m.find("window_attn_skip_freq");
  if (it == m.end() || it->is_null())
    return Status::Error(where + ": mixed_attention needs window_attn_skip_freq (which layers have the window)");
  if (it->is_number_integer() && it->get<std::int64_t>() > 0) {
    const std::int64_t every = it->get<std::int64_t>();
    for (std::int64_t i = 1; i <= s.num_layers; ++i) layers.push_back(i % every != 0);
    return layers;
  }
  if (it->is_array() && static_cast<std::int64_t>(it->size()) == s.num_layers) {
    for (const auto& v : *it) {
      if (!v.is_number_integer() || (v.get<std::int64_t>() != 0 && v.get<std::int64_t>() != 1))
        return Status::Error(where + ".window_attn_skip_freq holds " + v.dump() + " (0 or 1 per layer)");
      layers.push_back(v.get<std::int64_t>() == 1);
    }
    return layers;
  }
  return Status::Error(where + ".window_attn_skip_freq must be a positive integer or one 0/1 per layer (" +
                       std::to_string(s.num_layers) + "): " + it->dump().substr(0, 120));
}

// YaRN under Megatron-Core's names: GPT-OSS's position_embedding_type "yarn" with yarn_* fields, or multi-latent
// attention's rope_type "yarn" with rotary_scaling_factor, mscale, mscale_all_dim, beta_fast, beta_slow and
// original_max_position_embeddings. Untouched when the model has neither.
Status read_yarn(const json& m, RopeScaling& r, const std::string& where) {
  const bool gpt_oss = m.value("position_embedding_type", std::string()) == "yarn";
  const bool mla = m.value("rope_type", std::string()) == "yarn";
  if (!gpt_oss && !mla) return OkStatus();
  r = RopeScaling{};
  r.type = RopeScalingType::kYarn;
  r.original_max_position_embeddings = 4096;
  double original = 4096;
  const char* prefix = gpt_oss ? "yarn_" : "";
  const std::string factor = gpt_oss ? "yarn_rotary_scaling_factor" : "rotary_scaling_factor";
  TRESTLE_RETURN_IF_ERROR(read_field(m, factor.c_str(), r.factor, where));
  TRESTLE_RETURN_IF_ERROR(
      read_field(m, (std::string(prefix) + "original_max_position_embeddings").c_str(), original, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, (std::string(prefix) + "beta_fast").c_str(), r.beta_fast, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, (std::string(prefix) + "beta_slow").c_str(), r.beta_slow, where));
  if (gpt_oss) {
    TRESTLE_RETURN_IF_ERROR(read_field(m, "yarn_correction_range_round_to_int", r.truncate, where));
  } else {
    TRESTLE_RETURN_IF_ERROR(read_field(m, "mscale", r.mscale, where));
    TRESTLE_RETURN_IF_ERROR(read_field(m, "mscale_all_dim", r.mscale_all_dim, where));
  }
  r.original_max_position_embeddings = static_cast<std::int64_t>(original);
  if (r.factor <= 0 || original < 1 || r.beta_fast <= 0 || r.beta_slow <= 0 || r.mscale < 0 || r.mscale_all_dim < 0)
    return Status::Error(where +
                         ": YaRN needs a positive factor, original_max_position_embeddings, beta_fast and "
                         "beta_slow (and mscale, mscale_all_dim not negative)");
  return OkStatus();
}

// Gated DeltaNet layers (Megatron's experimental_attention_variant "gated_delta_net"): linear_attention_freq N makes
// layer i (counting from 1) a full-attention one when N divides it, a list gives 1 for each Gated DeltaNet layer; and
// the linear_* sizes. Untouched without the variant.
Status read_linear_attention(const json& m, GptModelSpec& s, const std::string& where) {
  const auto variant = m.find("experimental_attention_variant");
  if (variant == m.end() || variant->is_null()) return OkStatus();
  if (*variant != "gated_delta_net")
    return Status::Error(where + ".experimental_attention_variant " + variant->dump() + " (gated_delta_net)");
  const auto freq = m.find("linear_attention_freq");
  if (freq != m.end() && freq->is_number_integer() && freq->get<std::int64_t>() > 0) {
    for (std::int64_t i = 1; i <= s.num_layers; ++i) s.linear_attention_layers.push_back(i % freq->get<std::int64_t>() != 0);
  } else if (freq != m.end() && freq->is_array() && static_cast<std::int64_t>(freq->size()) == s.num_layers) {
    for (const auto& v : *freq) {
      if (!v.is_number_integer() || (v.get<std::int64_t>() != 0 && v.get<std::int64_t>() != 1))
        return Status::Error(where + ".linear_attention_freq holds " + v.dump() + " (0 or 1 per layer)");
      s.linear_attention_layers.push_back(v.get<std::int64_t>() == 1);
    }
  } else {
    return Status::Error(where + ".linear_attention_freq must be a positive integer or one 0/1 per layer (" +
                         std::to_string(s.num_layers) + "): " + (freq == m.end() ? "absent" : freq->dump().substr(0, 120)));
  }
  for (auto [key, field] : {std::pair{"linear_conv_kernel_dim", &s.linear_conv_kernel_dim},
                            {"linear_key_head_dim", &s.linear_key_head_dim},
                            {"linear_value_head_dim", &s.linear_value_head_dim},
                            {"linear_num_key_heads", &s.linear_num_key_heads},
                            {"linear_num_value_heads", &s.linear_num_value_heads}}) {
    if (!m.contains(key)) return Status::Error(where + ": gated_delta_net needs " + key);
    TRESTLE_RETURN_IF_ERROR(read_field(m, key, *field, where));
  }
  return read_field(m, "linear_in_proj_split", s.linear_in_proj_split, where);
}

// carried_tensors: [{"name": "vision_model.blocks.0.attn.qkv.weight", "shape": [48, 16]}, ...] (none when absent).
Status read_carried_tensors(const json& m, GptModelSpec& s, const std::string& where) {
  const auto list = m.find("carried_tensors");
  if (list == m.end() || list->is_null()) return OkStatus();
  constexpr std::size_t kMostCarried = 100'000;
  if (!list->is_array() || list->size() > kMostCarried)
    return Status::Error(where + ".carried_tensors must be a list of at most " + std::to_string(kMostCarried) +
                         " {name, shape} objects");
  for (const json& t : *list) {
    const auto name = t.is_object() ? t.find("name") : t.end();
    const auto shape = t.is_object() ? t.find("shape") : t.end();
    if (!t.is_object() || name == t.end() || !name->is_string() || shape == t.end() || !shape->is_array() ||
        shape->size() > 8)
      return Status::Error(where + ".carried_tensors holds " + t.dump().substr(0, 200) +
                           ", not a {name, shape} object with a shape of at most 8 dims");
    GptModelSpec::CarriedTensor c{name->get<std::string>(), {}};
    for (const json& d : *shape) {
      if (!d.is_number_integer() || d.get<std::int64_t>() <= 0)
        return Status::Error(where + ".carried_tensors: " + c.name + "'s shape " + shape->dump() +
                             " is not of positive integers");
      c.shape.push_back(d.get<std::int64_t>());
    }
    s.carried_tensors.push_back(std::move(c));
  }
  return OkStatus();
}

// Nemotron-H (Megatron-Core's MambaModel): hybrid_override_pattern, one of M, * and - per layer, and the mamba_*
// sizes. Untouched without the pattern.
Status read_hybrid(const json& m, GptModelSpec& s, const std::string& where) {
  const auto pattern = m.find("hybrid_override_pattern");
  if (pattern == m.end() || pattern->is_null()) return OkStatus();
  if (!pattern->is_string() || static_cast<std::int64_t>(pattern->get<std::string>().size()) != s.num_layers)
    return Status::Error(where + ".hybrid_override_pattern must be a string of one M, *, - or E per layer (" +
                         std::to_string(s.num_layers) + "): " + pattern->dump().substr(0, 120));
  s.hybrid_layers = pattern->get<std::string>();
  for (const char kind : s.hybrid_layers)
    if (kind != 'M' && kind != '*' && kind != '-' && kind != 'E')
      return Status::Error(where + ".hybrid_override_pattern holds '" + std::string(1, kind) +
                           "' (M: Mamba, *: attention, -: MLP, E: mixture of experts)");
  for (auto [key, field] : {std::pair{"mamba_num_heads", &s.mamba_num_heads},
                            {"mamba_head_dim", &s.mamba_head_dim},
                            {"mamba_state_dim", &s.mamba_state_dim},
                            {"mamba_num_groups", &s.mamba_num_groups}}) {
    if (!m.contains(key)) return Status::Error(where + ": a hybrid model needs " + key);
    TRESTLE_RETURN_IF_ERROR(read_field(m, key, *field, where));
  }
  TRESTLE_RETURN_IF_ERROR(read_field(m, "mamba_conv_kernel", s.mamba_conv_kernel, where));
  return read_field(m, "moe_latent_size", s.moe_latent_size, where);
}

// Gemma 4's per-layer attention sizes, K = V, KV sharing, layer scalars, per-layer inputs and MoE beside the MLP.
Status read_heterogeneous_layers(const json& m, GptModelSpec& s, const std::string& where) {
  for (auto [key, field] : {std::pair{"layer_kv_channels", &s.layer_kv_channels},
                            {"layer_query_groups", &s.layer_query_groups}}) {
    const auto list = m.find(key);
    if (list == m.end() || list->is_null()) continue;
    if (!list->is_array() || static_cast<std::int64_t>(list->size()) != s.num_layers)
      return Status::Error(where + "." + key + " must list one positive integer per layer (" +
                           std::to_string(s.num_layers) + "): " + list->dump().substr(0, 120));
    for (const json& v : *list) {
      if (!v.is_number_integer() || v.get<std::int64_t>() <= 0 || v.get<std::int64_t>() > (std::int64_t{1} << 20))
        return Status::Error(where + "." + key + " holds " + v.dump() + ", not a positive integer (at most 2^20)");
      field->push_back(v.get<std::int64_t>());
    }
  }
  TRESTLE_RETURN_IF_ERROR(read_field(m, "attention_k_eq_v", s.attention_k_eq_v, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "kv_shared_layers", s.kv_shared_layers, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "double_wide_mlp", s.double_wide_mlp, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "layer_scalar", s.layer_scalar, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "per_layer_input_size", s.per_layer_input_size, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "per_layer_vocab_size", s.per_layer_vocab_size, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_beside_mlp", s.moe_beside_mlp, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "softmax_scale", s.softmax_scale, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "value_norm", s.value_norm, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "global_rope_fraction", s.global_rope_fraction, where));
  if (!(s.softmax_scale >= 0) || !(s.global_rope_fraction >= 0 && s.global_rope_fraction <= 1))
    return Status::Error(where + ": softmax_scale must not be negative and global_rope_fraction must be in [0, 1]");
  return OkStatus();
}

}  // namespace

Result<GptModelSpec> gpt_spec_from_json(const json& model, const std::string& source) {
  if (!model.is_object() || !model.contains("megatron") || !model["megatron"].is_object())
    return Status::Error(source + ": the model has no \"megatron\" block with the model's sizes");
  const json& m = model["megatron"];
  const std::string where = source + " (model.megatron)";
  GptModelSpec s;
  for (auto [key, field] : {std::pair{"num_layers", &s.num_layers},
                            {"hidden_size", &s.hidden_size},
                            {"ffn_hidden_size", &s.ffn_hidden_size},
                            {"num_attention_heads", &s.num_attention_heads},
                            {"vocab_size", &s.vocab_size}}) {
    if (!m.contains(key)) return Status::Error(where + " has no " + key);
    TRESTLE_RETURN_IF_ERROR(read_field(m, key, *field, where));
  }
  s.num_query_groups = s.num_attention_heads;
  TRESTLE_RETURN_IF_ERROR(read_field(m, "num_query_groups", s.num_query_groups, where));
  if (s.num_attention_heads > 0) s.kv_channels = s.hidden_size / s.num_attention_heads;
  TRESTLE_RETURN_IF_ERROR(read_field(m, "kv_channels", s.kv_channels, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "num_experts", s.num_experts, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_shared_expert_intermediate_size", s.shared_expert_ffn_hidden_size, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_shared_expert_gate", s.shared_expert_gate, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_router_topk", s.moe_router_topk, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_router_pre_softmax", s.moe_router_pre_softmax, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "add_qkv_bias", s.add_qkv_bias, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "qk_layernorm", s.qk_layernorm, where));
  bool untied = true;
  TRESTLE_RETURN_IF_ERROR(read_field(m, "untie_embeddings_and_output_weights", untied, where));
  s.tied_embeddings = !untied;
  TRESTLE_RETURN_IF_ERROR(read_field(m, "norm_epsilon", s.norm_epsilon, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "rotary_base", s.rotary_base, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "rotary_percent", s.rotary_percent, where));
  if (!(s.rotary_percent > 0 && s.rotary_percent <= 1))
    return Status::Error(where + ".rotary_percent " + std::to_string(s.rotary_percent) + " is not in (0, 1]");
  if (m.contains("rope_scaling")) {
    TRESTLE_ASSIGN_OR_RETURN(s.rope_scaling, rope_scaling_from_json(m["rope_scaling"], where + ".rope_scaling"));
  }
  if (const auto w = m.find("window_size"); w != m.end() && !w->is_null()) {
    // Megatron's (left, right) window (Transformer Engine / flash-attention: keys [i - left, i + right]); the model is
    // causal, so a query sees left + 1 positions.
    if (!w->is_array() || w->empty() || !(*w)[0].is_number_integer() || (*w)[0].get<std::int64_t>() < 0)
      return Status::Error(where + ".window_size must be [left, right] with left >= 0: " + w->dump());
    s.window_size = (*w)[0].get<std::int64_t>() + 1;
  }
  TRESTLE_RETURN_IF_ERROR(read_yarn(m, s.rope_scaling, where));
  if (m.contains("activation") && m["activation"] != "swiglu" && m["activation"] != "geglu_tanh" &&
      m["activation"] != "quick_geglu" && m["activation"] != "squared_relu")
    return Status::Error(where + ".activation " + m["activation"].dump() +
                         " (swiglu, geglu_tanh, quick_geglu or squared_relu)");
  s.geglu = m.value("activation", std::string("swiglu")) == "geglu_tanh";
  s.quick_geglu = m.value("activation", std::string("swiglu")) == "quick_geglu";
  s.squared_relu = m.value("activation", std::string("swiglu")) == "squared_relu";
  TRESTLE_RETURN_IF_ERROR(read_field(m, "activation_func_clamp_value", s.activation_clamp, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "glu_linear_offset", s.glu_linear_offset, where));
  if (s.activation_clamp < 0) return Status::Error(where + ".activation_func_clamp_value must not be negative");
  TRESTLE_RETURN_IF_ERROR(read_field(m, "layernorm_zero_centered_gamma", s.zero_centered_norms, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "post_layernorms", s.post_norms, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "attn_logit_softcapping", s.attn_logit_softcapping, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "final_logit_softcapping", s.final_logit_softcapping, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "mixed_attention", s.mixed_attention, where));
  TRESTLE_ASSIGN_OR_RETURN(s.window_layers, window_layers_from_json(m, s, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "query_pre_attn_scalar", s.query_pre_attn_scalar, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "scale_embeddings", s.scale_embeddings, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "rope_local_base_freq", s.rotary_base_local, where));
  if (s.query_pre_attn_scalar < 0 || s.rotary_base_local < 0)
    return Status::Error(where + ": query_pre_attn_scalar and rope_local_base_freq must not be negative");
  TRESTLE_RETURN_IF_ERROR(read_field(m, "pre_layernorms", s.pre_norms, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "qk_layernorm_full_projection", s.qk_norm_full_projection, where));
  bool mla = false;
  TRESTLE_RETURN_IF_ERROR(read_field(m, "multi_latent_attention", mla, where));
  if (mla) {
    for (auto [key, field] : {std::pair{"q_lora_rank", &s.q_lora_rank},
                              {"kv_lora_rank", &s.kv_lora_rank},
                              {"qk_head_dim", &s.qk_head_dim},
                              {"qk_pos_emb_head_dim", &s.qk_pos_emb_head_dim},
                              {"v_head_dim", &s.v_head_dim}})
      TRESTLE_RETURN_IF_ERROR(read_field(m, key, *field, where));
    if (s.kv_lora_rank <= 0) return Status::Error(where + ": multi-latent attention needs a positive kv_lora_rank");
  }
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_first_dense_layers", s.moe_first_dense_layers, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "dense_ffn_hidden_size", s.dense_ffn_hidden_size, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_router_enable_expert_bias", s.moe_router_expert_bias, where));
  if (const auto f = m.find("moe_router_score_function"); f != m.end() && !f->is_null()) {
    if (*f != "softmax" && *f != "sigmoid")
      return Status::Error(where + ".moe_router_score_function " + f->dump() + " (softmax or sigmoid)");
    s.moe_router_score_function = f->get<std::string>();
  }
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_router_num_groups", s.moe_router_num_groups, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_router_group_topk", s.moe_router_group_topk, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "moe_router_topk_scaling_factor", s.moe_router_topk_scaling_factor, where));
  if (s.moe_router_num_groups < 0 || s.moe_router_group_topk < 0 || s.moe_router_topk_scaling_factor < 0)
    return Status::Error(where +
                         ": moe_router_num_groups, moe_router_group_topk and moe_router_topk_scaling_factor "
                         "must not be negative");
  if (s.moe_router_num_groups <= 1) s.moe_router_num_groups = s.moe_router_group_topk = 0;  // one group: not limited
  if (s.moe_router_num_groups > 0 &&
      (s.moe_router_group_topk < 1 || s.moe_router_group_topk > s.moe_router_num_groups ||
       s.num_experts % s.moe_router_num_groups != 0))
    return Status::Error(where +
                         ": moe_router_num_groups must divide the experts, with moe_router_group_topk "
                         "between 1 and it");
  TRESTLE_RETURN_IF_ERROR(read_field(m, "mtp_num_layers", s.mtp_num_layers, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "add_bias_linear", s.add_bias_linear, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "attention_output_gate", s.attention_output_gate, where));
  TRESTLE_RETURN_IF_ERROR(read_linear_attention(m, s, where));
  TRESTLE_RETURN_IF_ERROR(read_hybrid(m, s, where));
  TRESTLE_RETURN_IF_ERROR(read_carried_tensors(m, s, where));
  TRESTLE_RETURN_IF_ERROR(read_heterogeneous_layers(m, s, where));
  if (const auto t = m.find("softmax_type"); t != m.end() && !t->is_null()) {
    if (*t != "vanilla" && *t != "learnable")
      return Status::Error(where + ".softmax_type " + t->dump() + " (vanilla or learnable)");
    s.softmax_offset = *t == "learnable";
  }
  if (model.contains("parallel") && model["parallel"].is_object() && model["parallel"].contains("norm_naming")) {
    const auto& naming = model["parallel"]["norm_naming"];
    if (naming != "local" && naming != "transformer_engine")
      return Status::Error(source + ": model.parallel.norm_naming is " + naming.dump() +
                           ", not \"transformer_engine\" or \"local\"");
    if (naming == "local") s.norms = NormNaming::kLocal;
  }
  TRESTLE_RETURN_IF_ERROR(canonical_tensors(s).status().with_context(source));
  return s;
}

namespace {

// One decoder layer's tensors (named after `prefix`), each passed to `add`.
template <typename Add>
void add_layer_tensors(const GptModelSpec& s, std::int64_t layer, bool moe, bool linear_attention, Add&& add) {
  const std::int64_t h = s.hidden_size, d = s.layer_kv_channels_of(layer), groups = s.layer_query_groups_of(layer);
  const std::int64_t query_rows = s.num_attention_heads * d,
                     qkv_rows = query_rows * (s.attention_output_gate ? 2 : 1) +
                                (s.layer_k_eq_v(layer) ? 1 : 2) * groups * d;
  if (linear_attention) {
    // Gated DeltaNet: in_proj and conv1d as Megatron-Core saves them, split into their parts.
    const std::int64_t keys = s.linear_num_key_heads * s.linear_key_head_dim,
                       values = s.linear_num_value_heads * s.linear_value_head_dim, k = s.linear_conv_kernel_dim;
    add(linear_attention_input_norm_name(s.norms), Shape{h}, TpSplit::kReplicated);
    for (const auto& [part, rows] : {std::pair{"query", keys}, {"key", keys}, {"value", values}, {"z", values},
                                     {"beta", s.linear_num_value_heads}, {"alpha", s.linear_num_value_heads}})
      add(std::string("self_attention.in_proj.weight.") + part, Shape{rows, h}, TpSplit::kColumn);
    for (const auto& [part, rows] : {std::pair{"query", keys}, {"key", keys}, {"value", values}})
      add(std::string("self_attention.conv1d.weight.") + part, Shape{rows, 1, k}, TpSplit::kColumn);
    add("self_attention.dt_bias", Shape{s.linear_num_value_heads}, TpSplit::kColumn);
    add("self_attention.A_log", Shape{s.linear_num_value_heads}, TpSplit::kColumn);
    add("self_attention.out_norm.weight", Shape{s.linear_value_head_dim}, TpSplit::kReplicated);
    add("self_attention.out_proj.weight", Shape{h, values}, TpSplit::kRow);
  } else if (s.multi_latent_attention()) {
    // Transformer Engine's spec keeps the input norm a module of its own here and fuses the q / kv norms into the up
    // projections; its down projections are replicated ('duplicated'), the local spec's column-parallel.
    const bool te = s.norms == NormNaming::kTransformerEngine;
    const TpSplit down = te ? TpSplit::kReplicated : TpSplit::kColumn;
    const std::int64_t heads = s.num_attention_heads, qk = s.qk_head_dim + s.qk_pos_emb_head_dim;
    add("input_layernorm.weight", Shape{h}, TpSplit::kReplicated);
    if (s.q_lora_rank > 0) {
      add("self_attention.linear_q_down_proj.weight", Shape{s.q_lora_rank, h}, down);
      add(te ? "self_attention.linear_q_up_proj.layer_norm_weight" : "self_attention.q_layernorm.weight",
          Shape{s.q_lora_rank}, TpSplit::kReplicated);
      add("self_attention.linear_q_up_proj.weight", Shape{heads * qk, s.q_lora_rank}, TpSplit::kColumn);
    } else {
      add("self_attention.linear_q_proj.weight", Shape{heads * qk, h}, TpSplit::kColumn);
    }
    add("self_attention.linear_kv_down_proj.weight", Shape{s.kv_lora_rank + s.qk_pos_emb_head_dim, h}, down);
    add(te ? "self_attention.linear_kv_up_proj.layer_norm_weight" : "self_attention.kv_layernorm.weight",
        Shape{s.kv_lora_rank}, TpSplit::kReplicated);
    add("self_attention.linear_kv_up_proj.weight", Shape{heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank},
        TpSplit::kColumn);
    add("self_attention.linear_proj.weight", Shape{h, heads * s.v_head_dim}, TpSplit::kRow);
  } else if (s.layer_kv_shared(layer)) {
    // Gemma 4's KV-sharing layers: queries alone (the keys and values are an earlier layer's).
    add("input_layernorm.weight", Shape{h}, TpSplit::kReplicated);
    add("self_attention.linear_q_proj.weight", Shape{query_rows, h}, TpSplit::kColumn);
    add("self_attention.q_layernorm.weight", Shape{d}, TpSplit::kReplicated);
    add("self_attention.linear_proj.weight", Shape{h, query_rows}, TpSplit::kRow);
  } else {
    if (s.pre_norms) add(input_norm_name(s.norms), Shape{h}, TpSplit::kReplicated);
    add("self_attention.linear_qkv.weight", Shape{qkv_rows, h}, TpSplit::kColumn);
    if (s.add_qkv_bias) add("self_attention.linear_qkv.bias", Shape{qkv_rows}, TpSplit::kColumn);
    if (s.softmax_offset)
      add("self_attention.core_attention.softmax_offset", Shape{s.num_attention_heads}, TpSplit::kColumn);
    if (s.qk_layernorm) {
      const bool full = s.qk_norm_full_projection;
      add("self_attention.q_layernorm.weight", Shape{full ? query_rows : d}, TpSplit::kReplicated);
      add("self_attention.k_layernorm.weight", Shape{full ? groups * d : d}, TpSplit::kReplicated);
    }
    add("self_attention.linear_proj.weight", Shape{h, query_rows}, TpSplit::kRow);
    if (s.add_bias_linear) add("self_attention.linear_proj.bias", Shape{h}, TpSplit::kReplicated);
  }
  if (s.post_norms) add(post_attention_norm_name(s), Shape{h}, TpSplit::kReplicated);
  if (s.pre_norms) add(pre_mlp_norm_name(s.norms, moe), Shape{h}, TpSplit::kReplicated);
  // Gemma 4: the per-layer input's gate, projection and norm, and the layer's output scalar.
  auto add_layer_extras = [&] {
    if (s.per_layer_input_size > 0) {
      add("per_layer_input_gate.weight", Shape{s.per_layer_input_size, h}, TpSplit::kReplicated);
      add("per_layer_projection.weight", Shape{h, s.per_layer_input_size}, TpSplit::kReplicated);
      add("post_per_layer_input_norm.weight", Shape{h}, TpSplit::kReplicated);
    }
    if (s.layer_scalar) add("layer_scalar", Shape{1}, TpSplit::kReplicated);
  };
  const std::int64_t wide = s.double_wide_mlp && s.layer_kv_shared(layer) ? 2 : 1;
  if (!moe) {
    const std::int64_t f = wide * (s.is_moe() ? s.dense_ffn_hidden_size : s.ffn_hidden_size);
    add("mlp.linear_fc1.weight", Shape{2 * f, h}, TpSplit::kGatedColumn);
    if (s.add_bias_linear) add("mlp.linear_fc1.bias", Shape{2 * f}, TpSplit::kGatedColumn);
    add("mlp.linear_fc2.weight", Shape{h, f}, TpSplit::kRow);
    if (s.add_bias_linear) add("mlp.linear_fc2.bias", Shape{h}, TpSplit::kReplicated);
    if (s.post_norms) add(post_mlp_norm_name(s), Shape{h}, TpSplit::kReplicated);
    add_layer_extras();
    return;
  }
  const std::int64_t f = s.ffn_hidden_size;
  add("mlp.router.weight", Shape{s.num_experts, h}, TpSplit::kReplicated);
  if (s.add_bias_linear) add("mlp.router.bias", Shape{s.num_experts}, TpSplit::kReplicated);
  if (s.moe_router_expert_bias) add("mlp.router.expert_bias", Shape{s.num_experts}, TpSplit::kReplicated);
  if (s.moe_beside_mlp) {
    add("mlp.router.scale", Shape{h}, TpSplit::kReplicated);
    add("mlp.router.per_expert_scale", Shape{s.num_experts}, TpSplit::kReplicated);
  }
  for (std::int64_t e = 0; e < s.num_experts; ++e) {
    const std::string x = "mlp.experts.local_experts." + std::to_string(e) + ".";
    add(x + "linear_fc1.weight", Shape{2 * f, h}, TpSplit::kGatedColumn, e);
    if (s.add_bias_linear) add(x + "linear_fc1.bias", Shape{2 * f}, TpSplit::kGatedColumn, e);
    add(x + "linear_fc2.weight", Shape{h, f}, TpSplit::kRow, e);
    if (s.add_bias_linear) add(x + "linear_fc2.bias", Shape{h}, TpSplit::kReplicated, e);
  }
  if (s.shared_expert_ffn_hidden_size > 0) {
    const std::int64_t fs = wide * s.shared_expert_ffn_hidden_size;
    if (s.moe_beside_mlp) add("pre_shared_expert_layernorm.weight", Shape{h}, TpSplit::kReplicated);
    add("mlp.shared_experts.linear_fc1.weight", Shape{2 * fs, h}, TpSplit::kGatedColumn);
    if (s.add_bias_linear) add("mlp.shared_experts.linear_fc1.bias", Shape{2 * fs}, TpSplit::kGatedColumn);
    add("mlp.shared_experts.linear_fc2.weight", Shape{h, fs}, TpSplit::kRow);
    if (s.add_bias_linear) add("mlp.shared_experts.linear_fc2.bias", Shape{h}, TpSplit::kReplicated);
    if (s.shared_expert_gate) add("mlp.shared_experts.gate_weight", Shape{1, h}, TpSplit::kReplicated);
    if (s.moe_beside_mlp && s.post_norms)
      add("mlp.post_shared_expert_layernorm.weight", Shape{h}, TpSplit::kReplicated);
  }
  if (s.moe_beside_mlp) {
    add("mlp.post_moe_layernorm.weight", Shape{h}, TpSplit::kReplicated);
    add("post_ffn_layernorm.weight", Shape{h}, TpSplit::kReplicated);
  }
  add_layer_extras();
}

// One Nemotron-H layer's tensors: its norm (fused into the mixer's first linear under Transformer Engine's spec) and
// its one mixer.
template <typename Add>
void add_hybrid_layer_tensors(const GptModelSpec& s, char kind, Add&& add) {
  const std::int64_t h = s.hidden_size, d = s.kv_channels;
  const bool te = s.norms == NormNaming::kTransformerEngine;
  if (kind == 'M') {
    const std::int64_t inner = s.mamba_num_heads * s.mamba_head_dim, groups = s.mamba_num_groups * s.mamba_state_dim,
                       heads = s.mamba_num_heads, k = s.mamba_conv_kernel;
    add(te ? "mixer.in_proj.layer_norm_weight" : "norm.weight", Shape{h}, TpSplit::kReplicated);
    for (const auto& [part, rows] : {std::pair{"z", inner}, {"x", inner}, {"B", groups}, {"C", groups}, {"dt", heads}})
      add(std::string("mixer.in_proj.weight.") + part, Shape{rows, h}, TpSplit::kColumn);
    for (const auto& [part, rows] : {std::pair{"x", inner}, {"B", groups}, {"C", groups}}) {
      add(std::string("mixer.conv1d.weight.") + part, Shape{rows, 1, k}, TpSplit::kColumn);
      add(std::string("mixer.conv1d.bias.") + part, Shape{rows}, TpSplit::kColumn);
    }
    add("mixer.A_log", Shape{heads}, TpSplit::kColumn);
    add("mixer.D", Shape{heads}, TpSplit::kColumn);
    add("mixer.dt_bias", Shape{heads}, TpSplit::kColumn);
    add("mixer.norm.weight", Shape{inner}, TpSplit::kColumn);
    add("mixer.out_proj.weight", Shape{h, inner}, TpSplit::kRow);
  } else if (kind == '*') {
    const std::int64_t query_rows = s.num_attention_heads * d;
    add(input_norm_name(s.norms), Shape{h}, TpSplit::kReplicated);
    add("self_attention.linear_qkv.weight", Shape{query_rows + 2 * s.num_query_groups * d, h}, TpSplit::kColumn);
    add("self_attention.linear_proj.weight", Shape{h, query_rows}, TpSplit::kRow);
  } else if (kind == '-') {
    const std::int64_t f = s.is_moe() ? s.dense_ffn_hidden_size : s.ffn_hidden_size;
    add(pre_mlp_norm_name(s.norms, false), Shape{h}, TpSplit::kReplicated);
    add("mlp.linear_fc1.weight", Shape{f, h}, TpSplit::kColumn);
    add("mlp.linear_fc2.weight", Shape{h, f}, TpSplit::kRow);
  } else {  // 'E': the router with its expert bias, experts of squared ReLU (in the latent space), shared experts
    const std::int64_t f = s.ffn_hidden_size, width = s.moe_latent_size > 0 ? s.moe_latent_size : h;
    add(pre_mlp_norm_name(s.norms, true), Shape{h}, TpSplit::kReplicated);
    add("mlp.router.weight", Shape{s.num_experts, h}, TpSplit::kReplicated);
    if (s.moe_router_expert_bias) add("mlp.router.expert_bias", Shape{s.num_experts}, TpSplit::kReplicated);
    for (std::int64_t e = 0; e < s.num_experts; ++e) {
      const std::string x = "mlp.experts.local_experts." + std::to_string(e) + ".";
      add(x + "linear_fc1.weight", Shape{f, width}, TpSplit::kColumn, e);
      add(x + "linear_fc2.weight", Shape{width, f}, TpSplit::kRow, e);
    }
    if (s.shared_expert_ffn_hidden_size > 0) {
      add("mlp.shared_experts.linear_fc1.weight", Shape{s.shared_expert_ffn_hidden_size, h}, TpSplit::kColumn);
      add("mlp.shared_experts.linear_fc2.weight", Shape{h, s.shared_expert_ffn_hidden_size}, TpSplit::kRow);
    }
    if (s.moe_latent_size > 0) {
      add("mlp.fc1_latent_proj.weight", Shape{s.moe_latent_size, h}, TpSplit::kReplicated);
      add("mlp.fc2_latent_proj.weight", Shape{h, s.moe_latent_size}, TpSplit::kReplicated);
    }
  }
}

}  // namespace

Result<std::vector<CanonicalTensor>> canonical_tensors(const GptModelSpec& s) {
  if (s.num_layers <= 0 || s.hidden_size <= 0 || s.ffn_hidden_size <= 0 || s.num_attention_heads <= 0 ||
      s.num_query_groups <= 0 || s.kv_channels <= 0 || s.vocab_size <= 0 || s.num_experts < 0 ||
      s.shared_expert_ffn_hidden_size < 0 || s.mtp_num_layers < 0)
    return Status::Error(
        "model sizes must be positive (num_layers, hidden_size, ffn_hidden_size, num_attention_heads, "
        "num_query_groups, kv_channels, vocab_size)");
  // The widths are bounded before any shape multiplies them (a head size of 2^62 + 16 times 4 heads wrapped to 64).
  for (const auto& [name, width] : {std::pair{"hidden_size", s.hidden_size},
                                    {"ffn_hidden_size", s.ffn_hidden_size},
                                    {"kv_channels", s.kv_channels},
                                    {"shared_expert_ffn_hidden_size", s.shared_expert_ffn_hidden_size},
                                    {"dense_ffn_hidden_size", s.dense_ffn_hidden_size},
                                    {"q_lora_rank", s.q_lora_rank},
                                    {"kv_lora_rank", s.kv_lora_rank},
                                    {"qk_head_dim", s.qk_head_dim},
                                    {"qk_pos_emb_head_dim", s.qk_pos_emb_head_dim},
                                    {"v_head_dim", s.v_head_dim},
                                    {"linear_key_head_dim", s.linear_key_head_dim},
                                    {"linear_value_head_dim", s.linear_value_head_dim},
                                    {"mamba_head_dim", s.mamba_head_dim},
                                    {"mamba_state_dim", s.mamba_state_dim},
                                    {"moe_latent_size", s.moe_latent_size},
                                    {"per_layer_input_size", s.per_layer_input_size}})
    if (width > kMaxModelWidth)
      return Status::Error(std::string(name) + " " + std::to_string(width) + " is more than Trestle holds (at most " +
                           std::to_string(kMaxModelWidth) + ")");
  for (const std::int64_t width : s.layer_kv_channels)
    if (width > kMaxModelWidth)
      return Status::Error("a layer's kv_channels " + std::to_string(width) + " is more than Trestle holds (at most " +
                           std::to_string(kMaxModelWidth) + ")");
  for (const auto& [name, rows] :
       {std::pair{"vocab_size", s.vocab_size}, {"per_layer_vocab_size", s.per_layer_vocab_size}})
    if (rows > kMaxVocabSize)
      return Status::Error(std::string(name) + " " + std::to_string(rows) + " is more than Trestle holds (at most " +
                           std::to_string(kMaxVocabSize) + ")");
  if (s.num_attention_heads % s.num_query_groups != 0)
    return Status::Error("num_attention_heads (" + std::to_string(s.num_attention_heads) +
                         ") is not a multiple of num_query_groups (" + std::to_string(s.num_query_groups) + ")");
  if (s.multi_latent_attention() &&
      (s.q_lora_rank < 0 || s.qk_head_dim <= 0 || s.qk_pos_emb_head_dim <= 0 || s.v_head_dim <= 0))
    return Status::Error(
        "multi-latent attention needs positive qk_head_dim, qk_pos_emb_head_dim and v_head_dim (and q_lora_rank >= 0)");
  // A description comes from a file: its counts are checked before the tensors are listed one by one (a Mixtral with a
  // billion experts would list four billion).
  constexpr std::int64_t kMostLayers = 100'000, kMostExperts = 100'000, kMostExpertTensors = 10'000'000;
  if (s.num_layers > kMostLayers || s.mtp_num_layers > kMostLayers || s.num_experts > kMostExperts ||
      (s.num_layers + s.mtp_num_layers) * s.num_experts > kMostExpertTensors)
    return Status::Error("the model describes " + std::to_string(s.num_layers) + " layers (+ " +
                         std::to_string(s.mtp_num_layers) + " multi-token-prediction) of " +
                         std::to_string(s.num_experts) + " experts: more than Trestle lists (at most " +
                         std::to_string(kMostLayers) + " layers, " + std::to_string(kMostExperts) + " experts, " +
                         std::to_string(kMostExpertTensors) + " layer x expert pairs)");
  // The converters list each layer's attention by query group (its heads' rows, then its key's and value's): the heads'
  // counts are bounded the same way, before any such list.
  constexpr std::int64_t kMostHeads = 100'000;
  const std::int64_t heads =
      std::max({s.num_attention_heads, s.num_query_groups, s.linear_num_key_heads, s.linear_num_value_heads});
  if (heads > kMostHeads || (s.num_layers + s.mtp_num_layers) * heads > kMostExpertTensors)
    return Status::Error("the model describes " + std::to_string(s.num_layers) + " layers (+ " +
                         std::to_string(s.mtp_num_layers) + " multi-token-prediction) of " + std::to_string(heads) +
                         " attention heads: more than Trestle lists (at most " + std::to_string(kMostHeads) +
                         " heads, " + std::to_string(kMostExpertTensors) + " layer x head pairs)");
  if (s.moe_first_dense_layers < 0 || s.moe_first_dense_layers > s.num_layers ||
      (s.moe_first_dense_layers > 0 && (!s.is_moe() || s.dense_ffn_hidden_size <= 0)))
    return Status::Error("moe_first_dense_layers (" + std::to_string(s.moe_first_dense_layers) +
                         ") must be between 0 and num_layers, in an MoE model with a positive dense_ffn_hidden_size");
  if (!s.linear_attention_layers.empty() &&
      (static_cast<std::int64_t>(s.linear_attention_layers.size()) != s.num_layers || s.linear_conv_kernel_dim <= 0 ||
       s.linear_key_head_dim <= 0 || s.linear_value_head_dim <= 0 || s.linear_num_key_heads <= 0 ||
       s.linear_num_value_heads <= 0 || s.linear_num_value_heads % s.linear_num_key_heads != 0))
    return Status::Error(
        "Gated DeltaNet needs one layer type per layer and positive linear_conv_kernel_dim, linear_key_head_dim, "
        "linear_value_head_dim, linear_num_key_heads and linear_num_value_heads, the value heads a multiple of the key "
        "heads");
  const bool moe_layers = s.hybrid_layers.find('E') != std::string::npos;
  if (s.hybrid() &&
      (static_cast<std::int64_t>(s.hybrid_layers.size()) != s.num_layers || s.mtp_num_layers > 0 ||
       s.has_linear_attention() || s.multi_latent_attention() || s.mamba_num_heads <= 0 || s.mamba_head_dim <= 0 ||
       s.mamba_state_dim <= 0 || s.mamba_num_groups <= 0 || s.mamba_conv_kernel <= 0 ||
       s.mamba_num_heads % s.mamba_num_groups != 0 || s.moe_latent_size < 0 || moe_layers != s.is_moe() ||
       (moe_layers && s.dense_ffn_hidden_size <= 0 && s.hybrid_layers.find('-') != std::string::npos) ||
       s.hybrid_layers.find_first_not_of("M*-E") != std::string::npos))
    return Status::Error(
        "a hybrid (Mamba) model needs one of M, *, - or E per layer, positive mamba_num_heads, mamba_head_dim, "
        "mamba_state_dim, mamba_num_groups and conv kernel, the heads a multiple of the groups, experts exactly when "
        "it has E layers (its MLP layers then of dense_ffn_hidden_size), and no multi-token prediction, Gated "
        "DeltaNet or multi-latent attention");
  const bool heterogeneous = !s.layer_kv_channels.empty() || !s.layer_query_groups.empty() || s.attention_k_eq_v ||
                             s.kv_shared_layers != 0 || s.double_wide_mlp || s.per_layer_input_size != 0 ||
                             s.moe_beside_mlp;
  if (heterogeneous) {
    bool groups_ok = true;
    for (std::int64_t i = 0; i < s.num_layers; ++i)
      groups_ok = groups_ok && s.layer_query_groups_of(i) > 0 && s.layer_kv_channels_of(i) > 0 &&
                  s.num_attention_heads % s.layer_query_groups_of(i) == 0;
    const auto per_layer = [&](const std::vector<std::int64_t>& v) {
      return v.empty() || static_cast<std::int64_t>(v.size()) == s.num_layers;
    };
    if (!groups_ok || !per_layer(s.layer_kv_channels) || !per_layer(s.layer_query_groups) ||
        s.kv_shared_layers < 0 || s.kv_shared_layers >= s.num_layers || s.per_layer_input_size < 0 ||
        s.per_layer_input_size > (std::int64_t{1} << 20) ||
        (s.per_layer_input_size > 0) != (s.per_layer_vocab_size > 0) || s.per_layer_vocab_size < 0 ||
        (s.moe_beside_mlp && (!s.is_moe() || s.shared_expert_ffn_hidden_size <= 0)) || s.hybrid() ||
        s.has_linear_attention() || s.multi_latent_attention() || s.mtp_num_layers > 0)
      return Status::Error(
          "Gemma 4's layers need one positive kv_channels and query-group count per layer dividing the attention heads, "
          "kv_shared_layers below num_layers, per_layer_input_size and per_layer_vocab_size both set or both 0, "
          "moe_beside_mlp only in an MoE model with shared experts, and no hybrid, Gated DeltaNet, multi-latent "
          "attention or multi-token-prediction layers");
  }
  if (s.attention_output_gate && s.multi_latent_attention())
    return Status::Error("attention_output_gate with multi-latent attention (Megatron-Core has no such model)");
  const std::int64_t h = s.hidden_size;
  std::vector<CanonicalTensor> out;
  out.push_back({"embedding.word_embeddings.weight", {s.vocab_size, h}, TpSplit::kVocab, Placement::kFirstStage});
  if (s.per_layer_input_size > 0) {
    const std::int64_t width = s.num_layers * s.per_layer_input_size;
    out.push_back({"per_layer_embedding.weight", {s.per_layer_vocab_size, width}, TpSplit::kReplicated,
                   Placement::kFirstStage});
    out.push_back({"per_layer_model_proj.weight", {width, h}, TpSplit::kReplicated,
                   Placement::kFirstStage});
    out.push_back({"per_layer_proj_norm.weight", {s.per_layer_input_size}, TpSplit::kReplicated,
                   Placement::kFirstStage});
  }
  for (std::int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = "decoder.layers." + std::to_string(i) + ".";
    auto add = [&](const std::string& name, Shape shape, TpSplit split, std::int64_t expert = -1) {
      out.push_back({p + name, std::move(shape), split, Placement::kLayer, i, expert});
    };
    if (s.hybrid()) add_hybrid_layer_tensors(s, s.hybrid_layer(i), add);
    else add_layer_tensors(s, i, s.layer_is_moe(i), s.layer_is_linear_attention(i), add);
  }
  out.push_back({s.hybrid() ? "decoder.final_norm.weight" : "decoder.final_layernorm.weight", {h}, TpSplit::kReplicated,
                 Placement::kLastStage});
  // Multi-token prediction: after the decoder, on the last stage (its layer is the last decoder layer's kind).
  for (std::int64_t k = 0; k < s.mtp_num_layers; ++k) {
    const std::string p = "mtp.layers." + std::to_string(k) + ".";
    auto add = [&](const std::string& name, Shape shape, TpSplit split, std::int64_t expert = -1) {
      out.push_back({p + name, std::move(shape), split, Placement::kLastStage, -1, expert});
    };
    add("enorm.weight", Shape{h}, TpSplit::kReplicated);
    add("hnorm.weight", Shape{h}, TpSplit::kReplicated);
    add("eh_proj.weight", Shape{h, 2 * h}, TpSplit::kColumn);
    add_layer_tensors(s, s.num_layers, s.layer_is_moe(s.num_layers), false,
                      [&](const std::string& name, Shape shape, TpSplit split, std::int64_t expert = -1) {
                        add("transformer_layer." + name, std::move(shape), split, expert);
                      });
    add("final_layernorm.weight", Shape{h}, TpSplit::kReplicated);
  }
  if (!s.tied_embeddings)
    out.push_back({"output_layer.weight", {s.vocab_size, h}, TpSplit::kVocab, Placement::kLastStage});
  // Tensors carried with the model (a vision tower): named apart from the model's own, each once, with sane names.
  std::set<std::string> names;
  for (const auto& t : out) names.insert(t.name);
  for (const auto& c : s.carried_tensors) {
    const bool printable = !c.name.empty() && c.name.size() <= 1024 &&
                           std::all_of(c.name.begin(), c.name.end(), [](char ch) { return ch > ' ' && ch < 127; });
    if (!printable || !names.insert(c.name).second)
      return Status::Error("carried tensor '" + c.name.substr(0, 200) +
                           "' is not a printable name of its own (empty, too long, or a name the model has)");
    std::int64_t elements = 1;
    for (const std::int64_t d : c.shape) {
      if (d <= 0 || elements > (std::int64_t{1} << 50) / d)
        return Status::Error("carried tensor " + c.name + " has a shape that is not positive or too large");
      elements *= d;
    }
    out.push_back({c.name, c.shape, TpSplit::kReplicated, Placement::kFirstStage});
  }
  return out;
}

Status check_mlp_split(const GptModelSpec& s, int tp, int expert_tp) {
  auto check = [](std::int64_t size, int parts, const std::string& what, const std::string& parts_name) -> Status {
    if (size % parts == 0) return OkStatus();
    return Status::Error(what + " " + std::to_string(size) + " is not divisible by " + parts_name + " " +
                         std::to_string(parts) + " (Megatron splits the MLP's hidden units over those ranks)");
  };
  static const std::string kTp = "the tensor-parallel size";
  const std::int64_t dense = s.is_moe() ? s.dense_ffn_hidden_size : s.ffn_hidden_size;
  if (dense > 0)
    TRESTLE_RETURN_IF_ERROR(
        check(dense, tp, "ffn_hidden_size (the MLP's hidden size: intermediate_size in config.json)", kTp));
  if (s.is_moe())
    TRESTLE_RETURN_IF_ERROR(check(s.ffn_hidden_size, expert_tp,
                                  "moe_ffn_hidden_size (each routed expert's hidden size)",
                                  expert_tp == tp ? kTp : "the experts' tensor-parallel size"));
  if (s.shared_expert_ffn_hidden_size > 0)
    TRESTLE_RETURN_IF_ERROR(check(s.shared_expert_ffn_hidden_size, tp,
                                  "moe_shared_expert_intermediate_size (the shared experts' hidden size)", kTp));
  return OkStatus();
}

}  // namespace trestle
