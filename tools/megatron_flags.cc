#include "tools/megatron_flags.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>

namespace trestle::cli {
namespace {

// A flag Megatron-LM takes to choose how it computes or logs something Trestle does its own way: a switch (no
// choices), a value from `choices`, a count ({"COUNT"}) or any text ({"TEXT"}: a path, a tokenizer's name).
struct NoEffectFlag {
  const char* name;
  const char* why;
  std::vector<std::string> choices;
};

const std::vector<NoEffectFlag>& no_effect_flags() {
  static const std::vector<NoEffectFlag> flags = {
      {"use-mcore-models", "Trestle's model is megatron-core's GPTModel's layout", {}},
      {"transformer-impl", "the layer implementation (the math is the same)", {"local", "transformer_engine"}},
      {"attention-backend",
       "the attention kernel (LibTorch's SDPA here)",
       {"auto", "flash", "fused", "unfused", "local"}},
      {"use-flash-attn", "the attention kernel (LibTorch's SDPA here)", {}},
      {"no-masked-softmax-fusion", "a fusion", {}},
      {"no-bias-swiglu-fusion", "a fusion", {}},
      {"no-bias-dropout-fusion", "a fusion", {}},
      {"no-bias-gelu-fusion", "a fusion", {}},
      {"no-persist-layer-norm", "a fusion", {}},
      {"no-rope-fusion", "a fusion (--no-fused-kernels chooses Trestle's)", {}},
      {"cross-entropy-loss-fusion", "a fusion", {}},
      {"cross-entropy-fusion-impl", "a fusion", {"native", "te"}},
      {"moe-permute-fusion", "a fusion", {}},
      {"tp-comm-overlap", "an overlap of communication", {}},
      {"overlap-grad-reduce", "an overlap of communication (gradients are reduced in buckets during backward)", {}},
      {"overlap-param-gather", "an overlap of communication", {}},
      {"no-async-tensor-model-parallel-allreduce", "an overlap of communication", {}},
      {"moe-token-dispatcher-type",
       "how tokens reach their experts (all-to-all here; the same result)",
       {"allgather", "alltoall", "flex"}},
      {"distributed-backend", "the collectives' library (Gloo on the CPU, NCCL on GPUs)", {"nccl", "gloo"}},
      {"use-cpu-initialization", "where weights are initialised", {}},
      {"empty-unused-memory-level", "when the allocator's cache is emptied", {"0", "1", "2"}},
      {"manual-gc", "Python's garbage collector", {}},
      {"manual-gc-interval", "Python's garbage collector", {"COUNT"}},
      {"num-workers", "data-loader processes", {"COUNT"}},
      {"num-dataset-builder-threads", "dataset-building threads", {"COUNT"}},
      {"no-create-attention-mask-in-dataloader", "the attention mask is causal here", {}},
      {"tokenizer-type", "the data is tokenized; the vocabulary is the model's", {"TEXT"}},
      {"tokenizer-model", "the data is tokenized; the vocabulary is the model's", {"TEXT"}},
      {"vocab-file", "the data is tokenized; the vocabulary is the model's", {"TEXT"}},
      {"merge-file", "the data is tokenized; the vocabulary is the model's", {"TEXT"}},
      {"async-save", "saves are asynchronous here", {}},
      {"use-persistent-ckpt-worker", "saves are asynchronous here", {}},
      {"ckpt-fully-parallel-save", "every rank writes its own pieces here", {}},
      {"ckpt-fully-parallel-load", "every rank reads its own pieces here", {}},
      {"ckpt-assume-constant-structure", "a save-plan cache", {}},
      {"dist-ckpt-strictness",
       "torch_dist key checks (a loaded checkpoint is checked whole here)",
       {"assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all", "return_unexpected",
        "return_all", "ignore_all"}},
      {"log-throughput", "tokens/s is always logged", {}},
      {"timing-log-level", "Megatron's timers", {"0", "1", "2"}},
      {"log-timers-to-tensorboard", "Megatron's timers", {}},
      {"log-memory-to-tensorboard", "peak memory is in the log line", {}},
      {"log-world-size-to-tensorboard", "the world size is in the log", {}},
      {"log-validation-ppl-to-tensorboard", "the validation perplexity is always written", {}},
  };
  return flags;
}

bool takes_value(const NoEffectFlag& f) { return !f.choices.empty(); }
bool takes_count(const NoEffectFlag& f) { return f.choices.size() == 1 && f.choices[0] == "COUNT"; }
bool takes_text(const NoEffectFlag& f) { return f.choices.size() == 1 && f.choices[0] == "TEXT"; }

std::string joined(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : ", ") + w;
  return out;
}

// The shortest decimal that reads back as v.
std::string shown(double v) {
  char text[64];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, v);
    if (std::strtod(text, nullptr) == v) break;
  }
  return text;
}

}  // namespace

