// Where a canonical Megatron tensor lives in a `torch_dist` checkpoint: its key and the box of that key's global tensor
// that a canonical box maps to. Megatron-Core stacks homogeneous layers into one key `decoder.layers.<param>` with a
// leading [num_layers] axis (the default); per-layer keys `decoder.layers.<i>.<param>` are the other style. Experts are
// `…mlp.experts.experts.<param>` with an [num_experts] axis after the layer axis (SequentialMLP and TEGroupedMLP save
// alike). The vocab dimension of embedding and output layer is padded. Everything else (QKV group order, the global
// gated fc1 [all gate; all up]) is already the canonical global tensor. Layer norms are stored under Transformer
// Engine names whatever the spec (Megatron-Core's local spec renames them on save), so keys come from a plan made
// with NormNaming::kTransformerEngine; the one exception is an MoE layer's pre-MLP norm, which the TE spec saves as
// `pre_mlp_layernorm.weight` and the local spec as `mlp.linear_fc1.layer_norm_weight`. Pure functions; no I/O.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/dtype.h"
#include "ckpt/status.h"
#include "convert/bridge/bridge_plan.h"

namespace trestle {

enum class LayerKeys { kStacked, kPerLayer };

struct DistPlacement {
  std::string key;
  Shape leading;  // the extents of the prepended axes ([L], [L, E], [E] or none)
  Shape index;    // this tensor's position along them
};

// The key of canonical tensor `t` (named as under NormNaming::kTransformerEngine; with multi-latent attention or in a
// hybrid MambaModel (`own_names`) as under `spec`, whose names both specs save as they are) in a model of num_layers
// layers and num_experts experts,
// as Megatron-Core's `spec` saves it. Multi-token-prediction layers (mtp.layers.<k>.transformer_layer.*) have keys of
// their own, experts with their [num_experts] axis.
DistPlacement dist_placement(const BridgeTensor& t, LayerKeys style, NormNaming spec, std::int64_t num_layers,
                             std::int64_t num_experts, bool own_names = false);
// Megatron-Bridge's vision-language models (Qwen3VLModel, Gemma3VLModel) keep the language model under
// language_model. beside their vision tower and projector: `key` of such a model as it saves it (prefixed unless it
// is the vision tower's or the projector's).
std::string vision_language_key(const std::string& key);
// Megatron-Bridge's Qwen3-VL vision tower is a Megatron-Core TransformerBlock: it saves its blocks
// (vision_model.decoder.layers.N.*) and its deepstack mergers (vision_model.decoder.deepstack_merger_list.N.*) stacked,
// as the language model's layers are, under one key each with a leading [count] axis.
struct VisionStacks {
  std::int64_t layers = 0, mergers = 0;
};
VisionStacks vision_stacks(const BridgePlan& plan);  // the counts, from the plan's names
// `p`, the placement of a tensor named as it is, moved into its stack; others unchanged.
void stack_vision_placement(DistPlacement& p, const VisionStacks& stacks);
// The key's global shape: leading axes, then the canonical shape with the vocab dimension padded to padded_vocab.
Shape dist_global_shape(const DistPlacement& p, const BridgeTensor& t, std::int64_t padded_vocab);
// The box of the key's global tensor that holds canonical box `box` of `t` (same elements, same row-major order).
Box dist_box(const DistPlacement& p, const Box& box);
// The `_extra_state` objects Megatron-Core saves for layer `layer` (stacked: `decoder.layers.<module>._extra_state/
// shard_<layer>_<num_layers>`; experts `…experts.experts.linear_fc1._extra_state/shard_<layer>.<e>_<L>.<E>`), one
// per linear module: its load asks for them although they hold no weights (torch.save([None]) outside FP8 training).
std::vector<std::string> extra_state_keys(std::int64_t layer, std::int64_t num_layers, std::int64_t num_experts,
                                          bool shared_expert);
// The same for a tensor placed without a layer axis (per-layer keys, multi-token-prediction layers), when it is a
// linear module's weight (`linear_*`, eh_proj): `<module>._extra_state/shard_0_1`, an expert's
// `…experts.experts.linear_fc1._extra_state/shard_<e>_<E>`, a stacked vision block's or merger's
// `<module>._extra_state/shard_<n>_<count>`; nothing for other tensors, stacked language layers (extra_state_keys) and
// Gemma 3's vision tower (transformers' modules in Megatron-Bridge's model).
std::optional<std::string> module_extra_state_key(const BridgeTensor& t, const DistPlacement& p,
                                                  std::int64_t num_experts);

// Adam state in Megatron-Core's model space: each state of a weight is a tensor `optimizer.state.<state>.<weight key>`
// with the weight key's global shape and chunks (leading axes, padded vocab, fc1 [all gate; all up]). Its
// non-distributed optimizers save states exp_avg, exp_avg_sq and (mixed precision) fp32_param; the distributed
// optimizer's 'fully_reshardable' format names the fp32 master `param`. Trestle calls them
// `optimizer.<exp_avg | exp_avg_sq | fp32_param>.<canonical weight name>`.
struct DistOptimizerState {
  const char* trestle;   // Trestle's state name
  const char* megatron;  // the state name in the key
};
// The states, in order of preference: of two with the same Trestle name, the first found is read and the first is
// written (fp32_param, not param).
std::span<const DistOptimizerState> dist_optimizer_states();
std::string dist_optimizer_key(std::string_view megatron_state, const std::string& weight_key);
// Trestle's name of a weight's optimizer state.
std::string trestle_optimizer_name(std::string_view trestle_state, const std::string& weight);
// Trestle's optimizer step counter (a scalar); Megatron-Core keeps it as `common_step` in the common state.
inline constexpr std::string_view kTrestleOptimizerStep = "optimizer.step";
// A step counter's value from one element of any integer or floating dtype (torch's Adam keeps a float tensor).
Result<std::int64_t> step_value(DType dtype, std::span<const std::byte> element);

// Entries that carry no weights and no model-space optimizer state: Transformer Engine's `_extra_state`, and the
// RNG / rerun state a training checkpoint holds besides the model.
bool is_non_model_dist_key(const std::string& key);

}  // namespace trestle
