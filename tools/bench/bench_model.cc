#include "tools/bench/bench_model.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "convert/formats/safetensors/safetensors_writer.h"
#include "tools/bench/bench_report.h"
#include "tools/self_exe.h"

namespace trestle::cli {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

Status write_config(const std::string& dir, const json& config) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  std::ofstream out(config_path);
  out << config.dump(2) << "\n";
  out.close();
  if (!out) return Status::Error(config_path + ": cannot write: " + std::strerror(errno));
  return OkStatus();
}

// Gated DeltaNet's gated norm weights near 1 (1 + j / 128, j in [-32, 32)), as initialised and trained ones are:
// Megatron-Core holds them zero-centred (weight - 1), which bfloat16 keeps exactly there.
std::vector<std::uint16_t> gated_norm_weights(std::int64_t n) {
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const float value = 1.0f + static_cast<float>(i % 64 - 32) / 128.0f;
    std::uint32_t word;
    std::memcpy(&word, &value, sizeof word);
    bits[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(word >> 16);  // exact: 8 significant bits at most
  }
  return bits;
}

Status write_hf_model(const std::string& dir, const std::vector<TensorSpec>& specs, const json& config) {
  StateDict state(specs);
  TRESTLE_ASSIGN_OR_RETURN(auto writer,
                           ShardedSafetensorsWriter::create(dir, state.specs(), 1'000'000'000, {{"format", "pt"}}));
  for (std::size_t i = 0; i < state.size(); ++i) {
    const TensorSpec& spec = state.specs()[i];
    if (spec.name.ends_with("linear_attn.norm.weight") && spec.dtype == DType::kBF16) {
      const auto bits = gated_norm_weights(numel(spec.shape));
      TRESTLE_RETURN_IF_ERROR(writer->write(spec.name, std::as_bytes(std::span(bits))));
      continue;
    }
    TRESTLE_RETURN_IF_ERROR(writer->write(spec.name, state.bytes(i)));
  }
  TRESTLE_RETURN_IF_ERROR(writer->commit());
  return write_config(dir, config);
}

}  // namespace

Result<LlamaShape> llama_shape_for_layout(std::uint64_t bytes, int tp, int pp) {
  LlamaShape s = llama_shape_for_bytes(bytes, DType::kBF16);
  s.layers = std::max<std::int64_t>(pp, s.layers / pp * pp);
  // Narrow models have few KV heads: raise them to the next count that tp splits and that divides the heads.
  for (std::int64_t kv = s.kv_heads; kv <= s.heads && s.kv_heads % tp != 0; ++kv)
    if (kv % tp == 0 && s.heads % kv == 0) s.kv_heads = kv;
  if (s.kv_heads % tp != 0 || s.intermediate % tp != 0)
    return Status::Error("the generated model (" + std::to_string(s.kv_heads) + " KV heads, ffn " +
                         std::to_string(s.intermediate) + ", " + std::to_string(s.heads) +
                         " heads) does not split over tp " + std::to_string(tp) + "; a larger --size gives more heads");
  return s;
}

Status write_llama_hf_model(const std::string& dir, const LlamaShape& s) {
  const json config = {
      {"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},         {"hidden_size", s.hidden},
      {"intermediate_size", s.intermediate},   {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
      {"num_key_value_heads", s.kv_heads},     {"head_dim", s.head_dim},        {"vocab_size", s.vocab},
      {"max_position_embeddings", 4096},       {"rms_norm_eps", 1e-5},          {"rope_theta", 500000.0},
      {"tie_word_embeddings", false},          {"hidden_act", "silu"},          {"torch_dtype", "bfloat16"}};
  return write_hf_model(dir, llama_tensor_specs(s, DType::kBF16), config);
}

namespace {

// The routed experts, the router and the shared expert of one MoE layer (DeepSeek's and GLM-4.5's names).
void add_moe_tensor_specs(std::vector<TensorSpec>& specs, const std::string& m, std::int64_t h, std::int64_t experts,
                          std::int64_t expert_ffn) {
  const DType bf16 = DType::kBF16;
  specs.push_back({m + "gate.weight", bf16, {experts, h}});
  specs.push_back({m + "gate.e_score_correction_bias", DType::kF32, {experts}});
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::string x = m + "experts." + std::to_string(e) + ".";
    specs.push_back({x + "gate_proj.weight", bf16, {expert_ffn, h}});
    specs.push_back({x + "up_proj.weight", bf16, {expert_ffn, h}});
    specs.push_back({x + "down_proj.weight", bf16, {h, expert_ffn}});
  }
  specs.push_back({m + "shared_experts.gate_proj.weight", bf16, {expert_ffn, h}});
  specs.push_back({m + "shared_experts.up_proj.weight", bf16, {expert_ffn, h}});
  specs.push_back({m + "shared_experts.down_proj.weight", bf16, {h, expert_ffn}});
}

void add_dense_mlp_specs(std::vector<TensorSpec>& specs, const std::string& m, std::int64_t h, std::int64_t ffn) {
  specs.push_back({m + "gate_proj.weight", DType::kBF16, {ffn, h}});
  specs.push_back({m + "up_proj.weight", DType::kBF16, {ffn, h}});
  specs.push_back({m + "down_proj.weight", DType::kBF16, {h, ffn}});
}

// Grouped-query attention with per-head q / k norms and no biases (Qwen3's and Gemma 3's names) under prefix `a`.
void add_qk_norm_attention_specs(std::vector<TensorSpec>& specs, const std::string& a, std::int64_t h,
                                 std::int64_t heads, std::int64_t kv_heads, std::int64_t head_dim) {
  const DType bf16 = DType::kBF16;
  const std::int64_t q = heads * head_dim, kv = kv_heads * head_dim;
  specs.push_back({a + "q_proj.weight", bf16, {q, h}});
  specs.push_back({a + "k_proj.weight", bf16, {kv, h}});
  specs.push_back({a + "v_proj.weight", bf16, {kv, h}});
  specs.push_back({a + "o_proj.weight", bf16, {h, q}});
  specs.push_back({a + "q_norm.weight", bf16, {head_dim}});
  specs.push_back({a + "k_norm.weight", bf16, {head_dim}});
}

std::vector<TensorSpec> deepseek_tensor_specs(const DeepSeekShape& s) {
  const DType bf16 = DType::kBF16;
  const std::int64_t h = s.hidden;
  std::vector<TensorSpec> specs = {{"model.embed_tokens.weight", bf16, {s.vocab, h}}};
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.", m = p + "mlp.";
    specs.push_back({p + "input_layernorm.weight", bf16, {h}});
    specs.push_back({a + "q_a_proj.weight", bf16, {s.q_lora, h}});
    specs.push_back({a + "q_a_layernorm.weight", bf16, {s.q_lora}});
    specs.push_back({a + "q_b_proj.weight", bf16, {s.heads * (s.nope + s.rope), s.q_lora}});
    specs.push_back({a + "kv_a_proj_with_mqa.weight", bf16, {s.kv_lora + s.rope, h}});
    specs.push_back({a + "kv_a_layernorm.weight", bf16, {s.kv_lora}});
    specs.push_back({a + "kv_b_proj.weight", bf16, {s.heads * (s.nope + s.v), s.kv_lora}});
    specs.push_back({a + "o_proj.weight", bf16, {h, s.heads * s.v}});
    specs.push_back({p + "post_attention_layernorm.weight", bf16, {h}});
    if (i == 0)
      add_dense_mlp_specs(specs, m, h, s.dense_ffn);
    else
      add_moe_tensor_specs(specs, m, h, s.experts, s.expert_ffn);
  }
  specs.push_back({"model.norm.weight", bf16, {h}});
  specs.push_back({"lm_head.weight", bf16, {s.vocab, h}});
  return specs;
}

std::vector<TensorSpec> glm_tensor_specs(const GlmShape& s) {
  const DType bf16 = DType::kBF16;
  const std::int64_t h = s.hidden, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  std::vector<TensorSpec> specs = {{"model.embed_tokens.weight", bf16, {s.vocab, h}}};
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
    specs.push_back({p + "input_layernorm.weight", bf16, {h}});
    specs.push_back({a + "q_proj.weight", bf16, {q, h}});
    specs.push_back({a + "q_proj.bias", bf16, {q}});
    specs.push_back({a + "k_proj.weight", bf16, {kv, h}});
    specs.push_back({a + "k_proj.bias", bf16, {kv}});
    specs.push_back({a + "v_proj.weight", bf16, {kv, h}});
    specs.push_back({a + "v_proj.bias", bf16, {kv}});
    specs.push_back({a + "q_norm.weight", bf16, {s.head_dim}});
    specs.push_back({a + "k_norm.weight", bf16, {s.head_dim}});
    specs.push_back({a + "o_proj.weight", bf16, {h, q}});
    specs.push_back({p + "post_attention_layernorm.weight", bf16, {h}});
    if (i == 0)
      add_dense_mlp_specs(specs, p + "mlp.", h, s.dense_ffn);
    else
      add_moe_tensor_specs(specs, p + "mlp.", h, s.experts, s.expert_ffn);
  }
  specs.push_back({"model.norm.weight", bf16, {h}});
  specs.push_back({"lm_head.weight", bf16, {s.vocab, h}});
  return specs;
}

std::vector<TensorSpec> qwen3_next_tensor_specs(const Qwen3NextShape& s) {
  const DType bf16 = DType::kBF16;
  const std::int64_t h = s.hidden, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  const std::int64_t keys = s.key_heads * s.key_dim, values = s.value_heads * s.value_dim;
  std::vector<TensorSpec> specs = {{"model.embed_tokens.weight", bf16, {s.vocab, h}}};
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", m = p + "mlp.";
    specs.push_back({p + "input_layernorm.weight", bf16, {h}});
    if (s.full_attention(i)) {
      const std::string a = p + "self_attn.";
      specs.push_back({a + "q_proj.weight", bf16, {2 * q, h}});  // queries and their gates
      specs.push_back({a + "k_proj.weight", bf16, {kv, h}});
      specs.push_back({a + "v_proj.weight", bf16, {kv, h}});
      specs.push_back({a + "q_norm.weight", bf16, {s.head_dim}});
      specs.push_back({a + "k_norm.weight", bf16, {s.head_dim}});
      specs.push_back({a + "o_proj.weight", bf16, {h, q}});
    } else {
      const std::string g = p + "linear_attn.";
      specs.push_back({g + "in_proj_qkvz.weight", bf16, {2 * keys + 2 * values, h}});
      specs.push_back({g + "in_proj_ba.weight", bf16, {2 * s.value_heads, h}});
      specs.push_back({g + "conv1d.weight", bf16, {2 * keys + values, 1, s.conv}});
      specs.push_back({g + "dt_bias", bf16, {s.value_heads}});
      specs.push_back({g + "A_log", bf16, {s.value_heads}});
      specs.push_back({g + "norm.weight", bf16, {s.value_dim}});
      specs.push_back({g + "out_proj.weight", bf16, {h, values}});
    }
    specs.push_back({p + "post_attention_layernorm.weight", bf16, {h}});
    specs.push_back({m + "gate.weight", bf16, {s.experts, h}});
    for (std::int64_t e = 0; e < s.experts; ++e)
      add_dense_mlp_specs(specs, m + "experts." + std::to_string(e) + ".", h, s.expert_ffn);
    add_dense_mlp_specs(specs, m + "shared_expert.", h, s.expert_ffn);
    specs.push_back({m + "shared_expert_gate.weight", bf16, {1, h}});
  }
  specs.push_back({"model.norm.weight", bf16, {h}});
  specs.push_back({"lm_head.weight", bf16, {s.vocab, h}});
  return specs;
}