void declare_megatron_flags(cxxopts::Options& spec) {
  spec.add_options(kMegatronModelGroup)("num-layers", "checked against the model's transformer layers",
                                        cxxopts::value<std::int64_t>())(
      "hidden-size", "checked against the model's hidden size", cxxopts::value<std::int64_t>())(
      "ffn-hidden-size", "checked against the MLP's hidden size (MoE: the dense layers', else the experts')",
      cxxopts::value<std::int64_t>())("moe-ffn-hidden-size", "MoE: checked against each expert's hidden size",
                                      cxxopts::value<std::int64_t>())(
      "num-attention-heads", "checked against the model's query heads", cxxopts::value<std::int64_t>())(
      "group-query-attention", "with --num-query-groups: checked against the model's key/value heads")(
      "num-query-groups",
      "checked against the model's key/value heads (Megatron reads it with --group-query-attention)",
      cxxopts::value<std::int64_t>())("kv-channels", "checked against the model's head dim",
                                      cxxopts::value<std::int64_t>())(
      "vocab-size", "checked against the model's (unpadded) vocabulary", cxxopts::value<std::int64_t>())(
      "max-position-embeddings", "at least --seq-length (Megatron asserts it)", cxxopts::value<std::int64_t>())(
      "rotary-base", "checked against the model's RoPE base", cxxopts::value<double>())(
      "rotary-percent", "checked against the share of each head RoPE rotates", cxxopts::value<double>())(
      "norm-epsilon", "checked against the norms' epsilon", cxxopts::value<double>())(
      "normalization", "RMSNorm (every model here)", cxxopts::value<std::string>())(
      "position-embedding-type", "rope (yarn for YaRN scaling; none for a Mamba hybrid)",
      cxxopts::value<std::string>())("use-rotary-position-embeddings", "the model's attention uses RoPE")(
      "swiglu", "the model's MLP is SwiGLU")("untie-embeddings-and-output-weights",
                                             "the model has an output layer of its own")(
      "disable-bias-linear", "the model's linear layers have no biases")(
      "add-qkv-bias", "the model's query/key/value projection has biases")(
      "qk-layernorm", "the model norms its queries and keys")("apply-layernorm-1p",
                                                              "the model's norms apply (1 + w) (Gemma)")(
      "moe-router-score-function", "MoE: checked against the router's (softmax, sigmoid)",
      cxxopts::value<std::string>())("moe-router-enable-expert-bias", "MoE: the router has an expert bias")(
      "moe-router-topk-scaling-factor", "MoE: checked against the routed weights' scale", cxxopts::value<double>())(
      "moe-shared-expert-intermediate-size", "MoE: checked against the shared expert's hidden size",
      cxxopts::value<std::int64_t>())("attention-dropout", "0 only: Trestle trains without dropout",
                                      cxxopts::value<double>())(
      "hidden-dropout", "0 only: Trestle trains without dropout", cxxopts::value<double>());
  auto group = spec.add_options(kMegatronNoEffectGroup);
  for (const NoEffectFlag& f : no_effect_flags()) {
    const std::string help = std::string("no effect here: ") + f.why;
    if (takes_count(f)) group(f.name, help, cxxopts::value<std::int64_t>());
    else if (takes_value(f))
      group(f.name, takes_text(f) ? help : help + " (" + joined(f.choices) + ")", cxxopts::value<std::string>());
    else group(f.name, help);
  }
}

