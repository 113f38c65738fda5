#include "convert/bridge/bridge_model_json.h"

#include <filesystem>

#include "ckpt/printable_text.h"
#include "convert/bridge/hf_side_files.h"

namespace trestle {

using json = nlohmann::json;

namespace {

// One RoPE parameter block's scaling with all its parameters, as the model description (parallel/layout's
// gpt_spec_from_json) reads it; null when it is not linear or Llama 3.1 scaling.
json rope_scaling_of(const json& r) {
  std::string type;
  for (const char* field : {"rope_type", "type"})
    if (type.empty() && r.contains(field) && r[field].is_string()) type = r[field].get<std::string>();
  if (type != "linear" && type != "llama3") return nullptr;
  json out = {{"type", type}};
  for (const char* field : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
    if (r.contains(field) && r[field].is_number()) out[field] = r[field];
  return out;
}

// The RoPE scaling of a Hugging Face config (rope_scaling, or transformers 5's rope_parameters); null when none.
json rope_scaling_json(const json& raw) {
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!raw.contains(key) || !raw[key].is_object()) continue;
    if (auto out = rope_scaling_of(raw[key]); !out.is_null()) return out;
  }
  return nullptr;
}

// A number field of `object`, or `fallback`.
double number_or(const json& object, const char* key, double fallback) {
  const auto it = object.find(key);
  return it != object.end() && it->is_number() ? it->get<double>() : fallback;
}

// The YaRN parameters of a Hugging Face config (rope_scaling, or transformers 5's rope_parameters); null when its RoPE
// is not YaRN.
const json* yarn_parameters(const json& raw) {
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const auto r = raw.find(key);
    if (r == raw.end() || !r->is_object()) continue;
    std::string type;
    for (const char* field : {"rope_type", "type"})
      if (type.empty() && r->contains(field) && (*r)[field].is_string()) type = (*r)[field].get<std::string>();
    if (type == "yarn") return &*r;
  }
  return nullptr;
}

// Which layers have the window (Megatron's window_attn_skip_freq as a list: 1 for each windowed layer).
void put_window_layers(const GptModelSpec& spec, json& megatron) {
  megatron["mixed_attention"] = spec.mixed_attention;
  if (!spec.mixed_attention) return;
  json layers = json::array();
  for (const bool windowed : spec.window_layers) layers.push_back(windowed ? 1 : 0);
  megatron["window_attn_skip_freq"] = std::move(layers);
}

}  // namespace