// The layers (one dense, then MoE layers of `experts` experts and a shared one, each with `attention` bf16 parameters)
// of a model near `bytes`, a multiple of pp.
std::int64_t moe_model_layers(std::uint64_t bytes, int pp, std::int64_t attention, std::int64_t h, std::int64_t vocab,
                              std::int64_t dense_ffn, std::int64_t experts, std::int64_t expert_ffn) {
  const std::int64_t moe_layer = 2 * (attention + (experts + 1) * 3 * expert_ffn * h + experts * h);
  const std::int64_t fixed = 2 * (2 * vocab * h + attention + 3 * dense_ffn * h);
  const auto wanted = static_cast<std::int64_t>(bytes) - fixed;
  const std::int64_t layers = std::max<std::int64_t>(1, wanted / moe_layer) + 1;
  return std::max<std::int64_t>(pp, layers / pp * pp);
}

}  // namespace

Result<DeepSeekShape> deepseek_shape_for_layout(std::uint64_t bytes, int tp, int pp, int ep) {
  DeepSeekShape s;
  const std::int64_t h = s.hidden;
  const std::int64_t attention = s.q_lora * h + s.heads * (s.nope + s.rope) * s.q_lora + (s.kv_lora + s.rope) * h +
                                 s.heads * (s.nope + s.v) * s.kv_lora + h * s.heads * s.v;
  s.layers = moe_model_layers(bytes, pp, attention, h, s.vocab, s.dense_ffn, s.experts, s.expert_ffn);
  if (s.heads % tp != 0 || s.experts % ep != 0)
    return Status::Error("the generated DeepSeek-V3-shaped model (" + std::to_string(s.heads) + " heads, " +
                         std::to_string(s.experts) + " experts) does not split over tp " + std::to_string(tp) +
                         " and ep " + std::to_string(ep));
  return s;
}

