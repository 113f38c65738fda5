#include "convert/bridge/megatron_args.h"

#include <algorithm>
#include <utility>

#include "parallel/layout/pipeline_layout_string.h"

namespace trestle {
namespace {

using json = nlohmann::json;

// Megatron-LM's args as the readers below see them: an absent key (or None) gives the fallback; a value of another type
// than the key's is noted (the first one) and gives the fallback too, and `checked` turns the note into the error.
struct Args {
  const PickleValue* ns;
  std::string source;
  mutable std::string wrong_type;

  const PickleValue* get(const char* key) const {
    const PickleValue* v = ns->attr(key);
    return v && !v->is(PickleKind::kNone) ? v : nullptr;
  }
  // The value of `key` when it has one of the kinds given; nullptr (noting a value of another kind) otherwise.
  const PickleValue* typed(const char* key, std::initializer_list<PickleKind> kinds, const char* expected) const {
    const PickleValue* v = get(key);
    if (!v) return nullptr;
    for (const PickleKind kind : kinds)
      if (v->is(kind)) return v;
    if (wrong_type.empty())
      wrong_type = source + ": args." + key + " is " + pickle_repr(v, 80) + ", expected " + expected;
    return nullptr;
  }
  // `result`, unless a value of the wrong type was read on the way to it (the likelier cause of what went wrong).
  template <typename T>
  Result<T> checked(Result<T> result) const {
    if (!wrong_type.empty()) return Status::Error(wrong_type);
    return result;
  }
  Result<std::int64_t> integer(const char* key) const {
    const PickleValue* v = get(key);
    if (!v) return Status::Error(source + ": args has no '" + key + "'; give the model's config.json with --hf-config");
    return pickle_int(v, source + ": args." + key);
  }
  std::int64_t integer_or(const char* key, std::int64_t fallback) const {
    const PickleValue* v = typed(key, {PickleKind::kInt}, "an integer");
    return v ? v->integer : fallback;
  }
  bool flag(const char* key, bool fallback = false) const {
    const PickleValue* v = typed(key, {PickleKind::kBool}, "True or False");
    return v ? v->boolean : fallback;
  }
  std::optional<double> real(const char* key) const {
    const PickleValue* v = typed(key, {PickleKind::kFloat, PickleKind::kInt}, "a number");
    if (!v) return std::nullopt;
    return v->is(PickleKind::kFloat) ? v->real : static_cast<double>(v->integer);
  }
  std::string text(const char* key, const std::string& fallback) const {
    const PickleValue* v = typed(key, {PickleKind::kString}, "a string");
    return v ? v->text : fallback;
  }
};

// The RoPE block Megatron-LM's arguments describe (rope_scaling, else transformers 5's rope_parameters: the first that
// is an object; null when neither is) and its type ("default" when it names none).
std::pair<const json*, std::string> rope_block(const json& raw) {
  const json* rope = nullptr;
  for (const char* key : {"rope_scaling", "rope_parameters"})
    if (!rope && raw.contains(key) && raw[key].is_object()) rope = &raw[key];
  std::string type = "default";
  for (const char* field : {"rope_type", "type"})
    if (rope && rope->contains(field) && (*rope)[field].is_string()) type = (*rope)[field].get<std::string>();
  return {rope, type};
}

Status check_expressible(const Args& a) {
  auto refuse = [&](const std::string& what) {
    return Status::Error(a.source + ": args describe " + what +
                         ", which the Hugging Face bridge does not convert (it supports RMSNorm + SwiGLU + RoPE GPT "
                         "models: Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen2/3-MoE, from the args alone); for "
                         "another family, give the model's config.json with --hf-config");
  };
  // Families whose layers Megatron-LM's arguments do not describe whole: Trestle names them when it writes the args.
  if (const std::string family = a.text("trestle_family", ""); !family.empty())
    return Status::Error(a.source + ": args describe " + family +
                         " layers, which Megatron-LM's arguments do not fully express; keep trestle_model.json beside "
                         "the checkpoint or give the model's config.json with --hf-config");
  if (const std::string variant = a.text("experimental_attention_variant", ""); !variant.empty())
    return Status::Error(a.source + ": args describe " + variant +
                         " attention layers (Qwen3-Next / Qwen3.5), whose Hugging Face config Megatron-LM's arguments "
                         "do not fully express; give the model's config.json with --hf-config");
  if (!a.flag("swiglu")) return refuse("an MLP without swiglu");
  if (a.text("normalization", "RMSNorm") != "RMSNorm") return refuse("normalization " + a.text("normalization", ""));
  if (a.text("position_embedding_type", "rope") != "rope")
    return refuse("position embeddings " + a.text("position_embedding_type", ""));
  if (a.flag("add_bias_linear")) return refuse("biases on linear layers (add_bias_linear)");
  return OkStatus();
}

// The arguments that change what a Llama / Mistral / Qwen2/3 / Mixtral / Qwen2/3-MoE model computes and that those
// families' configs cannot say: refused by name, so that no such checkpoint converts into a model computing otherwise
// (rotary_percent 0.5 converted as RoPE over whole heads: logits off by 11). `qwen_moe`: the experts are Qwen2/3-MoE's,
// whose norm_topk_prob says moe_router_pre_softmax.
Status check_dense_family_args(const Args& a, bool moe, bool qwen_moe) {
  auto refuse = [&](const std::string& what) {
    return Status::Error(a.source + ": args describe " + what +
                         ", which the config of the family the args name (Llama, Mistral, Qwen2/3, Mixtral, "
                         "Qwen2/3-MoE) cannot say; give the model's config.json with --hf-config");
  };
  if (const auto p = a.real("rotary_percent"); p && *p != 1.0)
    return refuse("RoPE over part of each head (rotary_percent " + pickle_repr(a.get("rotary_percent")) + ")");
  if (a.flag("rotary_interleaved")) return refuse("interleaved RoPE (rotary_interleaved)");
  if (a.get("no_rope_freq"))
    return refuse("layers without RoPE (no_rope_freq " + pickle_repr(a.get("no_rope_freq")) + ")");
  if (a.flag("qk_l2_norm")) return refuse("L2-normalised queries and keys (qk_l2_norm)");
  if (a.flag("apply_layernorm_1p")) return refuse("(1 + w) norms (apply_layernorm_1p)");
  if (a.flag("attention_output_gate")) return refuse("gated attention outputs (attention_output_gate)");
  if (a.get("softmax_scale")) return refuse("an attention softmax scale of its own (softmax_scale)");
  if (a.text("softmax_type", "vanilla") != "vanilla")
    return refuse("attention softmax " + a.text("softmax_type", "") + " (softmax_type)");
  if (a.get("window_size") && a.get("window_attn_skip_freq"))
    return refuse("windows on some layers only (window_attn_skip_freq " + pickle_repr(a.get("window_attn_skip_freq")) +
                  ")");
  if (!moe) return OkStatus();
  if (a.text("moe_router_score_function", "softmax") != "softmax")
    return refuse("a " + a.text("moe_router_score_function", "") + " router (moe_router_score_function)");
  if (const auto f = a.real("moe_router_topk_scaling_factor"); f && *f != 1.0)
    return refuse("routing weights scaled by " + pickle_repr(a.get("moe_router_topk_scaling_factor")) +
                  " (moe_router_topk_scaling_factor)");
  if (a.flag("moe_router_enable_expert_bias")) return refuse("a router expert bias (moe_router_enable_expert_bias)");
  if (a.get("moe_router_num_groups")) return refuse("group-limited routing (moe_router_num_groups)");
  if (a.flag("moe_router_pre_softmax") && !qwen_moe)
    return refuse(
        "the softmax over every expert before the top-k (moe_router_pre_softmax), which Mixtral's router "
        "renormalises after");
  if (const PickleValue* freq = a.get("moe_layer_freq")) {
    auto one = [](const PickleValue* v) { return v->is(PickleKind::kInt) && v->integer == 1; };
    const bool every = freq->is_sequence() ? std::all_of(freq->items.begin(), freq->items.end(), one) : one(freq);
    if (!every) return refuse("dense layers between MoE layers (moe_layer_freq " + pickle_repr(freq) + ")");
  }
  return OkStatus();
}

// DeepSeek-V3's config from Megatron-LM's multi-latent-attention, MoE and YaRN arguments.
Result<json> deepseek_config_from_args(const Args& a, json c, std::int64_t layers, std::int64_t ffn) {
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t experts, a.integer("num_experts"));
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t kv_lora, a.integer("kv_lora_rank"));
  c["intermediate_size"] = ffn;
  const std::int64_t expert_ffn = a.integer_or("moe_ffn_hidden_size", ffn);
  // moe_layer_freq: 1 (every layer MoE) or a list of 0 (dense) / 1 (MoE) per layer, the dense ones first.
  std::int64_t dense = 0;
  if (const PickleValue* freq = a.get("moe_layer_freq"); freq && freq->is_sequence()) {
    if (static_cast<std::int64_t>(freq->items.size()) != layers)
      return Status::Error(a.source + ": args.moe_layer_freq has " + std::to_string(freq->items.size()) +
                           " entries for " + std::to_string(layers) + " layers");
    bool moe_seen = false;
    for (const PickleValue* v : freq->items) {
      const bool moe = v->is(PickleKind::kInt) && v->integer == 1;
      if (!v->is(PickleKind::kInt) || (v->integer != 0 && !moe) || (!moe && moe_seen))
        return Status::Error(a.source + ": args.moe_layer_freq " + pickle_repr(freq) +
                             " is not dense layers followed by MoE layers (DeepSeek's first_k_dense_replace)");
      moe_seen |= moe;
      if (!moe) ++dense;
    }
  } else if (a.integer_or("moe_layer_freq", 1) != 1) {
    return Status::Error(a.source + ": args.moe_layer_freq " + std::to_string(a.integer_or("moe_layer_freq", 1)) +
                         " (MoE every few layers) is not DeepSeek's layout");
  }
  if (a.text("moe_router_score_function", "softmax") != "sigmoid" || !a.flag("moe_router_enable_expert_bias"))
    return Status::Error(a.source +
                         ": args describe multi-latent attention without DeepSeek-V3's router (sigmoid scores with "
                         "the expert bias), which the Hugging Face bridge does not convert");
  const std::int64_t shared = a.integer_or("moe_shared_expert_intermediate_size", 0);
  if (expert_ffn <= 0 || shared % expert_ffn != 0)
    return Status::Error(a.source + ": args.moe_shared_expert_intermediate_size " + std::to_string(shared) +
                         " is not a whole number of experts of " + std::to_string(expert_ffn));
  const std::int64_t q_lora = a.integer_or("q_lora_rank", 0);
  c["architectures"] = json::array({"DeepseekV3ForCausalLM"});
  c["model_type"] = "deepseek_v3";
  c["num_key_value_heads"] = c["num_attention_heads"];
  c["q_lora_rank"] = q_lora > 0 ? json(q_lora) : json(nullptr);
  c["kv_lora_rank"] = kv_lora;
  c["qk_nope_head_dim"] = a.integer_or("qk_head_dim", 128);
  c["qk_rope_head_dim"] = a.integer_or("qk_pos_emb_head_dim", 64);
  c["v_head_dim"] = a.integer_or("v_head_dim", 128);
  c["head_dim"] = c["qk_rope_head_dim"];
  c["n_routed_experts"] = experts;
  c["num_experts_per_tok"] = a.integer_or("moe_router_topk", 2);
  c["moe_intermediate_size"] = expert_ffn;
  c["n_shared_experts"] = shared / expert_ffn;
  c["first_k_dense_replace"] = dense;
  c["n_group"] = a.integer_or("moe_router_num_groups", 1);
  c["topk_group"] = a.integer_or("moe_router_group_topk", a.integer_or("moe_router_num_groups", 1));
  c["routed_scaling_factor"] = a.real("moe_router_topk_scaling_factor").value_or(1.0);
  c["norm_topk_prob"] = true;
  c["scoring_func"] = "sigmoid";
  c["topk_method"] = "noaux_tc";
  c["rope_interleave"] = true;
  c["num_nextn_predict_layers"] = a.integer_or("mtp_num_layers", 0);
  if (a.text("rope_type", "yarn") == "yarn") {
    json rope = {{"rope_type", "yarn"},
                 {"rope_theta", c["rope_theta"]},
                 {"factor", a.real("rotary_scaling_factor").value_or(40.0)},
                 {"original_max_position_embeddings", a.integer_or("original_max_position_embeddings", 4096)},
                 {"beta_fast", a.real("beta_fast").value_or(32.0)},
                 {"beta_slow", a.real("beta_slow").value_or(1.0)},
                 {"mscale", a.real("mscale").value_or(1.0)},
                 {"mscale_all_dim", a.real("mscale_all_dim").value_or(0.0)}};
    c["rope_scaling"] = std::move(rope);
  }
  return c;
}

