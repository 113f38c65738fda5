#include "parallel/layout/model_spec.h"

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

Result<std::vector<CanonicalTensor>> canonical_tensors(const GptModelSpec& s) {
  if (s.num_layers <= 0 || s.hidden_size <= 0 || s.ffn_hidden_size <= 0 || s.num_attention_heads <= 0 ||
      s.num_query_groups <= 0 || s.kv_channels <= 0 || s.vocab_size <= 0 || s.num_experts < 0)
    return Status::Error("model sizes must be positive (num_layers, hidden_size, ffn_hidden_size, num_attention_heads, "
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
    add(pre_mlp_norm_name(s.norms, s.is_moe()), {h}, TpSplit::kReplicated);
    if (!s.is_moe()) {
      add("mlp.linear_fc1.weight", {2 * f, h}, TpSplit::kGatedColumn);
      add("mlp.linear_fc2.weight", {h, f}, TpSplit::kRow);
      continue;
    }
    add("mlp.router.weight", {s.num_experts, h}, TpSplit::kReplicated);
    for (std::int64_t e = 0; e < s.num_experts; ++e) {
      const std::string x = "mlp.experts.local_experts." + std::to_string(e) + ".";
      add(x + "linear_fc1.weight", {2 * f, h}, TpSplit::kGatedColumn, e);
      add(x + "linear_fc2.weight", {h, f}, TpSplit::kRow, e);
    }
  }
  out.push_back({"decoder.final_layernorm.weight", {h}, TpSplit::kReplicated, Placement::kLastStage});
  if (!s.tied_embeddings)
    out.push_back({"output_layer.weight", {s.vocab_size, h}, TpSplit::kVocab, Placement::kLastStage});
  return out;
}

}  // namespace trestle