Status write_deepseek_hf_model(const std::string& dir, const DeepSeekShape& s) {
  return write_hf_model(
      dir, deepseek_tensor_specs(s),
      {{"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"},
            {"hidden_size", s.hidden}, {"intermediate_size", s.dense_ffn}, {"moe_intermediate_size", s.expert_ffn},
            {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads}, {"num_key_value_heads", s.heads},
            {"q_lora_rank", s.q_lora}, {"kv_lora_rank", s.kv_lora}, {"qk_nope_head_dim", s.nope},
            {"qk_rope_head_dim", s.rope}, {"v_head_dim", s.v}, {"head_dim", s.rope}, {"n_routed_experts", s.experts},
            {"n_shared_experts", 1}, {"num_experts_per_tok", s.per_token}, {"n_group", s.groups},
            {"topk_group", s.group_topk}, {"routed_scaling_factor", 2.5}, {"norm_topk_prob", true},
            {"first_k_dense_replace", 1}, {"vocab_size", s.vocab}, {"max_position_embeddings", 4096},
            {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false}, {"hidden_act", "silu"},
            {"num_nextn_predict_layers", 0}, {"torch_dtype", "bfloat16"}});
}

Result<GlmShape> glm_shape_for_layout(std::uint64_t bytes, int tp, int pp, int ep) {
  GlmShape s;
  const std::int64_t h = s.hidden, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  const std::int64_t attention = (q + 2 * kv) * (h + 1) + h * q + 2 * s.head_dim;
  s.layers = moe_model_layers(bytes, pp, attention, h, s.vocab, s.dense_ffn, s.experts, s.expert_ffn);
  if (s.kv_heads % tp != 0 || s.experts % ep != 0)
    return Status::Error("the generated GLM-4.5-shaped model (" + std::to_string(s.kv_heads) + " KV heads, " +
                         std::to_string(s.experts) + " experts) does not split over tp " + std::to_string(tp) +
                         " and ep " + std::to_string(ep));
  return s;
}

