// Megatron-LM's training arguments (the argparse.Namespace saved as 'args' in legacy rank files, in torch_dist's
// common.pt or its common_state item) as the model description the bridge needs, and back: the Namespace Trestle
// writes into the common.pt of a torch_dist checkpoint so Megatron-LM (and Trestle) can rebuild the model from it.
// The Hugging Face architecture is inferred from the options (qk_layernorm: Qwen3, add_qkv_bias: Qwen2, num_experts:
// Mixtral or Qwen3-MoE, else Llama); a config.json given by the user takes precedence wherever one is available.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "convert/bridge/bridge_model_json.h"
#include "convert/formats/torch/pickle_value.h"

namespace trestle {

// Whether `args` is what Megatron saves as 'args': an argparse.Namespace. Anything else (a stranger's pickle can hold
// any call there) describes nothing.
bool is_megatron_args(const PickleValue* args);

// The model and the layout that saved it. `source` names the file in errors, which list the missing or unsupported
// argument (a model the bridge cannot express: no swiglu, LayerNorm, learned position embeddings, ...).
Result<BridgedModel> bridged_model_from_args(const PickleValue* args, const std::string& source);
// Only the layout (tp, pp, vpp, ep, vocabulary padding, uneven stages, a --pipeline-model-parallel-layout or the
// embedding and loss counted in the split); sizes the args lack are 1 (0 for the stages). Errors name `source` and the
// pipeline split that does not describe the model's layers.
Result<ParallelLayout> megatron_layout_from_args(const PickleValue* args, const std::string& source);
// Which modules built the model: the layer specification (args.transformer_impl: Transformer Engine's, Megatron-LM's
// default, or the local one) and whether the experts are grouped-GEMM modules (args.moe_grouped_gemm). The checkpoint
// keys are the same either way; the order of the parameters is not.
struct MegatronModuleSpec {
  NormNaming norms = NormNaming::kTransformerEngine;
  bool grouped_gemm = false;
};
MegatronModuleSpec megatron_module_spec_from_args(const PickleValue* args);

// The arguments that hold a training run's data position, which Megatron-LM resumes from (as Trestle's manifest
// "training" keys of the same names).
inline constexpr const char* kMegatronDataPositionArgs[] = {"consumed_train_samples", "consumed_valid_samples",
                                                            "skipped_train_samples"};
// The dropout in Megatron-LM's arguments, which its --use-checkpoint-args takes from a checkpoint over the command line
// (kept as a converted checkpoint's training "megatron_args"; Trestle trains without dropout).
inline constexpr const char* kMegatronDropoutArgs[] = {"hidden_dropout", "attention_dropout"};
// What a converted checkpoint keeps of a Megatron-LM run's arguments as its training "megatron_args": the dropout and
// seq_length (which --use-checkpoint-args takes from a checkpoint when the command line gives none); {} for no args.
nlohmann::json kept_megatron_args(const PickleValue* args);
// The sequence length such a record holds: a positive integer "seq_length", else nullopt.
std::optional<std::int64_t> kept_seq_length(const nlohmann::json& kept);

// What megatron_args cannot say of `bridged`, each a sentence naming the value that Megatron-LM would build otherwise
// (Llama 3.1 RoPE parameters other than megatron-core's fixed ones); empty when the arguments describe it whole.
std::vector<std::string> megatron_args_caveats(const BridgedModel& bridged);

// argparse.Namespace(num_layers=..., hidden_size=..., ...) describing `bridged`, built in `doc`.
PickleValue* megatron_args(PickleDocument& doc, const BridgedModel& bridged);

}  // namespace trestle
