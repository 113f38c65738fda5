#include "convert/bridge/megatron_dist_names.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "ckpt/dtype_cast.h"

namespace trestle {
namespace {

constexpr std::string_view kLayers = "decoder.layers.";
constexpr std::string_view kLocalExperts = "mlp.experts.local_experts.";
constexpr std::string_view kDistExperts = "mlp.experts.experts.";

constexpr std::string_view kMtpLayer = ".transformer_layer.";

// A layer's parameter name `rest` (after "decoder.layers.{i}." or "mtp.layers.{k}.transformer_layer.") with the
// expert index removed, as `spec` saves it: the local GPT spec renames an MoE layer's pre-MLP norm, except with
// multi-latent attention or in a hybrid MambaModel (`own_names`), whose specs save their own names.
std::string layer_param(const BridgeTensor& t, std::string rest, NormNaming spec, bool own_names) {
  if (spec == NormNaming::kLocal && !own_names && rest == "pre_mlp_layernorm.weight")
    return "mlp.linear_fc1.layer_norm_weight";
  if (t.expert >= 0 && rest.starts_with(kLocalExperts)) {
    const auto dot = rest.find('.', kLocalExperts.size());
    rest = std::string(kDistExperts) + rest.substr(dot + 1);
  }
  return rest;
}

}  // namespace

DistPlacement dist_placement(const BridgeTensor& t, LayerKeys style, NormNaming spec, std::int64_t num_layers,
                             std::int64_t num_experts, bool own_names) {
  DistPlacement p;
  // A multi-token-prediction layer's decoder layer: its own keys (no layer axis), experts with their axis.
  if (const auto at = t.name.find(kMtpLayer); t.name.starts_with("mtp.layers.") && at != std::string::npos) {
    const std::size_t end = at + kMtpLayer.size();
    p.key = t.name.substr(0, end) + layer_param(t, t.name.substr(end), spec, own_names);
    if (t.expert >= 0) {
      p.leading.push_back(num_experts);
      p.index.push_back(t.expert);
    }
    return p;
  }
  if (t.layer < 0 || !t.name.starts_with(kLayers)) {
    p.key = t.name;
    return p;
  }
  const std::string param = layer_param(t, t.name.substr(t.name.find('.', kLayers.size()) + 1), spec, own_names);
  if (style == LayerKeys::kStacked) {
    p.key = std::string(kLayers) + param;
    p.leading.push_back(num_layers);
    p.index.push_back(t.layer);
  } else {
    p.key = std::string(kLayers) + std::to_string(t.layer) + "." + param;
  }
  if (t.expert >= 0) {
    p.leading.push_back(num_experts);
    p.index.push_back(t.expert);
  }
  return p;
}

namespace {

// A key of a vision-language model's vision tower or projector (Qwen3-VL's vision_model.*, Gemma 3's vision_tower.*
// and multi_modal_projector.*).
bool is_vision_key(std::string_view key) {
  return key.starts_with("vision_model.") || key.starts_with("vision_tower.") ||
         key.starts_with("multi_modal_projector.");
}

}  // namespace

std::string vision_language_key(const std::string& key) {
  return is_vision_key(key) ? key : "language_model." + key;
}

namespace {

constexpr std::string_view kVisionLayers = "vision_model.decoder.layers.";
constexpr std::string_view kVisionMergers = "vision_model.decoder.deepstack_merger_list.";

// The index N of a name `prefix` N . rest, or -1.
std::int64_t stack_index(std::string_view name, std::string_view prefix) {
  if (!name.starts_with(prefix)) return -1;
  const std::size_t dot = name.find('.', prefix.size());
  if (dot == std::string_view::npos || dot == prefix.size() || dot - prefix.size() > 6) return -1;
  std::int64_t n = 0;
  for (const char c : name.substr(prefix.size(), dot - prefix.size())) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

}  // namespace

VisionStacks vision_stacks(const BridgePlan& plan) {
  VisionStacks s;
  for (const auto& t : plan.tensors) {
    s.layers = std::max(s.layers, stack_index(t.name, kVisionLayers) + 1);
    s.mergers = std::max(s.mergers, stack_index(t.name, kVisionMergers) + 1);
  }
  return s;
}

void stack_vision_placement(DistPlacement& p, const VisionStacks& stacks) {
  for (const auto& [prefix, count] : {std::pair{kVisionLayers, stacks.layers}, std::pair{kVisionMergers, stacks.mergers}}) {
    const std::int64_t n = stack_index(p.key, prefix);
    if (n < 0 || n >= count) continue;
    p.key = std::string(prefix) + p.key.substr(p.key.find('.', prefix.size()) + 1);
    p.leading.insert(p.leading.begin(), count);
    p.index.insert(p.index.begin(), n);
    return;
  }
}

Shape dist_global_shape(const DistPlacement& p, const BridgeTensor& t, std::int64_t padded_vocab) {
  Shape shape = p.leading;
  for (std::size_t d = 0; d < t.shape.size(); ++d)
    shape.push_back(d == 0 && t.split == TpSplit::kVocab ? padded_vocab : t.shape[d]);
  return shape;
}

Box dist_box(const DistPlacement& p, const Box& box) {
  Box out;
  out.offset = p.index;
  out.shape = Shape(p.index.size(), 1);
  out.offset.insert(out.offset.end(), box.offset.begin(), box.offset.end());
  out.shape.insert(out.shape.end(), box.shape.begin(), box.shape.end());
  return out;
}

std::vector<std::string> extra_state_keys(std::int64_t layer, std::int64_t num_layers, std::int64_t num_experts,
                                          bool shared_expert) {
  std::vector<std::string> keys;
  const std::string shard = "._extra_state/shard_" + std::to_string(layer);
  const std::string shape = "_" + std::to_string(num_layers);
  for (const char* m : {"self_attention.linear_qkv", "self_attention.linear_proj"})
    keys.push_back(std::string(kLayers) + m + shard + shape);
  if (num_experts == 0) {
    for (const char* m : {"mlp.linear_fc1", "mlp.linear_fc2"}) keys.push_back(std::string(kLayers) + m + shard + shape);
    return keys;
  }
  for (std::int64_t e = 0; e < num_experts; ++e)
    for (const char* m : {"linear_fc1", "linear_fc2"})
      keys.push_back(std::string(kLayers) + std::string(kDistExperts) + m + shard + "." + std::to_string(e) + shape +
                     "." + std::to_string(num_experts));
  if (shared_expert)
    for (const char* m : {"mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"})
      keys.push_back(std::string(kLayers) + m + shard + shape);
  return keys;
}

std::optional<std::string> module_extra_state_key(const BridgeTensor& t, const DistPlacement& p,
                                                  std::int64_t num_experts) {
  const bool vision_stack = p.key.starts_with(kVisionLayers) || p.key.starts_with(kVisionMergers);
  if (p.leading.size() != (t.expert >= 0 || vision_stack ? 1u : 0u)) return std::nullopt;
  // Gemma 3's vision tower and projector are transformers' own modules in Megatron-Bridge's model: no extra state.
  if (is_vision_key(p.key) && !p.key.starts_with("vision_model.")) return std::nullopt;
  // A Gated DeltaNet's in_proj is saved in parts (in_proj.weight.query, ...): its module is in_proj all the same.
  const auto split = p.key.find(".in_proj.weight.");
  if (!p.key.ends_with(".weight") && split == std::string::npos) return std::nullopt;
  const std::string module = split != std::string::npos ? p.key.substr(0, split + 8) : p.key.substr(0, p.key.size() - 7);
  const std::string last = module.substr(module.rfind('.') + 1);
  if (!last.starts_with("linear_") && !last.ends_with("_latent_proj") && last != "eh_proj" && last != "in_proj" &&
      last != "out_proj")
    return std::nullopt;
  if (vision_stack) return module + "._extra_state/shard_" + std::to_string(p.index[0]) + "_" + std::to_string(p.leading[0]);
  return module + "._extra_state/shard_" +
         (t.expert >= 0 ? std::to_string(t.expert) + "_" + std::to_string(num_experts) : "0_1");
}

std::span<const DistOptimizerState> dist_optimizer_states() {
  static constexpr DistOptimizerState kStates[] = {
      {"exp_avg", "exp_avg"}, {"exp_avg_sq", "exp_avg_sq"}, {"fp32_param", "fp32_param"}, {"fp32_param", "param"}};
  return kStates;
}

std::string dist_optimizer_key(std::string_view megatron_state, const std::string& weight_key) {
  return "optimizer.state." + std::string(megatron_state) + "." + weight_key;
}

std::string trestle_optimizer_name(std::string_view trestle_state, const std::string& weight) {
  return "optimizer." + std::string(trestle_state) + "." + weight;
}

Result<std::int64_t> step_value(DType dtype, std::span<const std::byte> element) {
  if (element.size() != dtype_size(dtype)) return Status::Error("a step counter must be one element");
  auto as = [&](auto value) {
    std::memcpy(&value, element.data(), sizeof value);
    return static_cast<std::int64_t>(value);
  };
  switch (dtype) {
    case DType::kI64:
      return as(std::int64_t{});
    case DType::kU64:
      return as(std::uint64_t{});
    case DType::kI32:
      return as(std::int32_t{});
    case DType::kU32:
      return as(std::uint32_t{});
    default:
      break;
  }
  if (!is_floating(dtype)) return Status::Error("a step counter of dtype " + std::string(dtype_name(dtype)));
  double value = 0;
  TRESTLE_RETURN_IF_ERROR(cast_elements(dtype, element, DType::kF64, std::as_writable_bytes(std::span(&value, 1))));
  return std::llround(value);
}

bool is_non_model_dist_key(const std::string& key) {
  return key.ends_with("_extra_state") || key.find("._extra_state/") != std::string::npos ||
         key.starts_with("rng_state") || key.starts_with("rerun_state_machine");
}

}  // namespace trestle