Result<json> hf_config_from_args(const Args& a) {
  TRESTLE_RETURN_IF_ERROR(check_expressible(a));
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t layers, a.integer("num_layers"));
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t hidden, a.integer("hidden_size"));
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t heads, a.integer("num_attention_heads"));
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t ffn, a.integer("ffn_hidden_size"));
  for (const auto& [name, value] : {std::pair<const char*, std::int64_t>{"num_layers", layers},
                                    {"hidden_size", hidden},
                                    {"num_attention_heads", heads},
                                    {"ffn_hidden_size", ffn}})
    if (value <= 0)
      return Status::Error(a.source + ": args." + name + " is " + std::to_string(value) +
                           "; expected a positive number");
  const std::int64_t groups = a.flag("group_query_attention") ? a.integer_or("num_query_groups", heads) : heads;
  std::int64_t vocab = a.integer_or("vocab_size", 0);
  if (vocab <= 0) vocab = a.integer_or("padded_vocab_size", 0);
  if (vocab <= 0)
    return Status::Error(a.source + ": args has neither vocab_size nor padded_vocab_size; give --hf-config");
  const std::int64_t experts = a.integer_or("num_experts", 0);
  const bool qk_norm = a.flag("qk_layernorm");
  json c = {{"hidden_size", hidden},
            {"num_hidden_layers", layers},
            {"num_attention_heads", heads},
            {"num_key_value_heads", groups},
            {"head_dim", a.integer_or("kv_channels", hidden / heads)},
            {"vocab_size", vocab},
            {"max_position_embeddings", a.integer_or("max_position_embeddings", 4096)},
            {"tie_word_embeddings", !a.flag("untie_embeddings_and_output_weights")},
            {"rms_norm_eps", a.real("norm_epsilon").value_or(1e-5)},
            {"rope_theta", a.real("rotary_base").value_or(10000.0)},
            {"hidden_act", "silu"},
            {"torch_dtype", a.flag("bf16")   ? "bfloat16"
                            : a.flag("fp16") ? "float16"
                                             : "float32"}};
  if (a.flag("multi_latent_attention")) return deepseek_config_from_args(a, std::move(c), layers, ffn);
  TRESTLE_RETURN_IF_ERROR(
      check_dense_family_args(a, experts > 0, a.integer_or("moe_shared_expert_intermediate_size", 0) > 0 || qk_norm));
  std::string arch = "LlamaForCausalLM", type = "llama";
  if (experts > 0) {
    const std::int64_t expert_ffn = a.integer_or("moe_ffn_hidden_size", ffn);
    c["num_experts_per_tok"] = a.integer_or("moe_router_topk", 2);
    const std::int64_t shared = a.integer_or("moe_shared_expert_intermediate_size", 0);
    if (shared > 0) {  // a shared expert (with its gate): Qwen2-MoE
      arch = "Qwen2MoeForCausalLM", type = "qwen2_moe";
      c["num_experts"] = experts;
      c["moe_intermediate_size"] = expert_ffn;
      c["intermediate_size"] = expert_ffn;
      c["shared_expert_intermediate_size"] = shared;
      c["norm_topk_prob"] = !a.flag("moe_router_pre_softmax");
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = json::array();
    } else if (qk_norm) {
      arch = "Qwen3MoeForCausalLM", type = "qwen3_moe";
      c["num_experts"] = experts;
      c["moe_intermediate_size"] = expert_ffn;
      c["intermediate_size"] = expert_ffn;
      c["norm_topk_prob"] = !a.flag("moe_router_pre_softmax");
    } else {
      arch = "MixtralForCausalLM", type = "mixtral";
      c["num_local_experts"] = experts;
      c["intermediate_size"] = expert_ffn;
    }
  } else {
    c["intermediate_size"] = ffn;
    if (qk_norm) arch = "Qwen3ForCausalLM", type = "qwen3";
    else if (a.flag("add_qkv_bias")) arch = "Qwen2ForCausalLM", type = "qwen2";
  }
  // Megatron-Core's RoPE scaling: Llama 3.1's (its other parameters fixed at 1, 4 and 8192) or linear interpolation.
  if (a.flag("use_rope_scaling"))
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", a.real("rope_scaling_factor").value_or(8.0)},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 8192}};
  else if (const auto f = a.real("rotary_seq_len_interpolation_factor"); f && *f != 1.0)
    c["rope_scaling"] = {{"rope_type", "linear"}, {"factor", *f}};
  // Megatron's window_size (left, right) lets a query see left + 1 positions (itself and `left` before it); Mistral's
  // and Mixtral's sliding_window counts them all: sliding_window = left + 1.
  if (const PickleValue* w = a.get("window_size");
      w && w->is_sequence() && !w->items.empty() && w->items[0]->is(PickleKind::kInt) && w->items[0]->integer >= 0) {
    c["sliding_window"] = w->items[0]->integer + 1;
    if (arch == "LlamaForCausalLM") arch = "MistralForCausalLM", type = "mistral";
    if (arch != "MistralForCausalLM" && arch != "MixtralForCausalLM")
      return Status::Error(a.source + ": args describe sliding-window attention (window_size) in a " + arch +
                           ", which the Hugging Face bridge carries only for Mistral and Mixtral");
  }
  c["architectures"] = json::array({arch});
  c["model_type"] = type;
  return c;
}