Status write_glm_hf_model(const std::string& dir, const GlmShape& s) {
  return write_hf_model(
      dir, glm_tensor_specs(s),
      {{"architectures", {"Glm4MoeForCausalLM"}}, {"model_type", "glm4_moe"}, {"hidden_size", s.hidden},
       {"intermediate_size", s.dense_ffn}, {"moe_intermediate_size", s.expert_ffn}, {"num_hidden_layers", s.layers},
       {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim},
       {"attention_bias", true}, {"use_qk_norm", true}, {"n_routed_experts", s.experts}, {"n_shared_experts", 1},
       {"num_experts_per_tok", s.per_token}, {"n_group", 1}, {"topk_group", 1}, {"routed_scaling_factor", 2.5},
       {"norm_topk_prob", true}, {"first_k_dense_replace", 1}, {"vocab_size", s.vocab},
       {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-5},
       {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000000.0}, {"partial_rotary_factor", 0.5}}},
       {"tie_word_embeddings", false}, {"hidden_act", "silu"}, {"num_nextn_predict_layers", 0},
       {"torch_dtype", "bfloat16"}});
}

Result<Qwen3NextShape> qwen3_next_shape_for_layout(std::uint64_t bytes, int tp, int pp, int ep) {
  Qwen3NextShape s;
  const std::int64_t h = s.hidden;
  const std::int64_t gdn = (2 * s.key_heads * s.key_dim + 2 * s.value_heads * s.value_dim) * h +
                           s.value_heads * s.value_dim * h;
  const std::int64_t moe = (s.experts + 1) * 3 * s.expert_ffn * h;
  const auto wanted = static_cast<std::int64_t>(bytes) - 2 * 2 * s.vocab * h;
  s.layers = std::max<std::int64_t>(1, wanted / (2 * (gdn + moe)));
  s.layers = std::max<std::int64_t>(pp, s.layers / pp * pp);
  if (s.kv_heads % tp != 0 || s.key_heads % tp != 0 || s.value_heads % tp != 0 || s.experts % ep != 0)
    return Status::Error("the generated Qwen3-Next-shaped model (" + std::to_string(s.kv_heads) + " KV heads, " +
                         std::to_string(s.key_heads) + " Gated DeltaNet key heads, " + std::to_string(s.experts) +
                         " experts) does not split over tp " + std::to_string(tp) + " and ep " + std::to_string(ep));
  return s;
}

Status write_qwen3_next_hf_model(const std::string& dir, const Qwen3NextShape& s) {
  json layer_types = json::array();
  for (std::int64_t i = 0; i < s.layers; ++i) layer_types.push_back(s.full_attention(i) ? "full_attention" : "linear_attention");
  return write_hf_model(
      dir, qwen3_next_tensor_specs(s),
      {{"architectures", {"Qwen3NextForCausalLM"}}, {"model_type", "qwen3_next"}, {"hidden_size", s.hidden},
       {"intermediate_size", 4 * s.hidden}, {"moe_intermediate_size", s.expert_ffn},
       {"shared_expert_intermediate_size", s.expert_ffn}, {"num_experts", s.experts},
       {"num_experts_per_tok", s.per_token}, {"norm_topk_prob", true}, {"decoder_sparse_step", 1},
       {"mlp_only_layers", json::array()}, {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
       {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim}, {"linear_num_key_heads", s.key_heads},
       {"linear_num_value_heads", s.value_heads}, {"linear_key_head_dim", s.key_dim},
       {"linear_value_head_dim", s.value_dim}, {"linear_conv_kernel_dim", s.conv}, {"layer_types", layer_types},
       {"vocab_size", s.vocab}, {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-6},
       {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000000.0}, {"partial_rotary_factor", 0.25}}},
       {"tie_word_embeddings", false}, {"hidden_act", "silu"}, {"torch_dtype", "bfloat16"}});
}

