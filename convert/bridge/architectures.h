// Architecture bridges between Hugging Face and Megatron-Core: one small declarative table per architecture saying
// which Megatron tensor is made from which Hugging Face tensors, by which shared transformation (the Megatron tensors
// themselves, with their shapes and TP splits, are the layout library's: parallel/layout/model_spec.h). Also reads
// config.json into a BridgeModel, refusing architectures and options we do not support.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "convert/bridge/hf_config.h"
#include "parallel/layout/model_spec.h"

namespace trestle {

// The transformations, each written once (bridge_plan.cc turns them into element copies).
enum class Fusion {
  kCopy,         // one HF tensor is the Megatron tensor
  kQkv,          // q, k, v → Megatron per-group QKV order (weights and biases)
  kFusedQkv,     // one [q; k; v] tensor (Phi-3's qkv_proj) → Megatron per-group QKV order
  kGated,        // gate, up → [gate; up]
  kExpertSlice,  // slice {e} of a fused HF expert tensor [E, ...] (transformers 5 layout; gate_up_proj is [gate; up])
};

enum class Scope { kModel, kLayer, kExpert };

// When a rule applies.
enum class Condition { kAlways, kUntied, kOriginalExperts, kFusedExperts, kSharedExpert };

// Names are templates: {i} the global layer, {e} the global expert, {input_norm} / {pre_mlp_norm} the layer-norm
// names of the layout's naming (megatron_layout.h).
struct TensorRule {
  Scope scope;
  std::string megatron;
  std::vector<std::string> hf;
  Fusion fusion;
  Condition when = Condition::kAlways;
};

enum class MoeStyle { kNone, kMixtral, kQwen3Moe, kQwen2Moe };

struct BridgeModel {
  HfModelConfig hf;
  std::string architecture;  // e.g. "LlamaForCausalLM"
  MoeStyle moe = MoeStyle::kNone;
  bool qkv_bias = false;
  bool qk_norm = false;
  std::int64_t ffn_hidden_size = 0;                // per expert for MoE
  std::int64_t shared_expert_ffn_hidden_size = 0;  // Qwen2-MoE's shared expert (0: none); it has a sigmoid gate
  std::string family;                              // "Llama", "Qwen2-MoE", "Gemma 2", ...
  bool gemma = false;  // Gemma 2 / 3: GeGLU, (1 + w) norms, post-norms, soft-capping, alternating windows
  bool tied() const { return hf.tie_word_embeddings; }
  bool is_moe() const { return moe != MoeStyle::kNone; }
};

// The architectures[0] values we convert, in the order error messages list them.
const std::vector<std::string>& supported_architectures();

// Validates the config for conversion: a supported architecture, and no option that would change behaviour in a way
// Megatron-Core's GPT model does not reproduce (sliding window, biases beyond QKV, non-uniform MoE layers, ...).
Result<BridgeModel> bridge_model_from_config(const HfModelConfig& config);

// The architecture's table.
const std::vector<TensorRule>& architecture_rules(const BridgeModel& model);

// The Megatron side of the model: its sizes as Megatron-Core names them, with the given layer-norm naming.
GptModelSpec megatron_spec(const BridgeModel& model, NormNaming norms);

}  // namespace trestle
