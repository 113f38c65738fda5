#include "convert/bridge/megatron_args.h"

namespace trestle {
namespace {

using json = nlohmann::json;

struct Args {
  const PickleValue* ns;
  std::string source;

  const PickleValue* get(const char* key) const {
    const PickleValue* v = ns->attr(key);
    return v && !v->is(PickleKind::kNone) ? v : nullptr;
  }
  Result<std::int64_t> integer(const char* key) const {
    const PickleValue* v = get(key);
    if (!v) return Status::Error(source + ": args has no '" + key + "'; give the model's config.json with --hf-config");
    return pickle_int(v, source + ": args." + key);
  }
  std::int64_t integer_or(const char* key, std::int64_t fallback) const {
    const PickleValue* v = get(key);
    return v && v->is(PickleKind::kInt) ? v->integer : fallback;
  }
  bool flag(const char* key, bool fallback = false) const {
    const PickleValue* v = get(key);
    return v && v->is(PickleKind::kBool) ? v->boolean : fallback;
  }
  std::optional<double> real(const char* key) const {
    const PickleValue* v = get(key);
    if (v && v->is(PickleKind::kFloat)) return v->real;
    if (v && v->is(PickleKind::kInt)) return static_cast<double>(v->integer);
    return std::nullopt;
  }
  std::string text(const char* key, const std::string& fallback) const {
    const PickleValue* v = get(key);
    return v && v->is(PickleKind::kString) ? v->text : fallback;
  }
};

Status check_expressible(const Args& a) {
  auto refuse = [&](const std::string& what) {
    return Status::Error(a.source + ": args describe " + what +
                         ", which the Hugging Face bridge does not convert (it supports RMSNorm + SwiGLU + RoPE GPT "
                         "models: Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen2/3-MoE)");
  };
  if (!a.flag("swiglu")) return refuse("an MLP without swiglu");
  if (a.text("normalization", "RMSNorm") != "RMSNorm") return refuse("normalization " + a.text("normalization", ""));
  if (a.text("position_embedding_type", "rope") != "rope")
    return refuse("position embeddings " + a.text("position_embedding_type", ""));
  if (a.flag("add_bias_linear")) return refuse("biases on linear layers (add_bias_linear)");
  return OkStatus();
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

}  // namespace

MegatronModuleSpec megatron_module_spec_from_args(const PickleValue* args) {
  MegatronModuleSpec spec;
  if (!args || !args->is(PickleKind::kObject)) return spec;
  const Args a{args, ""};
  if (a.text("transformer_impl", "transformer_engine") == "local") spec.norms = NormNaming::kLocal;
  spec.grouped_gemm = a.flag("moe_grouped_gemm");
  return spec;
}

ParallelLayout megatron_layout_from_args(const PickleValue* args) {
  const Args a{args, ""};
  ParallelLayout l;
  l.tp = static_cast<int>(a.integer_or("tensor_model_parallel_size", 1));
  l.pp = static_cast<int>(a.integer_or("pipeline_model_parallel_size", 1));
  l.vpp = static_cast<int>(a.integer_or("virtual_pipeline_model_parallel_size", 1));
  l.ep = static_cast<int>(a.integer_or("expert_model_parallel_size", 1));
  l.make_vocab_size_divisible_by = a.integer_or("make_vocab_size_divisible_by", 128);
  l.first_stage_layers = a.integer_or("decoder_first_pipeline_num_layers", 0);
  l.last_stage_layers = a.integer_or("decoder_last_pipeline_num_layers", 0);
  return l;
}

Result<BridgedModel> bridged_model_from_args(const PickleValue* args, const std::string& source) {
  if (!args || !args->is(PickleKind::kObject))
    return Status::Error(source +
                         ": no Megatron 'args' (argparse.Namespace) to describe the model; give the model's "
                         "config.json with --hf-config");
  const Args a{args, source};
  TRESTLE_ASSIGN_OR_RETURN(const json config, hf_config_from_args(a));
  TRESTLE_ASSIGN_OR_RETURN(const HfModelConfig hf, parse_hf_config(config, source + " (args)"));
  BridgedModel b;
  TRESTLE_ASSIGN_OR_RETURN(b.model, bridge_model_from_config(hf));
  b.layout = megatron_layout_from_args(args);
  b.norms =
      a.text("transformer_impl", "transformer_engine") == "local" ? NormNaming::kLocal : NormNaming::kTransformerEngine;
  return b;
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
  put("rotary_base", c.rope_theta ? doc.real(*c.rope_theta) : doc.none());
  put("norm_epsilon", c.norm_eps ? doc.real(*c.norm_eps) : doc.none());
  // RoPE scaling as Megatron-Core's flags say it (it implements Llama 3.1's with low/high frequency factors 1 and 4
  // and an original context of 8192; the exact parameters stay in the model Trestle keeps beside the checkpoint).
  const json* rope = nullptr;
  for (const char* key : {"rope_scaling", "rope_parameters"})
    if (!rope && c.raw.contains(key) && c.raw[key].is_object()) rope = &c.raw[key];
  std::string rope_type = "default";
  for (const char* field : {"rope_type", "type"})
    if (rope && rope->contains(field) && (*rope)[field].is_string()) rope_type = (*rope)[field].get<std::string>();
  const auto factor = rope ? rope->find("factor") : c.raw.end();
  const double rope_factor = rope && factor != rope->end() && factor->is_number() ? factor->get<double>() : 1.0;
  put_bool("use_rope_scaling", rope_type == "llama3");
  if (rope_type == "llama3") put("rope_scaling_factor", doc.real(rope_factor));
  put("rotary_seq_len_interpolation_factor", rope_type == "linear" ? doc.real(rope_factor) : doc.none());
  const auto window = c.raw.find("sliding_window");
  put("window_size", window != c.raw.end() && window->is_number_integer()
                         ? doc.tuple({doc.integer(window->get<std::int64_t>() - 1), doc.integer(0)})
                         : doc.none());
  put_bool("bf16", c.dtype == "bfloat16");
  put_bool("fp16", c.dtype == "float16");
  if (b.model.is_moe()) {
    put_int("num_experts", c.num_experts);
    put_int("moe_router_topk", c.experts_per_token);
    put_int("moe_ffn_hidden_size", b.model.ffn_hidden_size);
    put_bool("moe_router_pre_softmax", bridged_model_to_json(b)["megatron"].value("moe_router_pre_softmax", false));
    if (b.model.shared_expert_ffn_hidden_size > 0) {
      put_int("moe_shared_expert_intermediate_size", b.model.shared_expert_ffn_hidden_size);
      put_bool("moe_shared_expert_gate", true);
    } else {
      put("moe_shared_expert_intermediate_size", doc.none());
    }
  } else {
    put("num_experts", doc.none());
  }
  put_int("tensor_model_parallel_size", l.tp);
  put_int("pipeline_model_parallel_size", l.pp);
  put("virtual_pipeline_model_parallel_size", l.vpp > 1 ? doc.integer(l.vpp) : doc.none());
  put_int("expert_model_parallel_size", l.ep);
  put("decoder_first_pipeline_num_layers", l.first_stage_layers ? doc.integer(l.first_stage_layers) : doc.none());
  put("decoder_last_pipeline_num_layers", l.last_stage_layers ? doc.integer(l.last_stage_layers) : doc.none());
  put("transformer_impl", doc.string(std::string(norm_naming_name(b.norms))));
  put("ckpt_format", doc.string("torch_dist"));
  return doc.object(doc.global("argparse", "Namespace"), doc.tuple({}), doc.dict(std::move(fields)),
                    PickleCall::kNewObj);
}

}  // namespace trestle
