// LoRA adapters on a GPT model's linear layers, as Megatron-Bridge's peft modules name and shape them: an adapter on a
// base linear W [out, in] adds scale · B · A · x with A (linear_in) [rank, in], B (linear_out) [out, rank] and
// scale = alpha / rank. `lora` puts one adapter on each fused linear (linear_qkv's B in Megatron's per-group QKV order,
// linear_fc1's as [gate; up]); `canonical` (Megatron-Bridge's CanonicalLoRA) separate ones on q, k, v and on gate, up,
// the form a Hugging Face PEFT adapter has. The adapters are canonical tensors like the model's (the adapter
// checkpoint's contents); their tensor-parallel splits follow Megatron-Bridge's ParallelLinearAdapter where it is
// cheap: on a column-parallel base A splits along the rank (its output gathered) and B as the base; on a row-parallel
// base A splits along its input as the base, and B is replicated (Megatron-Bridge splits it and gathers the
// hidden-size output; the values are the same). Pure functions; no I/O.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "parallel/layout/model_spec.h"

namespace trestle {

enum class LoraType { kLora, kCanonical };

// The base linears an adapter may sit on (Megatron-Bridge's target_modules), in this order.
const std::vector<std::string>& lora_target_modules();

struct LoraConfig {
  std::int64_t rank = 0;  // Megatron-Bridge's dim
  double alpha = 0.0;
  double dropout = 0.0;  // on the adapter's input (Megatron-Bridge's dropout_position "pre")
  LoraType type = LoraType::kLora;
  std::vector<std::string> targets = lora_target_modules();
  double scale() const { return alpha / static_cast<double>(rank); }
};

// The base checkpoint an adapter checkpoint was trained on: its iteration directory and the XXH3-64 (hex) of its
// manifest.json's bytes.
struct LoraBase {
  std::string path;
  std::string manifest_digest;
};

// "lora" | "canonical"; parse_lora_type errors name the value.
std::string_view lora_type_name(LoraType type);
Result<LoraType> parse_lora_type(const std::string& text);

// The manifest's model description carries {"lora": {rank, alpha, dropout, type, target_modules, base: {path,
// manifest_xxh3_64}}} in an adapter checkpoint. From JSON: errors name `source` and the field.
nlohmann::json lora_to_json(const LoraConfig& config, const LoraBase& base);
Result<LoraConfig> lora_config_from_json(const nlohmann::json& lora, const std::string& source);
Result<LoraBase> lora_base_from_json(const nlohmann::json& lora, const std::string& source);

// Checks the configuration for the model: a positive rank, a dropout in [0, 1), known targets that the model has
// (multi-latent attention has no linear_qkv), errors naming each.
Status check_lora_config(const LoraConfig& config, const GptModelSpec& spec);

// Every adapter tensor, in the model's module order (per decoder layer: linear_qkv, linear_proj, linear_fc1,
// linear_fc2, each linear_in then linear_out; canonical: adapter_q, _k, _v / adapter_gate, _up): names
// decoder.layers.<i>.self_attention.linear_qkv.adapter[.adapter_q].linear_in.weight, ..., placed with their layer. In
// an MoE layer linear_fc1 / linear_fc2 adapt each routed expert (mlp.experts.local_experts.<e>.linear_fc1..., with
// its expert index) and the shared expert (mlp.shared_experts.linear_fc1...), as Megatron-Bridge's module names match.
// Gemma 4's layers: linear_qkv of the layer's own head size and KV heads, without value rows (adapter_v) where the keys
// are the values; in a KV-sharing layer the linear_qkv target adapts its linear_q_proj (adapter_q alone); MLPs twice as
// wide there with double_wide_mlp; an MoE layer's dense MLP is its shared expert.
Result<std::vector<CanonicalTensor>> lora_tensors(const GptModelSpec& spec, const LoraConfig& config);

// The name of base tensor `module`'s adapter tensor: "<module>.adapter[.<part>].linear_<in|out>.weight" (module is
// e.g. decoder.layers.3.self_attention.linear_qkv; part "" or adapter_q, ...).
std::string lora_tensor_name(const std::string& module, const std::string& part, bool in);

}  // namespace trestle