// Sets args field `key` to `v`, replacing a value already put.
void set_field(PickleDocument& doc, std::vector<std::pair<PickleValue*, PickleValue*>>& fields, const std::string& key,
               PickleValue* v) {
  for (auto& [k, value] : fields)
    if (k->text == key) {
      value = v;
      return;
    }
  fields.emplace_back(doc.string(key), v);
}

// The MoE DeepSeek-V3 and GLM-4.5 share (and Nemotron-H's MoE layers), as Megatron-LM's arguments name it (dense first
// layers in moe_layer_freq, ungated shared experts, the sigmoid router with its expert bias, groups and scaling,
// multi-token prediction). They replace the dense model's values already put for the same names.
void put_deepseek_moe_args(PickleDocument& doc, const BridgedModel& b,
                           std::vector<std::pair<PickleValue*, PickleValue*>>& fields) {
  const json megatron = bridged_model_to_json(b)["megatron"];
  auto put = [&](const std::string& key, PickleValue* v) { set_field(doc, fields, key, v); };
  auto number = [&](const json& v) { return v.is_number_integer() ? doc.integer(v.get<std::int64_t>()) : doc.real(v.get<double>()); };
  const std::int64_t layers = b.model.hf.num_layers, dense = b.model.first_dense_layers;
  put("ffn_hidden_size", doc.integer(b.model.dense_ffn_hidden_size));
  if (dense > 0) {
    std::vector<PickleValue*> freq;
    for (std::int64_t i = 0; i < layers; ++i) freq.push_back(doc.integer(i < dense ? 0 : 1));
    put("moe_layer_freq", doc.list(std::move(freq)));
  } else {
    put("moe_layer_freq", doc.integer(1));
  }
  put("moe_shared_expert_intermediate_size", b.model.shared_expert_ffn_hidden_size > 0
                                                 ? doc.integer(b.model.shared_expert_ffn_hidden_size)
                                                 : doc.none());
  put("moe_shared_expert_gate", doc.boolean(false));
  put("moe_router_score_function", doc.string("sigmoid"));
  put("moe_router_enable_expert_bias", doc.boolean(true));
  // (no effect with sigmoid scores; Megatron-Bridge's settings: true for DeepSeek-V3, false for GLM-4.5)
  put("moe_router_pre_softmax", doc.boolean(b.model.deepseek()));
  put("moe_router_num_groups", number(megatron["moe_router_num_groups"]));
  put("moe_router_group_topk", number(megatron["moe_router_group_topk"]));
  put("moe_router_topk_scaling_factor", doc.real(megatron["moe_router_topk_scaling_factor"].get<double>()));
  put("mtp_num_layers", b.model.mtp_layers > 0 ? doc.integer(b.model.mtp_layers) : doc.none());
}