Status check_megatron_flag_values(const cxxopts::ParseResult& args) {
  for (const char* flag : {"attention-dropout", "hidden-dropout"})
    if (args.count(flag) && args[flag].as<double>() != 0.0)
      return Status::Error(std::string("--") + flag + " " + shown(args[flag].as<double>()) +
                           ": Trestle trains without dropout; give 0 (Megatron's default is 0.1)");
  for (const NoEffectFlag& f : no_effect_flags()) {
    if (!args.count(f.name)) continue;
    if (takes_count(f)) {
      if (args[f.name].as<std::int64_t>() < 0)
        return Status::Error(std::string("--") + f.name + " must not be negative");
    } else if (takes_value(f) && !takes_text(f)) {
      const std::string value = args[f.name].as<std::string>();
      if (std::find(f.choices.begin(), f.choices.end(), value) == f.choices.end())
        return Status::Error(std::string("--") + f.name + " " + value + ": not one of " + joined(f.choices));
    }
  }
  for (const char* flag : {"num-layers", "hidden-size", "ffn-hidden-size", "moe-ffn-hidden-size", "num-attention-heads",
                           "num-query-groups", "kv-channels", "vocab-size", "max-position-embeddings",
                           "moe-shared-expert-intermediate-size"})
    if (args.count(flag) && args[flag].as<std::int64_t>() < 0)
      return Status::Error(std::string("--") + flag + " must not be negative");
  if (args.count("max-position-embeddings") && args.count("seq-length") &&
      args["max-position-embeddings"].as<std::int64_t>() < args["seq-length"].as<std::int64_t>())
    return Status::Error("--max-position-embeddings " +
                         std::to_string(args["max-position-embeddings"].as<std::int64_t>()) +
                         " is less than --seq-length " + std::to_string(args["seq-length"].as<std::int64_t>()));
  return OkStatus();
}