json bridged_model_to_json(const BridgedModel& b) {
  const auto& c = b.model.hf;
  const auto& l = b.layout;
  json megatron = {{"num_layers", c.num_layers},
                   {"hidden_size", c.hidden_size},
                   {"ffn_hidden_size", b.model.ffn_hidden_size},
                   {"num_attention_heads", c.num_attention_heads},
                   {"num_query_groups", c.num_kv_heads},
                   {"kv_channels", c.head_dim},
                   {"vocab_size", c.vocab_size},
                   {"padded_vocab_size", padded_vocab_size(c.vocab_size, l.make_vocab_size_divisible_by, l.tp)},
                   {"max_position_embeddings", c.max_position_embeddings},
                   {"untie_embeddings_and_output_weights", !c.tie_word_embeddings},
                   {"add_qkv_bias", b.model.qkv_bias},
                   {"qk_layernorm", b.model.qk_norm},
                   {"normalization", "RMSNorm"},
                   {"swiglu", true},
                   {"position_embedding_type", "rope"}};
  if (c.rope_theta) megatron["rotary_base"] = *c.rope_theta;
  if (b.model.vision_language()) {
    json carried = json::array();
    for (const auto& v : b.model.vision_tensors) carried.push_back({{"name", v.megatron}, {"shape", v.shape}});
    megatron["carried_tensors"] = std::move(carried);
  }
  if (c.norm_eps) megatron["norm_epsilon"] = *c.norm_eps;
  if (auto rope = rope_scaling_json(c.raw); !rope.is_null()) megatron["rope_scaling"] = std::move(rope);
  // Hugging Face's sliding_window w lets a query see w positions, itself included: Megatron's window (w - 1, 0).
  if (const auto w = hf_sliding_window(c.raw)) megatron["window_size"] = json::array({*w - 1, 0});
  if (b.model.gemma) {
    const GptModelSpec spec = megatron_spec(b.model, b.norms);
    megatron["swiglu"] = false;
    megatron["activation"] = "geglu_tanh";
    megatron["layernorm_zero_centered_gamma"] = true;
    megatron["post_layernorms"] = true;
    if (spec.attn_logit_softcapping > 0) megatron["attn_logit_softcapping"] = spec.attn_logit_softcapping;
    if (spec.final_logit_softcapping > 0) megatron["final_logit_softcapping"] = spec.final_logit_softcapping;
    put_window_layers(spec, megatron);
    megatron["query_pre_attn_scalar"] = spec.query_pre_attn_scalar;
    megatron["scale_embeddings"] = true;
    if (spec.rotary_base_local > 0) {
      // Gemma 3: RoPE per kind of layer (transformers 5's rope_parameters.{full,sliding}_attention; earlier configs'
      // rope_theta, rope_scaling and rope_local_base_freq): the full-attention layers' base and scaling, the windowed
      // layers' own base.
      megatron["rope_local_base_freq"] = spec.rotary_base_local;
      if (const json* full = gemma3_rope_block(c.raw, "full_attention")) {
        if (full->contains("rope_theta") && (*full)["rope_theta"].is_number())
          megatron["rotary_base"] = (*full)["rope_theta"];
        if (auto rope = rope_scaling_of(*full); !rope.is_null()) megatron["rope_scaling"] = std::move(rope);
      } else if (!c.rope_theta) {
        megatron["rotary_base"] = 1000000.0;  // transformers' Gemma 3 default for the global layers
      }
    }
  }
  if (b.model.gemma4) {
    // Gemma 4: Gemma's GeGLU and post-norms with plain norms, its per-layer attention sizes, K = V, KV sharing, layer
    // scalars, per-layer inputs and MoE beside the MLP (RoPE per kind of layer is in config.json).
    const GptModelSpec spec = megatron_spec(b.model, b.norms);
    megatron["swiglu"] = false;
    megatron["activation"] = "geglu_tanh";
    megatron["post_layernorms"] = true;
    megatron["scale_embeddings"] = true;
    megatron["softmax_scale"] = spec.softmax_scale;
    megatron["value_norm"] = spec.value_norm;
    if (spec.final_logit_softcapping > 0) megatron["final_logit_softcapping"] = spec.final_logit_softcapping;
    put_window_layers(spec, megatron);
    megatron["rope_local_base_freq"] = spec.rotary_base_local;
    megatron["rotary_base"] = spec.rotary_base;
    megatron["global_rope_fraction"] = spec.global_rope_fraction;
    megatron["layer_kv_channels"] = spec.layer_kv_channels;
    megatron["layer_query_groups"] = spec.layer_query_groups;
    megatron["attention_k_eq_v"] = spec.attention_k_eq_v;
    megatron["kv_shared_layers"] = spec.kv_shared_layers;
    megatron["double_wide_mlp"] = spec.double_wide_mlp;
    megatron["layer_scalar"] = spec.layer_scalar;
    megatron["per_layer_input_size"] = spec.per_layer_input_size;
    megatron["per_layer_vocab_size"] = spec.per_layer_vocab_size;
    megatron["moe_beside_mlp"] = spec.moe_beside_mlp;
  }
  if (b.model.sigmoid_router()) {
    // DeepSeek-V3's and GLM-4.5's MoE (and Nemotron-H's MoE layers): dense first layers, the sigmoid router with its
    // expert bias, groups and scaling, multi-token-prediction layers.
    const GptModelSpec spec = megatron_spec(b.model, b.norms);
    megatron["moe_first_dense_layers"] = spec.moe_first_dense_layers;
    megatron["dense_ffn_hidden_size"] = spec.dense_ffn_hidden_size;
    megatron["mtp_num_layers"] = spec.mtp_num_layers;
    megatron["moe_router_score_function"] = "sigmoid";
    megatron["moe_router_enable_expert_bias"] = true;
    auto integer = [&](const char* key, std::int64_t fallback) {
      const auto it = c.raw.find(key);
      return it != c.raw.end() && it->is_number_integer() ? it->get<std::int64_t>() : fallback;
    };
    megatron["moe_router_num_groups"] = integer("n_group", 1);
    megatron["moe_router_group_topk"] = integer("topk_group", integer("n_group", 1));
    megatron["moe_router_topk_scaling_factor"] = number_or(c.raw, "routed_scaling_factor", 1.0);
  }
  if (b.model.rotary_percent != 1.0) megatron["rotary_percent"] = b.model.rotary_percent;
  if (b.model.deepseek()) {
    const GptModelSpec spec = megatron_spec(b.model, b.norms);
    megatron["kv_channels"] = spec.kv_channels;
    megatron["num_query_groups"] = spec.num_query_groups;
    megatron["multi_latent_attention"] = true;
    megatron["q_lora_rank"] = spec.q_lora_rank;
    megatron["kv_lora_rank"] = spec.kv_lora_rank;
    megatron["qk_head_dim"] = spec.qk_head_dim;
    megatron["qk_pos_emb_head_dim"] = spec.qk_pos_emb_head_dim;
    megatron["v_head_dim"] = spec.v_head_dim;
    if (const json* r = yarn_parameters(c.raw)) {  // YaRN under Megatron-Core's MLA names
      megatron["rope_type"] = "yarn";
      megatron["rotary_scaling_factor"] = number_or(*r, "factor", 1.0);
      for (const char* field :
           {"mscale", "mscale_all_dim", "beta_fast", "beta_slow", "original_max_position_embeddings"})
        if (r->contains(field) && (*r)[field].is_number()) megatron[field] = (*r)[field];
    }
  }
  if (b.model.gpt_oss()) {
    // Megatron-Core's names (Megatron-Bridge's GPT-OSS provider): quick-GELU gated units with the linear half offset
    // by 1 and both halves clamped, biases on every linear layer, the sinks as a learnable softmax offset, windows on
    // every other layer, YaRN under yarn_* names.
    const GptModelSpec spec = megatron_spec(b.model, b.norms);
    megatron["swiglu"] = false;
    megatron["activation"] = "quick_geglu";
    megatron["glu_linear_offset"] = 1.0;
    megatron["activation_func_clamp_value"] = number_or(c.raw, "swiglu_limit", 7.0);
    megatron["add_bias_linear"] = true;
    megatron["softmax_type"] = "learnable";
    megatron["mixed_attention"] = spec.mixed_attention;
    if (spec.mixed_attention) megatron["window_attn_skip_freq"] = 2;
    megatron["moe_router_load_balancing_type"] = "none";
    if (const json* r = yarn_parameters(c.raw)) {
      megatron["position_embedding_type"] = "yarn";
      megatron["yarn_rotary_scaling_factor"] = number_or(*r, "factor", 1.0);
      megatron["yarn_original_max_position_embeddings"] = number_or(*r, "original_max_position_embeddings", 4096);
      megatron["yarn_beta_fast"] = number_or(*r, "beta_fast", 32.0);
      megatron["yarn_beta_slow"] = number_or(*r, "beta_slow", 1.0);
      megatron["yarn_correction_range_round_to_int"] =
          r->contains("truncate") && (*r)["truncate"].is_boolean() ? (*r)["truncate"].get<bool>() : true;
    }
  }
  if (b.model.gated_delta_net) {
    // Qwen3-Next / Qwen3.5 under Megatron-Core's names (Megatron-Bridge's Qwen3-Next provider): zero-centred norms,
    // the gated attention output, Gated DeltaNet layers where linear_attention_freq has a 1.
    const GptModelSpec spec = megatron_spec(b.model, b.norms);
    megatron["layernorm_zero_centered_gamma"] = true;
    megatron["attention_output_gate"] = true;
    megatron["experimental_attention_variant"] = "gated_delta_net";
    json layers = json::array();
    for (const bool linear : spec.linear_attention_layers) layers.push_back(linear ? 1 : 0);
    megatron["linear_attention_freq"] = std::move(layers);
    megatron["linear_conv_kernel_dim"] = spec.linear_conv_kernel_dim;
    megatron["linear_key_head_dim"] = spec.linear_key_head_dim;
    megatron["linear_value_head_dim"] = spec.linear_value_head_dim;
    megatron["linear_num_key_heads"] = spec.linear_num_key_heads;
    megatron["linear_in_proj_split"] = spec.linear_in_proj_split;
    megatron["linear_num_value_heads"] = spec.linear_num_value_heads;
    megatron["mtp_num_layers"] = spec.mtp_num_layers;
  }
  if (b.model.nemotron_h()) {
    // Nemotron-H under Megatron-Core's MambaModel names: the hybrid pattern, the Mamba-2 sizes, squared-ReLU MLPs, no
    // position embedding.
    megatron["swiglu"] = false;
    megatron["activation"] = "squared_relu";
    megatron["position_embedding_type"] = "none";
    megatron["hybrid_override_pattern"] = b.model.hybrid_layers;
    megatron["mamba_num_heads"] = b.model.mamba_num_heads;
    megatron["mamba_head_dim"] = b.model.mamba_head_dim;
    megatron["mamba_state_dim"] = b.model.mamba_state_dim;
    megatron["mamba_num_groups"] = b.model.mamba_num_groups;
    megatron["mamba_conv_kernel"] = b.model.mamba_conv_kernel;
    if (b.model.moe_latent_size > 0) megatron["moe_latent_size"] = b.model.moe_latent_size;
  }
  if (b.model.olmo2) {
    megatron["pre_layernorms"] = false;
    megatron["post_layernorms"] = true;
    megatron["qk_layernorm_full_projection"] = true;
  }
  if (b.model.is_moe()) {
    megatron["num_experts"] = c.num_experts;
    megatron["moe_router_topk"] = c.experts_per_token;
    megatron["moe_ffn_hidden_size"] = b.model.ffn_hidden_size;
    if (b.model.shared_expert_ffn_hidden_size > 0) {
      megatron["moe_shared_expert_intermediate_size"] = b.model.shared_expert_ffn_hidden_size;
      megatron["moe_shared_expert_gate"] = megatron_spec(b.model, b.norms).shared_expert_gate;
    }
    // Mixtral, Qwen3.5-MoE and Qwen3-VL-MoE (whose configs have no norm_topk_prob: transformers' routers always
    // renormalise), Gemma 4 and the Qwen MoEs with norm_topk_prob renormalise the top-k softmax weights, and GPT-OSS
    // takes the softmax of the top-k logits: both equal Megatron's default softmax over the top-k logits; without
    // renormalisation the softmax comes first.
    const bool norm_topk =
        c.raw.contains("norm_topk_prob") && c.raw["norm_topk_prob"].is_boolean() && c.raw["norm_topk_prob"].get<bool>();
    const bool always_renormalises = b.model.architecture == "Qwen3_5MoeForCausalLM" ||
                                     b.model.architecture == "Qwen3VLMoeForConditionalGeneration";
    const bool renormalised = b.model.moe == MoeStyle::kMixtral || b.model.moe == MoeStyle::kGemma4 ||
                              b.model.gpt_oss() || norm_topk || always_renormalises;
    megatron["moe_router_pre_softmax"] = !renormalised;
  }
  json parallel = layout_to_json(l);
  parallel["norm_naming"] = norm_naming_name(b.norms);
  json hf = {{"config", c.file()}, {"expert_layout", expert_layout_name(b.experts)}, {"side_files", b.side_files}};
  if (b.model.vision_tower_nested) hf["vision_tower_names"] = "nested";
  return {{"architecture", b.model.architecture},
          {"megatron", megatron},
          {"parallel", parallel},
          {"hf", hf}};
}