// DeepSeek-V3's multi-latent attention and YaRN as Megatron-LM names them (what Megatron-LM has no flag for, such as
// YaRN's beta_fast, is still read from args by core_transformer_config_from_args).
void put_deepseek_args(PickleDocument& doc, const BridgedModel& b,
                       std::vector<std::pair<PickleValue*, PickleValue*>>& fields) {
  const json megatron = bridged_model_to_json(b)["megatron"];
  auto put = [&](const std::string& key, PickleValue* v) { set_field(doc, fields, key, v); };
  auto number = [&](const json& v) { return v.is_number_integer() ? doc.integer(v.get<std::int64_t>()) : doc.real(v.get<double>()); };
  put("multi_latent_attention", doc.boolean(true));
  put("q_lora_rank", b.model.q_lora_rank > 0 ? doc.integer(b.model.q_lora_rank) : doc.none());
  put("kv_lora_rank", doc.integer(b.model.kv_lora_rank));
  put("qk_head_dim", doc.integer(b.model.qk_nope_head_dim));
  put("qk_pos_emb_head_dim", doc.integer(b.model.qk_rope_head_dim));
  put("v_head_dim", doc.integer(b.model.v_head_dim));
  put("kv_channels", doc.integer(b.model.v_head_dim));
  put("group_query_attention", doc.boolean(false));
  put("num_query_groups", doc.integer(b.model.hf.num_attention_heads));
  put("qk_layernorm", doc.boolean(true));
  const bool yarn = megatron.value("rope_type", std::string("rope")) == "yarn";
  put("rope_type", doc.string(yarn ? "yarn" : "rope"));
  put("use_rope_scaling", doc.boolean(false));
  if (yarn) {
    put("rotary_scaling_factor", doc.real(megatron["rotary_scaling_factor"].get<double>()));
    for (const char* key : {"mscale", "mscale_all_dim", "beta_fast", "beta_slow", "original_max_position_embeddings"})
      if (megatron.contains(key)) put(key, number(megatron[key]));
  }
}

