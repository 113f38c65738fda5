// LoRA adapters on a GPT model's linear layers, as Megatron-Bridge's peft modules name and shape them: an adapter on a
// base linear W [out, in] adds scale · B · A · x with A (linear_in) [rank, in], B (linear_out) [out, rank] and
// scale = alpha / rank. `lora` puts one adapter on each fused linear (linear_qkv's B in Megatron's per-group QKV order,
// linear_fc1's as [gate; up]); `canonical` (Megatron-Bridge's CanonicalLoRA) separate ones on q, k, v and on gate, up,
// the form a Hugging Face PEFT adapter has. The adapters are canonical tensors like the model's (the adapter
// checkpoint's contents); their tensor-parallel splits follow Megatron-Bridge's ParallelLinearAdapter where it is
// cheap: on a column-parallel base A splits along the rank (its output gathered) and B as the base; on a row-parallel
// base A splits along its input as the base, and B is replicated (Megatron-Bridge splits it and gathers the
// hidden-size output; the values are the same); on a replicated base (multi-latent attention's down projections under
// Transformer Engine's spec) A and B are replicated. Pure functions; no I/O.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "parallel/layout/model_spec.h"

namespace trestle {

// lora: one adapter per linear; canonical: separate q, k, v and gate, up adapters (Megatron-Bridge's CanonicalLoRA);
// peft: canonical, except the routed experts' linear_fc1, whose gate and up share one adapter (one A), as PEFT adapts
// the fused gate_up_proj of transformers 5's experts beside separate q_proj, k_proj, v_proj and MLP projections.
enum class LoraType { kLora, kCanonical, kPeft };
// The type of one module's adapter: peft's is lora on a routed expert, canonical elsewhere.
LoraType module_lora_type(LoraType type, bool routed_expert);

// The base linears an adapter may sit on (Megatron-Bridge's target_modules), in this order: multi-latent attention
// (DeepSeek) has linear_q_proj, or linear_q_down_proj and linear_q_up_proj, and linear_kv_down_proj,
// linear_kv_up_proj where other attention has linear_qkv; a Gated DeltaNet layer (Qwen3-Next / Qwen3.5) or Mamba mixer
// (Nemotron-H) has in_proj and out_proj where an attention layer has linear_qkv and linear_proj.
const std::vector<std::string>& lora_target_modules();
// The targets Megatron-Bridge's LoRA adapts when none are given.
const std::vector<std::string>& default_lora_target_modules();

struct LoraConfig {
  std::int64_t rank = 0;  // Megatron-Bridge's dim
  double alpha = 0.0;
  double dropout = 0.0;  // on the adapter's input (Megatron-Bridge's dropout_position "pre")
  LoraType type = LoraType::kLora;
  std::vector<std::string> targets = default_lora_target_modules();
  double scale() const { return alpha / static_cast<double>(rank); }
};

// The base checkpoint an adapter checkpoint was trained on: its iteration directory, the XXH3-64 (hex) of its
// manifest.json's bytes, and its weights' origin (canonical_source.h's weights_origin_digest: the digest of the
// manifest they were first written under, the same for every reshard of them).
struct LoraBase {
  std::string path;
  std::string manifest_digest;
  std::string weights_origin;
};

// "lora" | "canonical" | "peft"; parse_lora_type errors name the value.
std::string_view lora_type_name(LoraType type);
Result<LoraType> parse_lora_type(const std::string& text);

// The manifest's model description carries {"lora": {rank, alpha, dropout, type, target_modules, base: {path,
// manifest_xxh3_64, weights_origin_xxh3_64}}} in an adapter checkpoint. From JSON: errors name `source` and the field;
// a base without weights_origin_xxh3_64 (as written before it was recorded) is its manifest's digest.
nlohmann::json lora_to_json(const LoraConfig& config, const LoraBase& base);
Result<LoraConfig> lora_config_from_json(const nlohmann::json& lora, const std::string& source);
Result<LoraBase> lora_base_from_json(const nlohmann::json& lora, const std::string& source);

// Checks the configuration for the model: a positive rank, a dropout in [0, 1), known targets that the model has
// (multi-latent attention has no linear_qkv, other attention none of its projections), errors naming each.
Status check_lora_config(const LoraConfig& config, const GptModelSpec& spec);

// Whether some layer of the model has `target` (multi-latent attention has no linear_qkv but its own projections; only
// Gated DeltaNet layers and Mamba mixers have in_proj and out_proj).
bool model_has_lora_target(const GptModelSpec& spec, const std::string& target);
// Every target some layer of the model has, in lora_target_modules()'s order.
std::vector<std::string> model_lora_targets(const GptModelSpec& spec);

// The parts of one adapter (its own A each) and the pieces of each part's B: a B is stored as one tensor (one piece,
// named "") unless its base is stored in pieces, as a Gated DeltaNet's in_proj is (in_proj.weight.query, .key,
// .value, .z, .beta, .alpha, each split over the tp ranks by heads): there the B rows of each base piece are a tensor
// of their own, so every rank holds its heads' rows of each. The fused output is the parts' then the pieces' rows in
// order.
struct LoraPart {
  std::string name;                 // "" (one adapter on the linear) or adapter_q, adapter_gate, adapter_qkvz, ...
  std::vector<std::string> pieces;  // {""} or the base's pieces this part's B covers
};
// The adapter parts on `target` in layer `layer` of `spec` for a module of `type` (module_lora_type's: lora: one part;
// canonical: q, k[, v] on linear_qkv, the gated attention's q holding each group's gates after its queries; gate, up on
// linear_fc1; one per Hugging Face projection on in_proj: qkv, z, b, a where the model splits it so, else qkvz, ba);
// none where the layer lacks the target.
std::vector<LoraPart> lora_parts(const GptModelSpec& spec, std::int64_t layer, const std::string& target,
                                 LoraType type);

// Every adapter tensor, in the model's module order (per decoder layer: linear_qkv, linear_proj, linear_fc1,
// linear_fc2, each linear_in then linear_out; canonical: adapter_q, _k, _v / adapter_gate, _up): names
// decoder.layers.<i>.self_attention.linear_qkv.adapter[.adapter_q].linear_in.weight, ..., placed with their layer. In
// an MoE layer linear_fc1 / linear_fc2 adapt each routed expert (mlp.experts.local_experts.<e>.linear_fc1..., with
// its expert index) and the shared expert (mlp.shared_experts.linear_fc1...), as Megatron-Bridge's module names match.
// Multi-latent attention: linear_q_proj or linear_q_down_proj, linear_q_up_proj, then linear_kv_down_proj,
// linear_kv_up_proj where linear_qkv would be; the up projections' adapters column-parallel, the down projections'
// replicated as their bases are under Transformer Engine's spec (column-parallel under the local spec).
// Gated DeltaNet layers: in_proj (B in the base's pieces) and out_proj instead of linear_qkv and linear_proj. A hybrid
// (Nemotron-H) layer: its one mixer's (mixer.in_proj, B in the pieces z, x, B, C, dt, and mixer.out_proj; attention;
// an ungated squared-ReLU MLP; a latent MoE's experts on the latent vectors).
// Gemma 4's layers: linear_qkv of the layer's own head size and KV heads, without value rows (adapter_v) where the keys
// are the values; in a KV-sharing layer the linear_qkv target adapts its linear_q_proj (adapter_q alone); MLPs twice as
// wide there with double_wide_mlp; an MoE layer's dense MLP is its shared expert.
Result<std::vector<CanonicalTensor>> lora_tensors(const GptModelSpec& spec, const LoraConfig& config);

// The name of base tensor `module`'s adapter tensor: "<module>.adapter[.<part>].linear_<in|out>.weight[.<piece>]"
// (module is e.g. decoder.layers.3.self_attention.linear_qkv; part "" or adapter_q, ...; piece "" or one of the
// base's pieces, for a B only).
std::string lora_tensor_name(const std::string& module, const std::string& part, bool in,
                             const std::string& piece = "");

}  // namespace trestle