Status check_megatron_model_flags(const cxxopts::ParseResult& args, const GptModelSpec& model,
                                  const std::string& source) {
  auto differs = [&](const std::string& flag, const std::string& given, const std::string& held) {
    return Status::Error("--" + flag + " " + given + " differs from the model's " + held + " (" + source + ")");
  };
  auto check_int = [&](const char* flag, std::int64_t held) -> Status {
    if (!args.count(flag) || args[flag].as<std::int64_t>() == held) return OkStatus();
    return differs(flag, std::to_string(args[flag].as<std::int64_t>()), std::to_string(held));
  };
  auto check_real = [&](const char* flag, double held) -> Status {
    if (!args.count(flag)) return OkStatus();
    const double given = args[flag].as<double>();
    if (std::abs(given - held) <= 1e-12 * std::max(std::abs(given), std::abs(held))) return OkStatus();
    return differs(flag, shown(given), shown(held));
  };
  auto check_switch = [&](const char* flag, bool held, const char* lacking) -> Status {
    if (!args.count(flag) || held) return OkStatus();
    return Status::Error(std::string("--") + flag + ": the model" + lacking + " (" + source + ")");
  };
  TRESTLE_RETURN_IF_ERROR(check_int("num-layers", model.num_layers));
  TRESTLE_RETURN_IF_ERROR(check_int("hidden-size", model.hidden_size));
  TRESTLE_RETURN_IF_ERROR(check_int("num-attention-heads", model.num_attention_heads));
  TRESTLE_RETURN_IF_ERROR(check_int("vocab-size", model.vocab_size));
  if (!model.multi_latent_attention()) TRESTLE_RETURN_IF_ERROR(check_int("kv-channels", model.kv_channels));
  if (model.is_moe()) {
    TRESTLE_RETURN_IF_ERROR(check_int("moe-ffn-hidden-size", model.ffn_hidden_size));
    // Megatron's ffn_hidden_size sizes the dense layers; without any, it is the experts' size unless
    // --moe-ffn-hidden-size gives that.
    if (model.moe_first_dense_layers > 0)
      TRESTLE_RETURN_IF_ERROR(check_int("ffn-hidden-size", model.dense_ffn_hidden_size));
    else if (!args.count("moe-ffn-hidden-size"))
      TRESTLE_RETURN_IF_ERROR(check_int("ffn-hidden-size", model.ffn_hidden_size));
    TRESTLE_RETURN_IF_ERROR(check_int("moe-shared-expert-intermediate-size", model.shared_expert_ffn_hidden_size));
    TRESTLE_RETURN_IF_ERROR(check_real("moe-router-topk-scaling-factor", model.moe_router_topk_scaling_factor));
    if (args.count("moe-router-score-function") &&
        args["moe-router-score-function"].as<std::string>() != model.moe_router_score_function)
      return differs("moe-router-score-function", args["moe-router-score-function"].as<std::string>(),
                     model.moe_router_score_function);
    TRESTLE_RETURN_IF_ERROR(
        check_switch("moe-router-enable-expert-bias", model.moe_router_expert_bias, "'s router has no expert bias"));
  } else {
    TRESTLE_RETURN_IF_ERROR(check_int("ffn-hidden-size", model.ffn_hidden_size));
  }
  if (args.count("group-query-attention") || args.count("num-query-groups")) {
    // Megatron reads --num-query-groups (default 1) only with --group-query-attention; without it every head is its
    // own group.
    const std::int64_t heads =
        args.count("num-attention-heads") ? args["num-attention-heads"].as<std::int64_t>() : model.num_attention_heads;
    const std::int64_t groups = !args.count("group-query-attention") ? heads
                                : args.count("num-query-groups")     ? args["num-query-groups"].as<std::int64_t>()
                                                                     : 1;
    if (groups != model.num_query_groups)
      return Status::Error("--group-query-attention / --num-query-groups give " + std::to_string(groups) +
                           " key/value heads; the model has " + std::to_string(model.num_query_groups) + " (" + source +
                           ")");
  }
  TRESTLE_RETURN_IF_ERROR(check_real("rotary-base", model.rotary_base));
  if (!model.multi_latent_attention()) TRESTLE_RETURN_IF_ERROR(check_real("rotary-percent", model.rotary_percent));
  TRESTLE_RETURN_IF_ERROR(check_real("norm-epsilon", model.norm_epsilon));
  if (args.count("normalization") && args["normalization"].as<std::string>() != "RMSNorm")
    return differs("normalization", args["normalization"].as<std::string>(), "RMSNorm");
  if (args.count("position-embedding-type")) {
    const std::string held = model.mamba_num_heads > 0 ? "none" : "rope";
    const std::string given = args["position-embedding-type"].as<std::string>();
    if (given != held && !(given == "yarn" && held == "rope" && model.rope_scaling.type == RopeScalingType::kYarn))
      return differs("position-embedding-type", given, held);
  }
  TRESTLE_RETURN_IF_ERROR(
      check_switch("use-rotary-position-embeddings", model.mamba_num_heads == 0, "'s attention has no RoPE"));
  const bool swiglu = !model.geglu && !model.quick_geglu && !model.squared_relu;
  TRESTLE_RETURN_IF_ERROR(check_switch("swiglu", swiglu, "'s MLP is not SwiGLU"));
  TRESTLE_RETURN_IF_ERROR(check_switch("untie-embeddings-and-output-weights", !model.tied_embeddings,
                                       " ties its output layer to the word embeddings"));
  TRESTLE_RETURN_IF_ERROR(check_switch("disable-bias-linear", !model.add_bias_linear, "'s linear layers have biases"));
  TRESTLE_RETURN_IF_ERROR(check_switch("add-qkv-bias", model.add_qkv_bias || model.add_bias_linear,
                                       "'s query/key/value projection has no biases"));
  TRESTLE_RETURN_IF_ERROR(check_switch("qk-layernorm", model.qk_layernorm, " does not norm its queries and keys"));
  TRESTLE_RETURN_IF_ERROR(
      check_switch("apply-layernorm-1p", model.zero_centered_norms, "'s norms do not apply (1 + w)"));
  return OkStatus();
}

std::vector<std::string> given_flags_without_effect(const cxxopts::ParseResult& args) {
  std::vector<std::string> given;
  for (const NoEffectFlag& f : no_effect_flags()) {
    if (!args.count(f.name)) continue;
    std::string word = std::string("--") + f.name;
    if (takes_count(f)) word += " " + std::to_string(args[f.name].as<std::int64_t>());
    else if (takes_value(f)) word += " " + args[f.name].as<std::string>();
    given.push_back(word);
  }
  return given;
}

}  // namespace trestle::cli