// GPT-OSS's arguments as Megatron-LM names them (--quick-geglu, --glu-linear-offset, --activation-func-clamp-value,
// --softmax-type learnable, --window-attn-skip-freq, --disable-bias-linear off) and its YaRN under the yarn_* names
// Megatron-Core's GPT model reads.
void put_gpt_oss_args(PickleDocument& doc, const BridgedModel& b,
                      std::vector<std::pair<PickleValue*, PickleValue*>>& fields) {
  const json megatron = bridged_model_to_json(b)["megatron"];
  auto put = [&](const std::string& key, PickleValue* v) { set_field(doc, fields, key, v); };
  put("swiglu", doc.boolean(false));
  put("quick_geglu", doc.boolean(true));
  put("add_bias_linear", doc.boolean(true));
  put("glu_linear_offset", doc.real(1.0));
  put("activation_func_clamp_value", doc.real(megatron["activation_func_clamp_value"].get<double>()));
  put("softmax_type", doc.string("learnable"));
  put("window_attn_skip_freq", megatron.value("mixed_attention", false) ? doc.integer(2) : doc.none());
  put("moe_router_load_balancing_type", doc.string("none"));
  if (megatron.value("position_embedding_type", std::string("rope")) == "yarn") {
    put("position_embedding_type", doc.string("yarn"));
    for (const char* key : {"yarn_rotary_scaling_factor", "yarn_beta_fast", "yarn_beta_slow"})
      put(key, doc.real(megatron[key].get<double>()));
    put("yarn_original_max_position_embeddings",
        doc.integer(static_cast<std::int64_t>(megatron["yarn_original_max_position_embeddings"].get<double>())));
    put("yarn_correction_range_round_to_int", doc.boolean(megatron["yarn_correction_range_round_to_int"].get<bool>()));
  }
}