namespace {

std::vector<TensorSpec> nemotron_h_tensor_specs(const NemotronHShape& s) {
  const DType bf16 = DType::kBF16;
  const std::int64_t h = s.hidden, inner = s.mamba_heads * s.mamba_head_dim, groups = s.groups * s.state;
  std::vector<TensorSpec> specs = {{"backbone.embeddings.weight", bf16, {s.vocab, h}}};
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "backbone.layers." + std::to_string(i) + ".", x = p + "mixer.";
    specs.push_back({p + "norm.weight", bf16, {h}});
    if (s.kind(i) == 'M') {
      specs.push_back({x + "in_proj.weight", bf16, {2 * inner + 2 * groups + s.mamba_heads, h}});
      specs.push_back({x + "conv1d.weight", bf16, {inner + 2 * groups, 1, s.conv}});
      specs.push_back({x + "conv1d.bias", bf16, {inner + 2 * groups}});
      for (const char* v : {"A_log", "D", "dt_bias"}) specs.push_back({x + v, bf16, {s.mamba_heads}});
      specs.push_back({x + "norm.weight", bf16, {inner}});
      specs.push_back({x + "out_proj.weight", bf16, {h, inner}});
    } else if (s.kind(i) == '*') {
      specs.push_back({x + "q_proj.weight", bf16, {s.heads * s.head_dim, h}});
      specs.push_back({x + "k_proj.weight", bf16, {s.kv_heads * s.head_dim, h}});
      specs.push_back({x + "v_proj.weight", bf16, {s.kv_heads * s.head_dim, h}});
      specs.push_back({x + "o_proj.weight", bf16, {h, s.heads * s.head_dim}});
    } else {
      specs.push_back({x + "up_proj.weight", bf16, {s.ffn, h}});
      specs.push_back({x + "down_proj.weight", bf16, {h, s.ffn}});
    }
  }
  specs.push_back({"backbone.norm_f.weight", bf16, {h}});
  specs.push_back({"lm_head.weight", bf16, {s.vocab, h}});
  return specs;
}

}  // namespace

Result<NemotronHShape> nemotron_h_shape_for_layout(std::uint64_t bytes, int tp, int pp) {
  NemotronHShape s;
  const std::int64_t h = s.hidden, inner = s.mamba_heads * s.mamba_head_dim, groups = s.groups * s.state;
  const std::int64_t mamba = (2 * inner + 2 * groups + s.mamba_heads) * h + h * inner;
  const std::int64_t block = 3 * mamba + 3 * 2 * s.ffn * h + 2 * (s.heads + s.kv_heads) * s.head_dim * h;  // 7 layers
  const auto wanted = static_cast<std::int64_t>(bytes) - 2 * 2 * s.vocab * h;
  s.layers = std::max<std::int64_t>(1, wanted * 7 / (2 * block));
  s.layers = std::max<std::int64_t>(pp, s.layers / pp * pp);
  if (s.kv_heads % tp != 0 || s.mamba_heads % tp != 0 || s.groups % tp != 0)
    return Status::Error("the generated Nemotron-H-shaped model (" + std::to_string(s.kv_heads) + " KV heads, " +
                         std::to_string(s.mamba_heads) + " Mamba heads in " + std::to_string(s.groups) +
                         " groups) does not split over tp " + std::to_string(tp));
  return s;
}

Status write_nemotron_h_hf_model(const std::string& dir, const NemotronHShape& s) {
  json types = json::array();
  for (const char kind : s.pattern())
    types.push_back(kind == 'M' ? "linear_attention" : kind == '*' ? "full_attention" : "mlp");
  return write_hf_model(
      dir, nemotron_h_tensor_specs(s),
      {{"architectures", {"NemotronHForCausalLM"}}, {"model_type", "nemotron_h"}, {"hidden_size", s.hidden},
       {"intermediate_size", s.ffn}, {"layers_block_type", types}, {"num_attention_heads", s.heads},
       {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim}, {"mamba_num_heads", s.mamba_heads},
       {"mamba_head_dim", s.mamba_head_dim}, {"ssm_state_size", s.state}, {"n_groups", s.groups},
       {"conv_kernel", s.conv}, {"use_conv_bias", true}, {"use_bias", false}, {"mlp_bias", false},
       {"mlp_hidden_act", "relu2"}, {"mamba_hidden_act", "silu"}, {"layer_norm_epsilon", 1e-5},
       {"vocab_size", s.vocab}, {"max_position_embeddings", 4096}, {"tie_word_embeddings", false},
       {"torch_dtype", "bfloat16"}});
}

