#include "tools/bench/bench_families.h"

#include <algorithm>

namespace trestle::cli {

using json = nlohmann::json;

const std::vector<std::string>& bench_families() {
  static const std::vector<std::string> kFamilies = {"llama",     "mistral", "qwen2",       "qwen3",   "phi3",
                                                     "gemma2",    "gemma3",  "olmo2",       "mixtral", "qwen3_moe",
                                                     "qwen2_moe", "gpt_oss", "deepseek_v3", "glm4_moe",
                                                     "qwen3_next", "qwen3_5", "nemotron_h", "gemma4"};
  return kFamilies;
}

namespace {

// Windows in every layer but each `every`-th (counting from 1), as transformers' layer_types.
json alternating_layer_types(int layers, int every) {
  json types = json::array();
  for (int i = 1; i <= layers; ++i) types.push_back(i % every ? "sliding_attention" : "full_attention");
  return types;
}

}  // namespace

Result<json> family_config(const std::string& family, const BenchModelSizes& s) {
  const int head_dim = s.hidden / s.heads;
  json c = {{"hidden_size", s.hidden},        {"intermediate_size", s.ffn},        {"num_hidden_layers", s.layers},
            {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads}, {"head_dim", head_dim},
            {"vocab_size", s.vocab},          {"max_position_embeddings", 4096},   {"rms_norm_eps", 1e-5},
            {"rope_theta", 10000.0},          {"tie_word_embeddings", false},      {"torch_dtype", "float32"}};
  auto named = [&](const char* architecture, const char* model_type) {
    c["architectures"] = {architecture};
    c["model_type"] = model_type;
  };
  // DeepSeek-V3's MoE, which GLM-4.5 shares: a dense first layer, then sigmoid routing over `groups` groups of which a
  // token uses `group_topk`, one shared expert, the routed weights renormalised and scaled.
  auto deepseek_moe = [&](int groups, int group_topk) {
    c["moe_intermediate_size"] = s.ffn;
    c["n_routed_experts"] = s.experts;
    c["num_experts_per_tok"] = s.topk;
    c["n_shared_experts"] = 1;
    c["first_k_dense_replace"] = 1;
    c["n_group"] = groups;
    c["topk_group"] = group_topk;
    c["routed_scaling_factor"] = 2.5;
    c["norm_topk_prob"] = true;
    c["pad_token_id"] = 0;
  };
  if (family == "llama") {
    named("LlamaForCausalLM", "llama");
  } else if (family == "mistral") {
    named("MistralForCausalLM", "mistral");
    c["sliding_window"] = nullptr;
  } else if (family == "qwen2") {
    named("Qwen2ForCausalLM", "qwen2");
  } else if (family == "qwen3") {
    named("Qwen3ForCausalLM", "qwen3");
  } else if (family == "phi3") {
    named("Phi3ForCausalLM", "phi3");
    c["sliding_window"] = nullptr;
    c["pad_token_id"] = 0;
  } else if (family == "gemma2" || family == "gemma3") {
    const bool gemma3 = family == "gemma3";
    named(gemma3 ? "Gemma3ForCausalLM" : "Gemma2ForCausalLM", gemma3 ? "gemma3_text" : "gemma2");
    c["hidden_activation"] = "gelu_pytorch_tanh";
    c["query_pre_attn_scalar"] = head_dim;
    c["tie_word_embeddings"] = true;
    c["rms_norm_eps"] = 1e-6;
    c["pad_token_id"] = 0;
    c["sliding_window"] = gemma3 ? 512 : 4096;
    c["layer_types"] = alternating_layer_types(s.layers, gemma3 ? 6 : 2);
    if (gemma3) {
      c.erase("rope_theta");
      c["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 1000000.0}}},
                              {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
    } else {
      c["attn_logit_softcapping"] = 50.0;
      c["final_logit_softcapping"] = 30.0;
    }
  } else if (family == "gemma4") {
    // Gemma 4 as its small models are built: 5 windowed layers to a full one with heads twice as wide whose keys are
    // their values, proportional RoPE there, per-layer inputs of 256, the last third of the layers (from 6) reusing
    // earlier layers' keys and values where a full-attention layer is left before them.
    named("Gemma4ForCausalLM", "gemma4_text");
    c["hidden_activation"] = "gelu_pytorch_tanh";
    c["tie_word_embeddings"] = true;
    c["rms_norm_eps"] = 1e-6;
    c["pad_token_id"] = 0;
    c["sliding_window"] = 512;
    c["layer_types"] = alternating_layer_types(s.layers, 6);
    c["layer_types"].back() = "full_attention";
    c["global_head_dim"] = 2 * head_dim;
    c["attention_k_eq_v"] = true;
    c["num_global_key_value_heads"] = s.kv_heads;
    c["num_kv_shared_layers"] = s.layers - s.layers / 3 >= 6 ? s.layers / 3 : 0;  // with a full layer left before
    c["hidden_size_per_layer_input"] = 256;
    c["vocab_size_per_layer_input"] = s.vocab;
    c["final_logit_softcapping"] = 30.0;
    c.erase("rope_theta");
    c["rope_parameters"] = {
        {"full_attention", {{"rope_type", "proportional"}, {"partial_rotary_factor", 0.25}, {"rope_theta", 1000000.0}}},
        {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
  } else if (family == "olmo2") {
    named("Olmo2ForCausalLM", "olmo2");
  } else if (family == "mixtral") {
    named("MixtralForCausalLM", "mixtral");
    c["num_local_experts"] = s.experts;
    c["num_experts_per_tok"] = s.topk;
    c["sliding_window"] = nullptr;
  } else if (family == "qwen3_moe" || family == "qwen2_moe") {
    const bool qwen2 = family == "qwen2_moe";
    named(qwen2 ? "Qwen2MoeForCausalLM" : "Qwen3MoeForCausalLM", qwen2 ? "qwen2_moe" : "qwen3_moe");
    c["moe_intermediate_size"] = s.ffn;
    c["num_experts"] = s.experts;
    c["num_experts_per_tok"] = s.topk;
    c["norm_topk_prob"] = !qwen2;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = json::array();
    if (qwen2) c["shared_expert_intermediate_size"] = s.ffn;
  } else if (family == "gpt_oss") {
    named("GptOssForCausalLM", "gpt_oss");
    c["num_local_experts"] = s.experts;
    c["num_experts_per_tok"] = s.topk;
    c["sliding_window"] = 128;
    c["layer_types"] = alternating_layer_types(s.layers, 2);
    c["attention_bias"] = true;
    c["pad_token_id"] = 0;
    c.erase("rope_theta");
    c["rope_parameters"] = {{"rope_type", "yarn"},
                            {"rope_theta", 150000.0},
                            {"factor", 32.0},
                            {"beta_fast", 32.0},
                            {"beta_slow", 1.0},
                            {"truncate", false},
                            {"original_max_position_embeddings", 4096}};
  } else if (family == "deepseek_v3") {
    // Multi-latent attention with heads of hidden / heads (half of it rotary), low-rank queries, a dense first layer,
    // sigmoid routing limited to 1 of 2 groups, one shared expert.
    named("DeepseekV3ForCausalLM", "deepseek_v3");
    c["num_key_value_heads"] = s.heads;
    c["q_lora_rank"] = s.hidden / 2;
    c["kv_lora_rank"] = s.hidden / 4;
    c["qk_nope_head_dim"] = head_dim;
    c["qk_rope_head_dim"] = head_dim / 2;
    c["head_dim"] = head_dim / 2;  // transformers' DeepSeek-V3 sizes its rotary tables by head_dim
    c["v_head_dim"] = head_dim;
    deepseek_moe(2, std::max(1, s.topk / 2));
  } else if (family == "glm4_moe") {
    // GLM-4.5's shape: RoPE over half of each head, q/k/v biases, DeepSeek-V3's MoE in one group.
    named("Glm4MoeForCausalLM", "glm4_moe");
    c.erase("rope_theta");
    c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}, {"partial_rotary_factor", 0.5}};
    c["attention_bias"] = true;
    c["use_qk_norm"] = false;
    c["num_nextn_predict_layers"] = 0;
    deepseek_moe(1, 1);
  } else if (family == "qwen3_next" || family == "qwen3_5") {
    // Qwen3-Next / Qwen3.5's hybrid: Gated DeltaNet layers (a key head per two value heads, each of the attention's
    // head size) with gated full attention in every fourth layer (the last, in fewer than four), RoPE over a quarter
    // of each head; Qwen3-Next's MoE with its gated shared expert.
    const bool next = family == "qwen3_next";
    named(next ? "Qwen3NextForCausalLM" : "Qwen3_5ForCausalLM", next ? "qwen3_next" : "qwen3_5_text");
    json types = json::array();
    for (int i = 1; i <= s.layers; ++i)
      types.push_back(i % 4 == 0 || (s.layers < 4 && i == s.layers) ? "full_attention" : "linear_attention");
    c["layer_types"] = types;
    c["linear_num_value_heads"] = s.heads;
    c["linear_num_key_heads"] = std::max(1, s.heads / 2);
    c["linear_key_head_dim"] = head_dim;
    c["linear_value_head_dim"] = head_dim;
    c["linear_conv_kernel_dim"] = 4;
    c["pad_token_id"] = 0;
    c.erase("rope_theta");
    c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25}};
    if (next) {
      c["moe_intermediate_size"] = s.ffn;
      c["num_experts"] = s.experts;
      c["num_experts_per_tok"] = s.topk;
      c["shared_expert_intermediate_size"] = s.ffn;
      c["norm_topk_prob"] = true;
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = json::array();
    }
  } else if (family == "nemotron_h") {
    // Nemotron-H's shape: Mamba-2 mixers of twice the hidden width (heads of the attention's head size, state 64, two
    // groups) alternating with squared-ReLU MLPs, attention in every fourth layer (the last, in fewer than four).
    named("NemotronHForCausalLM", "nemotron_h");
    std::string pattern;
    for (int i = 1; i <= s.layers; ++i)
      pattern += i % 4 == 0 || (s.layers < 4 && i == s.layers) ? '*' : i % 2 ? 'M' : '-';
    c["hybrid_override_pattern"] = pattern;
    c["mamba_num_heads"] = 2 * s.heads;
    c["mamba_head_dim"] = head_dim;
    c["ssm_state_size"] = 64;
    c["n_groups"] = 2;
    c["conv_kernel"] = 4;
    c["chunk_size"] = 128;
    c["layer_norm_epsilon"] = 1e-5;
    c["pad_token_id"] = 0;
    c.erase("rms_norm_eps");
    c.erase("rope_theta");
  } else {
    std::string list;
    for (const auto& f : bench_families()) list += (list.empty() ? "" : ", ") + f;
    return Status::Error("--arch " + family + " is not a family bench train knows (" + list + ")");
  }
  return c;
}

}  // namespace trestle::cli