// Qwen3-Next / Qwen3.5's Gated DeltaNet hybrid under TransformerConfig's names (Megatron-LM's
// --experimental-attention-variant, --linear-attention-freq, --linear-*, --attention-output-gate, --apply-layernorm-1p).
void put_gated_delta_net_args(PickleDocument& doc, const BridgedModel& b,
                              std::vector<std::pair<PickleValue*, PickleValue*>>& fields) {
  auto put = [&](const std::string& key, PickleValue* v) { set_field(doc, fields, key, v); };
  put("apply_layernorm_1p", doc.boolean(true));
  put("attention_output_gate", doc.boolean(true));
  put("experimental_attention_variant", doc.string("gated_delta_net"));
  std::vector<PickleValue*> freq;
  for (const bool linear : b.model.linear_layers) freq.push_back(doc.integer(linear ? 1 : 0));
  put("linear_attention_freq", doc.list(std::move(freq)));
  put("linear_conv_kernel_dim", doc.integer(b.model.linear_conv_kernel_dim));
  put("linear_key_head_dim", doc.integer(b.model.linear_key_head_dim));
  put("linear_value_head_dim", doc.integer(b.model.linear_value_head_dim));
  put("linear_num_key_heads", doc.integer(b.model.linear_num_key_heads));
  put("linear_num_value_heads", doc.integer(b.model.linear_num_value_heads));
  put("mtp_num_layers", b.model.mtp_layers > 0 ? doc.integer(b.model.mtp_layers) : doc.none());
}

// Nemotron-H as Megatron-LM's arguments for a MambaModel name it (--hybrid-override-pattern, --mamba-*, --squared-relu,
// --position-embedding-type none, the Mamba stack spec).
void put_nemotron_h_args(PickleDocument& doc, const BridgedModel& b,
                         std::vector<std::pair<PickleValue*, PickleValue*>>& fields) {
  auto put = [&](const std::string& key, PickleValue* v) { set_field(doc, fields, key, v); };
  put("is_hybrid_model", doc.boolean(true));
  put("hybrid_override_pattern", doc.string(b.model.hybrid_layers));
  put("hybrid_attention_ratio", doc.real(0.0));
  put("hybrid_mlp_ratio", doc.real(0.0));
  put("mamba_state_dim", doc.integer(b.model.mamba_state_dim));
  put("mamba_head_dim", doc.integer(b.model.mamba_head_dim));
  put("mamba_num_groups", doc.integer(b.model.mamba_num_groups));
  put("mamba_num_heads", doc.integer(b.model.mamba_num_heads));
  put("swiglu", doc.boolean(false));
  put("squared_relu", doc.boolean(true));
  put("position_embedding_type", doc.string("none"));
  put("spec", doc.list({doc.string("megatron.core.models.mamba.mamba_layer_specs"), doc.string("mamba_stack_spec")}));
  // (MoE layers: their router's arguments are DeepSeek-V3's, put_deepseek_moe_args)
  put("moe_latent_size", b.model.moe_latent_size > 0 ? doc.integer(b.model.moe_latent_size) : doc.none());
}

}  // namespace

bool is_megatron_args(const PickleValue* args) {
  return args && args->is(PickleKind::kObject) && args->class_name() == "argparse.Namespace";
}

nlohmann::json kept_megatron_args(const PickleValue* args) {
  nlohmann::json kept = nlohmann::json::object();
  if (!is_megatron_args(args)) return kept;
  for (const char* key : kMegatronDropoutArgs)
    if (const PickleValue* v = args->attr(key); v && (v->is(PickleKind::kFloat) || v->is(PickleKind::kInt)))
      kept[key] = v->is(PickleKind::kFloat) ? v->real : static_cast<double>(v->integer);
  // (validate_args sets seq_length from encoder_seq_length when only that is given)
  for (const char* key : {"seq_length", "encoder_seq_length"})
    if (const PickleValue* v = args->attr(key); v && v->is(PickleKind::kInt) && v->integer > 0) {
      kept["seq_length"] = v->integer;
      break;
    }
  return kept;
}

std::optional<std::int64_t> kept_seq_length(const nlohmann::json& kept) {
  if (!kept.is_object()) return std::nullopt;
  const auto seq = kept.find("seq_length");
  if (seq == kept.end() || !seq->is_number_integer() || seq->get<std::int64_t>() < 1) return std::nullopt;
  return seq->get<std::int64_t>();
}

MegatronModuleSpec megatron_module_spec_from_args(const PickleValue* args) {
  MegatronModuleSpec spec;
  if (!is_megatron_args(args)) return spec;
  const Args a{args, "", {}};
  if (a.text("transformer_impl", "transformer_engine") == "local") spec.norms = NormNaming::kLocal;
  spec.grouped_gemm = a.flag("moe_grouped_gemm");
  return spec;
}