namespace {

std::vector<TensorSpec> gemma4_tensor_specs(const Gemma4Shape& s) {
  const DType bf16 = DType::kBF16;
  const std::int64_t h = s.hidden, ple = s.per_layer;
  std::vector<TensorSpec> specs = {{"model.embed_tokens.weight", bf16, {s.vocab, h}},
                                   {"model.embed_tokens_per_layer.weight", bf16, {s.vocab, s.layers * ple}},
                                   {"model.per_layer_model_projection.weight", bf16, {s.layers * ple, h}},
                                   {"model.per_layer_projection_norm.weight", bf16, {ple}}};
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
    const std::int64_t d = s.full(i) ? s.global_head_dim : s.head_dim;
    const std::int64_t f = s.shared(i) ? 2 * s.ffn : s.ffn;
    for (const char* norm : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                             "post_feedforward_layernorm", "post_per_layer_input_norm"})
      specs.push_back({p + norm + ".weight", bf16, {h}});
    specs.push_back({a + "q_proj.weight", bf16, {s.heads * d, h}});
    specs.push_back({a + "q_norm.weight", bf16, {d}});
    if (!s.shared(i)) {
      specs.push_back({a + "k_proj.weight", bf16, {s.kv_heads * d, h}});
      specs.push_back({a + "k_norm.weight", bf16, {d}});
      if (!s.full(i)) specs.push_back({a + "v_proj.weight", bf16, {s.kv_heads * d, h}});  // full: keys are values
    }
    specs.push_back({a + "o_proj.weight", bf16, {h, s.heads * d}});
    specs.push_back({p + "mlp.gate_proj.weight", bf16, {f, h}});
    specs.push_back({p + "mlp.up_proj.weight", bf16, {f, h}});
    specs.push_back({p + "mlp.down_proj.weight", bf16, {h, f}});
    specs.push_back({p + "per_layer_input_gate.weight", bf16, {ple, h}});
    specs.push_back({p + "per_layer_projection.weight", bf16, {h, ple}});
    specs.push_back({p + "layer_scalar", bf16, {1}});
  }
  specs.push_back({"model.norm.weight", bf16, {h}});
  return specs;
}

}  // namespace

Result<Gemma4Shape> gemma4_shape_for_layout(std::uint64_t bytes, int tp, int pp) {
  Gemma4Shape s;
  const std::int64_t h = s.hidden;
  const std::int64_t layer = 2 * s.heads * s.head_dim * h + 2 * s.kv_heads * s.head_dim * h + 3 * s.ffn * h +
                             2 * s.per_layer * h + s.per_layer * (s.vocab + h);
  const auto wanted = static_cast<std::int64_t>(bytes) - 2 * s.vocab * h;
  // At least 3 layers (one of them sharing keys and values), a multiple of pp.
  s.layers = (std::max<std::int64_t>(3, wanted / (2 * layer)) + pp - 1) / pp * pp;
  s.kv_shared = s.layers / 3;
  if (s.kv_heads % tp != 0)
    return Status::Error("the generated Gemma-4-shaped model (" + std::to_string(s.kv_heads) +
                         " KV heads) does not split over tp " + std::to_string(tp));
  return s;
}

Status write_gemma4_hf_model(const std::string& dir, const Gemma4Shape& s) {
  json types = json::array();
  for (std::int64_t i = 0; i < s.layers; ++i) types.push_back(s.full(i) ? "full_attention" : "sliding_attention");
  return write_hf_model(
      dir, gemma4_tensor_specs(s),
      {{"architectures", {"Gemma4ForCausalLM"}}, {"model_type", "gemma4_text"}, {"hidden_size", s.hidden},
       {"intermediate_size", s.ffn}, {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
       {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim}, {"global_head_dim", s.global_head_dim},
       {"num_global_key_value_heads", s.kv_heads}, {"attention_k_eq_v", true}, {"layer_types", types},
       {"sliding_window", 512}, {"num_kv_shared_layers", s.kv_shared}, {"use_double_wide_mlp", true},
       {"hidden_size_per_layer_input", s.per_layer}, {"vocab_size_per_layer_input", s.vocab},
       {"vocab_size", s.vocab}, {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-6},
       {"final_logit_softcapping", 30.0}, {"hidden_activation", "gelu_pytorch_tanh"},
       {"rope_parameters",
        {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
         {"full_attention", {{"rope_type", "proportional"}, {"partial_rotary_factor", 0.25}, {"rope_theta", 1e6}}}}},
       {"tie_word_embeddings", true}, {"torch_dtype", "bfloat16"}});
}

namespace {

std::vector<TensorSpec> qwen3_vl_tensor_specs(const Qwen3VlShape& s) {
  const DType bf16 = DType::kBF16;
  const std::int64_t h = s.hidden;
  std::vector<TensorSpec> specs = {{"model.language_model.embed_tokens.weight", bf16, {s.vocab, h}}};
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.language_model.layers." + std::to_string(i) + ".";
    specs.push_back({p + "input_layernorm.weight", bf16, {h}});
    add_qk_norm_attention_specs(specs, p + "self_attn.", h, s.heads, s.kv_heads, s.head_dim);
    specs.push_back({p + "post_attention_layernorm.weight", bf16, {h}});
    add_dense_mlp_specs(specs, p + "mlp.", h, s.ffn);
  }
  specs.push_back({"model.language_model.norm.weight", bf16, {h}});
  specs.push_back({"lm_head.weight", bf16, {s.vocab, h}});
  const std::string v = "model.visual.";
  const std::int64_t vh = s.vision_hidden, merged = vh * s.merge * s.merge;
  auto linear = [&](const std::string& name, std::int64_t out, std::int64_t in) {
    specs.push_back({v + name + ".weight", bf16, in > 0 ? Shape{out, in} : Shape{out}});
    specs.push_back({v + name + ".bias", bf16, {out}});
  };
  specs.push_back({v + "patch_embed.proj.weight", bf16, {vh, 3, s.temporal, s.patch, s.patch}});
  specs.push_back({v + "patch_embed.proj.bias", bf16, {vh}});
  specs.push_back({v + "pos_embed.weight", bf16, {s.positions, vh}});
  for (std::int64_t b = 0; b < s.depth; ++b) {
    const std::string block = "blocks." + std::to_string(b) + ".";
    linear(block + "norm1", vh, 0);
    linear(block + "norm2", vh, 0);
    linear(block + "attn.qkv", 3 * vh, vh);
    linear(block + "attn.proj", vh, vh);
    linear(block + "mlp.linear_fc1", s.vision_ffn, vh);
    linear(block + "mlp.linear_fc2", vh, s.vision_ffn);
  }
  linear("merger.norm", vh, 0);
  linear("merger.linear_fc1", merged, merged);
  linear("merger.linear_fc2", h, merged);
  for (std::size_t k = 0; k < s.deepstack().size(); ++k) {
    const std::string merger = "deepstack_merger_list." + std::to_string(k) + ".";
    linear(merger + "norm", merged, 0);
    linear(merger + "linear_fc1", merged, merged);
    linear(merger + "linear_fc2", h, merged);
  }
  return specs;
}

}  // namespace

