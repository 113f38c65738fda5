#include "parallel/layout/model_spec.h"

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

NormNaming detect_norm_naming(const std::vector<std::string>& tensor_names) {
  for (const auto& name : tensor_names)
    if (name.ends_with(".self_attention.linear_qkv.layer_norm_weight")) return NormNaming::kTransformerEngine;
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
  if (m.contains("activation") && m["activation"] != "swiglu" && m["activation"] != "geglu_tanh")
    return Status::Error(where + ".activation " + m["activation"].dump() + " (swiglu or geglu_tanh)");
  s.geglu = m.value("activation", std::string("swiglu")) == "geglu_tanh";
  TRESTLE_RETURN_IF_ERROR(read_field(m, "layernorm_zero_centered_gamma", s.zero_centered_norms, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "post_layernorms", s.post_norms, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "attn_logit_softcapping", s.attn_logit_softcapping, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "final_logit_softcapping", s.final_logit_softcapping, where));
  TRESTLE_RETURN_IF_ERROR(read_field(m, "mixed_attention", s.mixed_attention, where));
  if (model.contains("parallel") && model["parallel"].is_object() && model["parallel"].contains("norm_naming")) {
    const auto& naming = model["parallel"]["norm_naming"];
    if (naming != "local" && naming != "transformer_engine")
      return Status::Error(source + ": model.parallel.norm_naming is " + naming.dump() +
                           ", not \"transformer_engine\" or \"local\"");
    if (naming == "local") s.norms = NormNaming::kLocal;
  }
  TRESTLE_RETURN_IF_ERROR(canonical_tensors(s).status());
  return s;
}

Result<std::vector<CanonicalTensor>> canonical_tensors(const GptModelSpec& s) {
  if (s.num_layers <= 0 || s.hidden_size <= 0 || s.ffn_hidden_size <= 0 || s.num_attention_heads <= 0 ||
      s.num_query_groups <= 0 || s.kv_channels <= 0 || s.vocab_size <= 0 || s.num_experts < 0 ||
      s.shared_expert_ffn_hidden_size < 0)
    return Status::Error(
        "model sizes must be positive (num_layers, hidden_size, ffn_hidden_size, num_attention_heads, "
        "num_query_groups, kv_channels, vocab_size)");
  if (s.num_attention_heads % s.num_query_groups != 0)
    return Status::Error("num_attention_heads (" + std::to_string(s.num_attention_heads) +
                         ") is not a multiple of num_query_groups (" + std::to_string(s.num_query_groups) + ")");
  const std::int64_t h = s.hidden_size, f = s.ffn_hidden_size, d = s.kv_channels;
  const std::int64_t query_rows = s.num_attention_heads * d, qkv_rows = query_rows + 2 * s.num_query_groups * d;
  std::vector<CanonicalTensor> out;
  out.push_back({"embedding.word_embeddings.weight", {s.vocab_size, h}, TpSplit::kVocab, Placement::kFirstStage});
  for (std::int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = "decoder.layers." + std::to_string(i) + ".";
    auto add = [&](const std::string& name, Shape shape, TpSplit split, std::int64_t expert = -1) {
      out.push_back({p + name, std::move(shape), split, Placement::kLayer, i, expert});
    };
    add(input_norm_name(s.norms), {h}, TpSplit::kReplicated);
    add("self_attention.linear_qkv.weight", {qkv_rows, h}, TpSplit::kColumn);
    if (s.add_qkv_bias) add("self_attention.linear_qkv.bias", {qkv_rows}, TpSplit::kColumn);
    if (s.qk_layernorm) {
      add("self_attention.q_layernorm.weight", {d}, TpSplit::kReplicated);
      add("self_attention.k_layernorm.weight", {d}, TpSplit::kReplicated);
    }
    add("self_attention.linear_proj.weight", {h, query_rows}, TpSplit::kRow);
    if (s.post_norms) add("self_attention.linear_proj.post_layernorm.weight", {h}, TpSplit::kReplicated);
    add(pre_mlp_norm_name(s.norms, s.is_moe()), {h}, TpSplit::kReplicated);
    if (!s.is_moe()) {
      add("mlp.linear_fc1.weight", {2 * f, h}, TpSplit::kGatedColumn);
      add("mlp.linear_fc2.weight", {h, f}, TpSplit::kRow);
      if (s.post_norms) add("mlp.linear_fc2.post_layernorm.weight", {h}, TpSplit::kReplicated);
      continue;
    }
    add("mlp.router.weight", {s.num_experts, h}, TpSplit::kReplicated);
    for (std::int64_t e = 0; e < s.num_experts; ++e) {
      const std::string x = "mlp.experts.local_experts." + std::to_string(e) + ".";
      add(x + "linear_fc1.weight", {2 * f, h}, TpSplit::kGatedColumn, e);
      add(x + "linear_fc2.weight", {h, f}, TpSplit::kRow, e);
    }
    if (s.shared_expert_ffn_hidden_size > 0) {
      const std::int64_t fs = s.shared_expert_ffn_hidden_size;
      add("mlp.shared_experts.linear_fc1.weight", {2 * fs, h}, TpSplit::kGatedColumn);
      add("mlp.shared_experts.linear_fc2.weight", {h, fs}, TpSplit::kRow);
      if (s.shared_expert_gate) add("mlp.shared_experts.gate_weight", {1, h}, TpSplit::kReplicated);
    }
  }
  out.push_back({"decoder.final_layernorm.weight", {h}, TpSplit::kReplicated, Placement::kLastStage});
  if (!s.tied_embeddings)
    out.push_back({"output_layer.weight", {s.vocab_size, h}, TpSplit::kVocab, Placement::kLastStage});
  return out;
}

}  // namespace trestle