namespace {

Result<ParallelLayout> layout_from_args(const Args& a) {
  const std::string& source = a.source;
  ParallelLayout l;
  l.tp = static_cast<int>(a.integer_or("tensor_model_parallel_size", 1));
  l.pp = static_cast<int>(a.integer_or("pipeline_model_parallel_size", 1));
  l.vpp = static_cast<int>(a.integer_or("virtual_pipeline_model_parallel_size", 1));
  l.ep = static_cast<int>(a.integer_or("expert_model_parallel_size", 1));
  l.make_vocab_size_divisible_by = a.integer_or("make_vocab_size_divisible_by", 128);
  TRESTLE_RETURN_IF_ERROR(
      check_vocab_size_divisible_by(l.make_vocab_size_divisible_by, source + ": args.make_vocab_size_divisible_by"));
  l.first_stage_layers = a.integer_or("decoder_first_pipeline_num_layers", 0);
  l.last_stage_layers = a.integer_or("decoder_last_pipeline_num_layers", 0);
  // The pipeline splits that place the layers otherwise: each rank file holds its stage's layers under local numbers.
  const bool account_embedding = a.flag("account_for_embedding_in_pipeline_split");
  const bool account_loss = a.flag("account_for_loss_in_pipeline_split");
  if (const PickleValue* layout = a.get("pipeline_model_parallel_layout")) {
    if (!layout->is(PickleKind::kString))
      return Status::Error(source + ": args.pipeline_model_parallel_layout is " + pickle_repr(layout, 80) +
                           ", not a layout string");
    TRESTLE_ASSIGN_OR_RETURN(const std::int64_t num_layers, a.integer("num_layers"));
    auto parsed = parse_pipeline_layout(layout->text, l.pp, num_layers, a.integer_or("mtp_num_layers", 0));
    if (!parsed.ok()) return parsed.status().with_context(source + " (args)");
    l.vpp = parsed->vpp;
    l.chunk_layers = parsed->chunk_layers;
  } else if (account_embedding || account_loss) {
    TRESTLE_ASSIGN_OR_RETURN(const std::int64_t num_layers, a.integer("num_layers"));
    auto layers = accounted_chunk_layers(num_layers, l.pp, l.vpp, account_embedding, account_loss);
    if (!layers.ok()) return layers.status().with_context(source + " (args)");
    l.chunk_layers = *layers;
  }
  return l;
}

}  // namespace

Result<ParallelLayout> megatron_layout_from_args(const PickleValue* args, const std::string& source) {
  if (!is_megatron_args(args)) return ParallelLayout{};
  const Args a{args, source, {}};
  return a.checked(layout_from_args(a));
}

Result<BridgedModel> bridged_model_from_args(const PickleValue* args, const std::string& source) {
  if (!is_megatron_args(args)) {
    const std::string found = !args || args->is(PickleKind::kNone)
                                  ? "no Megatron 'args' (argparse.Namespace)"
                                  : "'args' is " + pickle_repr(args, 80) + ", not an argparse.Namespace, so nothing";
    return Status::Error(source + ": " + found + " describes the model; give the model's config.json with --hf-config");
  }
  const Args a{args, source, {}};
  TRESTLE_ASSIGN_OR_RETURN(const json config, a.checked(hf_config_from_args(a)));
  TRESTLE_ASSIGN_OR_RETURN(const HfModelConfig hf, parse_hf_config(config, source + " (args)"));
  BridgedModel b;
  TRESTLE_ASSIGN_OR_RETURN(b.model, bridge_model_from_config(hf));
  TRESTLE_ASSIGN_OR_RETURN(b.layout, megatron_layout_from_args(args, source));
  b.norms =
      a.text("transformer_impl", "transformer_engine") == "local" ? NormNaming::kLocal : NormNaming::kTransformerEngine;
  return a.checked(Result<BridgedModel>(std::move(b)));
}

std::vector<std::string> megatron_args_caveats(const BridgedModel& b) {
  const auto [rope, type] = rope_block(b.model.hf.raw);
  if (type != "llama3") return {};
  std::string differs;
  for (const auto& [field, fixed] : {std::pair{"low_freq_factor", json(1.0)}, std::pair{"high_freq_factor", json(4.0)},
                                     std::pair{"original_max_position_embeddings", json(8192)}}) {
    const auto value = rope->find(field);
    if (value != rope->end() && value->is_number() && value->get<double>() != fixed.get<double>())
      differs += std::string(differs.empty() ? "" : ", ") + field + " " + value->dump() + " (megatron-core's " +
                 fixed.dump() + ")";
  }
  if (differs.empty()) return {};
  return {"Megatron-LM's arguments carry Llama 3.1 RoPE's factor only, and megatron-core fixes the rest: " + differs +
          "; Megatron-LM would build this model's RoPE otherwise (Trestle reads the exact values from "
          "trestle_model.json beside the checkpoint)"};
}