namespace {

// A vision-language model of about `bytes` (bf16): besides its `fixed` bytes, two thirds language layers of the
// attention and gated MLP of shape `s` (a multiple of pp, at least one), the rest vision blocks of vision_hidden with
// four square projections and an MLP of vision_ffn (at least 2); refused where tp does not divide its KV heads.
template <typename Shape>
Status size_vision_language(Shape& s, std::uint64_t bytes, std::int64_t fixed, int tp, int pp, const std::string& name) {
  const std::int64_t h = s.hidden, vh = s.vision_hidden;
  const std::int64_t layer = 2 * (2 * s.heads * s.head_dim * h + 2 * s.kv_heads * s.head_dim * h + 3 * s.ffn * h);
  const std::int64_t block = 2 * (4 * vh * vh + 2 * vh * s.vision_ffn);
  const std::int64_t rest = std::max<std::int64_t>(0, static_cast<std::int64_t>(bytes) - fixed);
  s.layers = (std::max<std::int64_t>(1, 2 * rest / 3 / layer) + pp - 1) / pp * pp;
  s.depth = std::max<std::int64_t>(2, (rest - s.layers * layer) / block);
  if (s.kv_heads % tp != 0)
    return Status::Error("the generated " + name + " model (" + std::to_string(s.kv_heads) +
                         " KV heads) does not split over tp " + std::to_string(tp));
  return OkStatus();
}

}  // namespace

Result<Qwen3VlShape> qwen3_vl_shape_for_layout(std::uint64_t bytes, int tp, int pp) {
  Qwen3VlShape s;
  const std::int64_t merged = s.vision_hidden * s.merge * s.merge;
  const std::int64_t fixed = 2 * (2 * s.vocab * s.hidden + 3 * (merged * merged + s.hidden * merged));
  TRESTLE_RETURN_IF_ERROR(size_vision_language(s, bytes, fixed, tp, pp, "Qwen3-VL-shaped"));
  return s;
}

Status write_qwen3_vl_hf_model(const std::string& dir, const Qwen3VlShape& s) {
  const json text = {{"hidden_size", s.hidden},
                     {"intermediate_size", s.ffn},
                     {"num_hidden_layers", s.layers},
                     {"num_attention_heads", s.heads},
                     {"num_key_value_heads", s.kv_heads},
                     {"head_dim", s.head_dim},
                     {"vocab_size", s.vocab},
                     {"max_position_embeddings", 4096},
                     {"rms_norm_eps", 1e-6},
                     {"rope_theta", 5000000.0},
                     {"hidden_act", "silu"},
                     {"tie_word_embeddings", false},
                     {"torch_dtype", "bfloat16"}};
  const json vision = {{"depth", s.depth},
                       {"hidden_size", s.vision_hidden},
                       {"intermediate_size", s.vision_ffn},
                       {"num_heads", s.vision_heads},
                       {"in_channels", 3},
                       {"patch_size", s.patch},
                       {"temporal_patch_size", s.temporal},
                       {"spatial_merge_size", s.merge},
                       {"out_hidden_size", s.hidden},
                       {"num_position_embeddings", s.positions},
                       {"deepstack_visual_indexes", s.deepstack()}};
  return write_hf_model(dir, qwen3_vl_tensor_specs(s),
                        {{"architectures", {"Qwen3VLForConditionalGeneration"}},
                         {"model_type", "qwen3_vl"},
                         {"text_config", text},
                         {"vision_config", vision},
                         {"tie_word_embeddings", false},
                         {"torch_dtype", "bfloat16"}});
}