Result<json> checked_bridged_model_json(const BridgedModel& bridged, const std::string& destination) {
  json model = bridged_model_to_json(bridged);
  const std::string source = destination + " (the model description to be written)";
  TRESTLE_RETURN_IF_ERROR(bridged_model_from_json(model, source).status());
  TRESTLE_RETURN_IF_ERROR(gpt_spec_from_json(model, source).status());
  return model;
}

Result<BridgedModel> bridged_model_from_json(const json& model, const std::string& source) {
  if (!model.is_object() || !model.contains("hf") || !model["hf"].is_object() || !model["hf"].contains("config"))
    return Status::Error(source +
                         ": the manifest's model has no Hugging Face config (model.hf.config); it was not "
                         "written by the Hugging Face bridge");
  BridgedModel b;
  TRESTLE_ASSIGN_OR_RETURN(auto config, parse_hf_config(model["hf"]["config"], source + " (model.hf.config)"));
  TRESTLE_ASSIGN_OR_RETURN(b.model, bridge_model_from_config(config));
  if (carries_towers_as_found(b.model)) {  // which tower tensors the checkpoint holds: its description says
    TRESTLE_ASSIGN_OR_RETURN(const GptModelSpec described, gpt_spec_from_json(model, source));
    TRESTLE_RETURN_IF_ERROR(carry_towers_described(b.model, described.carried_tensors));
  }
  // What the checkpoint holds beyond its config: DeepSeek's, GLM's and Qwen3-Next's multi-token-prediction layers.
  if (b.model.has_mtp() && model.contains("megatron") && model["megatron"].is_object()) {
    const auto mtp = model["megatron"].find("mtp_num_layers");
    if (mtp != model["megatron"].end() && mtp->is_number_integer() && mtp->get<std::int64_t>() >= 0)
      b.model.mtp_layers = mtp->get<std::int64_t>();
  }
  if (model.contains("parallel")) {
    const json& parallel = model["parallel"];
    TRESTLE_ASSIGN_OR_RETURN(b.layout, layout_from_json(parallel, source + " (model.parallel)"));
    if (parallel.is_object() && parallel.contains("norm_naming")) {
      const json& naming = parallel["norm_naming"];
      if (naming != "local" && naming != "transformer_engine")
        return Status::Error(source + ": model.parallel.norm_naming is " + naming.dump() +
                             ", not \"transformer_engine\" or \"local\"");
      if (naming == "local") b.norms = NormNaming::kLocal;
    }
  }
  if (model["hf"].contains("expert_layout")) {
    const json& layout = model["hf"]["expert_layout"];
    const auto experts = layout.is_string() ? expert_layout_from_name(layout.get<std::string>()) : std::nullopt;
    if (!experts)
      return Status::Error(source + ": model.hf.expert_layout is " + layout.dump() +
                           ", not \"original\", \"fused\" or \"fused_transposed\"");
    b.experts = *experts;
  }
  if (const auto v = model["hf"].find("vision_tower_names"); v != model["hf"].end()) {
    if (*v != "nested" && *v != "flat")
      return Status::Error(source + ": model.hf.vision_tower_names is " + v->dump() + ", not \"nested\" or \"flat\"");
    name_vision_tower(b.model, *v == "nested");
  }
  if (const auto files = model["hf"].find("side_files"); files != model["hf"].end() && !files->is_null()) {
    if (!files->is_array())
      return Status::Error(source + ": model.hf.side_files is " + files->dump(-1).substr(0, 80) +
                           ", not a list of file names");
    for (const auto& f : *files) {
      if (!f.is_string())
        return Status::Error(source + ": model.hf.side_files holds " + f.dump(-1).substr(0, 80) + ", not a file name");
      const std::string name = f.get<std::string>();
      if (!is_side_file_name(name))
        return Status::Error(source + ": model.hf.side_files holds '" + printable_text(name).substr(0, 200) +
                             "', not a plain file name (or one in " + kChatTemplatesDir + "/)");
      if (!is_hf_side_file(std::filesystem::path(name).filename().string()))  // a converter writes these itself
        return Status::Error(source + ": model.hf.side_files holds '" + printable_text(name) +
                             "', which cannot be a side file: config.json, a weights file or a hidden one");
      b.side_files.push_back(name);
    }
  }
  return b;
}

