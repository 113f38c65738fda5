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
  StateDict state(llama_tensor_specs(s, DType::kBF16));
  TRESTLE_ASSIGN_OR_RETURN(auto writer,
                           ShardedSafetensorsWriter::create(dir, state.specs(), 1'000'000'000, {{"format", "pt"}}));
  for (std::size_t i = 0; i < state.size(); ++i)
    TRESTLE_RETURN_IF_ERROR(writer->write(state.specs()[i].name, state.bytes(i)));
  TRESTLE_RETURN_IF_ERROR(writer->commit());
  const json config = {
      {"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},         {"hidden_size", s.hidden},
      {"intermediate_size", s.intermediate},   {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
      {"num_key_value_heads", s.kv_heads},     {"head_dim", s.head_dim},        {"vocab_size", s.vocab},
      {"max_position_embeddings", 4096},       {"rms_norm_eps", 1e-5},          {"rope_theta", 500000.0},
      {"tie_word_embeddings", false},          {"hidden_act", "silu"},          {"torch_dtype", "bfloat16"}};
  return write_config(dir, config);
}

namespace {

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
    if (i == 0) {
      specs.push_back({m + "gate_proj.weight", bf16, {s.dense_ffn, h}});
      specs.push_back({m + "up_proj.weight", bf16, {s.dense_ffn, h}});
      specs.push_back({m + "down_proj.weight", bf16, {h, s.dense_ffn}});
      continue;
    }
    specs.push_back({m + "gate.weight", bf16, {s.experts, h}});
    specs.push_back({m + "gate.e_score_correction_bias", DType::kF32, {s.experts}});
    for (std::int64_t e = 0; e < s.experts; ++e) {
      const std::string x = m + "experts." + std::to_string(e) + ".";
      specs.push_back({x + "gate_proj.weight", bf16, {s.expert_ffn, h}});
      specs.push_back({x + "up_proj.weight", bf16, {s.expert_ffn, h}});
      specs.push_back({x + "down_proj.weight", bf16, {h, s.expert_ffn}});
    }
    specs.push_back({m + "shared_experts.gate_proj.weight", bf16, {s.expert_ffn, h}});
    specs.push_back({m + "shared_experts.up_proj.weight", bf16, {s.expert_ffn, h}});
    specs.push_back({m + "shared_experts.down_proj.weight", bf16, {h, s.expert_ffn}});
  }
  specs.push_back({"model.norm.weight", bf16, {h}});
  specs.push_back({"lm_head.weight", bf16, {s.vocab, h}});
  return specs;
}

}  // namespace

Result<DeepSeekShape> deepseek_shape_for_layout(std::uint64_t bytes, int tp, int pp, int ep) {
  DeepSeekShape s;
  const std::int64_t h = s.hidden;
  const std::int64_t attention = s.q_lora * h + s.heads * (s.nope + s.rope) * s.q_lora + (s.kv_lora + s.rope) * h +
                                 s.heads * (s.nope + s.v) * s.kv_lora + h * s.heads * s.v;
  const std::int64_t moe_layer = 2 * (attention + (s.experts + 1) * 3 * s.expert_ffn * h + s.experts * h);
  const std::int64_t fixed = 2 * (2 * s.vocab * h + attention + 3 * s.dense_ffn * h);
  const auto wanted = static_cast<std::int64_t>(bytes) - fixed;
  s.layers = std::max<std::int64_t>(1, wanted / moe_layer) + 1;  // the dense layer and the MoE layers
  s.layers = std::max<std::int64_t>(pp, s.layers / pp * pp);
  if (s.heads % tp != 0 || s.experts % ep != 0)
    return Status::Error("the generated DeepSeek-V3-shaped model (" + std::to_string(s.heads) + " heads, " +
                         std::to_string(s.experts) + " experts) does not split over tp " + std::to_string(tp) +
                         " and ep " + std::to_string(ep));
  return s;
}

Status write_deepseek_hf_model(const std::string& dir, const DeepSeekShape& s) {
  StateDict state(deepseek_tensor_specs(s));
  TRESTLE_ASSIGN_OR_RETURN(auto writer,
                           ShardedSafetensorsWriter::create(dir, state.specs(), 1'000'000'000, {{"format", "pt"}}));
  for (std::size_t i = 0; i < state.size(); ++i)
    TRESTLE_RETURN_IF_ERROR(writer->write(state.specs()[i].name, state.bytes(i)));
  TRESTLE_RETURN_IF_ERROR(writer->commit());
  return write_config(
      dir, {{"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"},
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

Result<std::string> trestle_exe() {
  TRESTLE_ASSIGN_OR_RETURN(const std::string dir, self_exe_dir());
  const std::string path = dir + "/trestle";
  if (::access(path.c_str(), X_OK) != 0)
    return Status::Error(path + ": the trestle CLI is not beside trestle-bench: " + std::strerror(errno));
  return path;
}

}  // namespace trestle::cli