namespace {

std::vector<TensorSpec> gemma3_vl_tensor_specs(const Gemma3VlShape& s) {
  const DType bf16 = DType::kBF16;
  const std::int64_t h = s.hidden;
  const std::string lm = "language_model.model.";
  std::vector<TensorSpec> specs = {{lm + "embed_tokens.weight", bf16, {s.vocab, h}}};
  for (std::int64_t i = 0; i < s.layers; ++i) {
    const std::string p = lm + "layers." + std::to_string(i) + ".";
    for (const char* norm : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                             "post_feedforward_layernorm"})
      specs.push_back({p + norm + ".weight", bf16, {h}});
    add_qk_norm_attention_specs(specs, p + "self_attn.", h, s.heads, s.kv_heads, s.head_dim);
    add_dense_mlp_specs(specs, p + "mlp.", h, s.ffn);
  }
  specs.push_back({lm + "norm.weight", bf16, {h}});
  const std::string v = "vision_tower.";
  const std::int64_t vh = s.vision_hidden, patches = (s.image / s.patch) * (s.image / s.patch);
  auto linear = [&](const std::string& name, Shape weight) {
    const std::int64_t out = weight.front();
    specs.push_back({v + name + ".weight", bf16, std::move(weight)});
    specs.push_back({v + name + ".bias", bf16, {out}});
  };
  linear("embeddings.patch_embedding", {vh, 3, s.patch, s.patch});
  specs.push_back({v + "embeddings.position_embedding.weight", bf16, {patches, vh}});
  for (std::int64_t l = 0; l < s.depth; ++l) {
    const std::string layer = "encoder.layers." + std::to_string(l) + ".";
    linear(layer + "layer_norm1", {vh});
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) linear(layer + "self_attn." + proj, {vh, vh});
    linear(layer + "layer_norm2", {vh});
    linear(layer + "mlp.fc1", {s.vision_ffn, vh});
    linear(layer + "mlp.fc2", {vh, s.vision_ffn});
  }
  linear("post_layernorm", {vh});
  specs.push_back({"multi_modal_projector.mm_soft_emb_norm.weight", bf16, {vh}});
  specs.push_back({"multi_modal_projector.mm_input_projection_weight", bf16, {vh, h}});
  return specs;
}

}  // namespace

Result<Gemma3VlShape> gemma3_vl_shape_for_layout(std::uint64_t bytes, int tp, int pp) {
  Gemma3VlShape s;
  const std::int64_t vh = s.vision_hidden, patches = (s.image / s.patch) * (s.image / s.patch);
  const std::int64_t fixed = 2 * (s.vocab * s.hidden + patches * vh + vh * s.hidden);
  TRESTLE_RETURN_IF_ERROR(size_vision_language(s, bytes, fixed, tp, pp, "Gemma-3-with-vision-shaped"));
  return s;
}

Status write_gemma3_vl_hf_model(const std::string& dir, const Gemma3VlShape& s) {
  json types = json::array();
  for (std::int64_t i = 0; i < s.layers; ++i) types.push_back((i + 1) % 6 == 0 ? "full_attention" : "sliding_attention");
  const json text = {{"model_type", "gemma3_text"},
                     {"hidden_size", s.hidden},
                     {"intermediate_size", s.ffn},
                     {"num_hidden_layers", s.layers},
                     {"num_attention_heads", s.heads},
                     {"num_key_value_heads", s.kv_heads},
                     {"head_dim", s.head_dim},
                     {"query_pre_attn_scalar", s.head_dim},
                     {"vocab_size", s.vocab},
                     {"max_position_embeddings", 131072},
                     {"rms_norm_eps", 1e-6},
                     {"sliding_window", 1024},
                     {"layer_types", types},
                     {"rope_theta", 1000000.0},
                     {"rope_local_base_freq", 10000.0},
                     {"rope_scaling", {{"rope_type", "linear"}, {"factor", 8.0}}},
                     {"hidden_activation", "gelu_pytorch_tanh"},
                     {"tie_word_embeddings", true},
                     {"torch_dtype", "bfloat16"}};
  const json vision = {{"model_type", "siglip_vision_model"},
                       {"hidden_size", s.vision_hidden},
                       {"intermediate_size", s.vision_ffn},
                       {"num_hidden_layers", s.depth},
                       {"num_attention_heads", s.vision_heads},
                       {"num_channels", 3},
                       {"image_size", s.image},
                       {"patch_size", s.patch},
                       {"vision_use_head", false}};
  return write_hf_model(dir, gemma3_vl_tensor_specs(s),
                        {{"architectures", {"Gemma3ForConditionalGeneration"}},
                         {"model_type", "gemma3"},
                         {"text_config", text},
                         {"vision_config", vision},
                         {"mm_tokens_per_image", 256},
                         {"tie_word_embeddings", true},
                         {"torch_dtype", "bfloat16"}});
}

Result<std::string> trestle_exe() {
  TRESTLE_ASSIGN_OR_RETURN(const std::string dir, self_exe_dir());
  const std::string path = dir + "/trestle";
  if (::access(path.c_str(), X_OK) != 0)
    return Status::Error(path + ": the trestle CLI is not beside trestle-bench: " + std::strerror(errno));
  return path;
}

}  // namespace trestle::cli