PickleValue* megatron_args(PickleDocument& doc, const BridgedModel& b) {
  const auto& c = b.model.hf;
  const auto& l = b.layout;
  std::vector<std::pair<PickleValue*, PickleValue*>> fields;
  auto put = [&](const char* key, PickleValue* v) { fields.emplace_back(doc.string(key), v); };
  auto put_int = [&](const char* key, std::int64_t v) { put(key, doc.integer(v)); };
  auto put_bool = [&](const char* key, bool v) { put(key, doc.boolean(v)); };
  put_int("num_layers", c.num_layers);
  put_int("hidden_size", c.hidden_size);
  put_int("ffn_hidden_size", b.model.ffn_hidden_size);
  put_int("num_attention_heads", c.num_attention_heads);
  put_bool("group_query_attention", c.num_kv_heads != c.num_attention_heads);
  put_int("num_query_groups", c.num_kv_heads);
  put_int("kv_channels", c.head_dim);
  put_int("vocab_size", c.vocab_size);
  put_int("padded_vocab_size", padded_vocab_size(c.vocab_size, l.make_vocab_size_divisible_by, l.tp));
  put_int("make_vocab_size_divisible_by", l.make_vocab_size_divisible_by);
  put_int("max_position_embeddings", c.max_position_embeddings);
  put_bool("untie_embeddings_and_output_weights", !c.tie_word_embeddings);
  put_bool("swiglu", !b.model.gemma);  // Gemma's GeGLU has no Megatron-LM flag
  put_bool("apply_layernorm_1p", b.model.gemma);
  put("normalization", doc.string("RMSNorm"));
  put("position_embedding_type", doc.string("rope"));
  put_bool("add_bias_linear", false);
  put_bool("add_qkv_bias", b.model.qkv_bias);
  put_bool("qk_layernorm", b.model.qk_norm);
  // Families whose layers these arguments do not describe whole (read back, they would name another family).
  if (b.model.olmo2 || b.model.gpt_oss() || b.model.glm4_moe() || b.model.gated_delta_net || b.model.nemotron_h())
    put("trestle_family", doc.string(b.model.family));
  put("rotary_base", c.rope_theta ? doc.real(*c.rope_theta) : doc.none());
  put("rotary_percent", doc.real(b.model.rotary_percent));
  put("norm_epsilon", c.norm_eps ? doc.real(*c.norm_eps) : doc.none());
  // RoPE scaling as Megatron-Core's flags say it (it implements Llama 3.1's with low/high frequency factors 1 and 4
  // and an original context of 8192; the exact parameters stay in the model Trestle keeps beside the checkpoint).
  const auto [rope, rope_type] = rope_block(c.raw);
  const auto factor = rope ? rope->find("factor") : c.raw.end();
  const double rope_factor = rope && factor != rope->end() && factor->is_number() ? factor->get<double>() : 1.0;
  put_bool("use_rope_scaling", rope_type == "llama3");
  if (rope_type == "llama3") put("rope_scaling_factor", doc.real(rope_factor));
  put("rotary_seq_len_interpolation_factor", rope_type == "linear" ? doc.real(rope_factor) : doc.none());
  const auto window = hf_sliding_window(c.raw);
  put("window_size", window ? doc.tuple({doc.integer(*window - 1), doc.integer(0)}) : doc.none());
  put_bool("bf16", c.dtype == "bfloat16");
  put_bool("fp16", c.dtype == "float16");
  if (b.model.is_moe()) {
    put_int("num_experts", c.num_experts);
    put_int("moe_router_topk", c.experts_per_token);
    put_int("moe_ffn_hidden_size", b.model.ffn_hidden_size);
    put_bool("moe_router_pre_softmax", bridged_model_to_json(b)["megatron"].value("moe_router_pre_softmax", false));
    if (b.model.shared_expert_ffn_hidden_size > 0) {
      put_int("moe_shared_expert_intermediate_size", b.model.shared_expert_ffn_hidden_size);
      put_bool("moe_shared_expert_gate", megatron_spec(b.model, b.norms).shared_expert_gate);
    } else {
      put("moe_shared_expert_intermediate_size", doc.none());
    }
  } else {
    put("num_experts", doc.none());
  }
  if (b.model.sigmoid_router()) put_deepseek_moe_args(doc, b, fields);
  if (b.model.deepseek()) put_deepseek_args(doc, b, fields);
  if (b.model.gpt_oss()) put_gpt_oss_args(doc, b, fields);
  if (b.model.gated_delta_net) put_gated_delta_net_args(doc, b, fields);
  if (b.model.nemotron_h()) put_nemotron_h_args(doc, b, fields);
  put_int("tensor_model_parallel_size", l.tp);
  put_int("pipeline_model_parallel_size", l.pp);
  put("virtual_pipeline_model_parallel_size", l.vpp > 1 ? doc.integer(l.vpp) : doc.none());
  put_int("expert_model_parallel_size", l.ep);
  put("decoder_first_pipeline_num_layers", l.first_stage_layers ? doc.integer(l.first_stage_layers) : doc.none());
  put("decoder_last_pipeline_num_layers", l.last_stage_layers ? doc.integer(l.last_stage_layers) : doc.none());
  put("pipeline_model_parallel_layout",
      l.chunk_layers.empty() ? doc.none() : doc.string(pipeline_layout_string(l.chunk_layers, b.model.mtp_layers)));
  put("transformer_impl", doc.string(std::string(norm_naming_name(b.norms))));
  put("ckpt_format", doc.string("torch_dist"));
  return doc.object(doc.global("argparse", "Namespace"), doc.tuple({}), doc.dict(std::move(fields)),
                    PickleCall::kNewObj);
}

}  // namespace trestle