void set_config_dtype(nlohmann::json& config, DType dtype) {
  const std::string torch = std::string(torch_name(dtype)).substr(6);  // "torch.bfloat16" -> "bfloat16"
  bool set = false;
  for (const char* key : {"dtype", "torch_dtype"})
    if (config.contains(key)) {
      config[key] = torch;
      set = true;
    }
  if (!set) config["torch_dtype"] = torch;
}

void set_model_dtype(HfModelConfig& config, DType dtype) {
  set_config_dtype(config.raw, dtype);
  if (!config.given.is_null()) set_config_dtype(config.given, dtype);
  if (config.outer.is_null()) return;
  set_config_dtype(config.outer, dtype);
  for (const char* nested : {"text_config", "vision_config"})  // a vision-language model's parts that say it too
    if (config.outer.contains(nested) && config.outer[nested].is_object() &&
        (config.outer[nested].contains("dtype") || config.outer[nested].contains("torch_dtype")))
      set_config_dtype(config.outer[nested], dtype);
}

nlohmann::ordered_json export_hf_config(const BridgedModel& b, std::optional<DType> cast_to) {
  HfModelConfig c = b.model.hf;
  if (cast_to) set_model_dtype(c, *cast_to);
  const nlohmann::json& config = c.file();
  return nlohmann::ordered_json::parse(config.dump());
}

}  // namespace trestle
