#include "convert/bridge_verify.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <tuple>

#include "ckpt/dtype_cast.h"
#include "ckpt/json_file.h"
#include "convert/bridge/bridge_copy.h"
#include "convert/bridge/hf_config.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/sources/canonical_source.h"
#include "convert/sources/hf_model.h"

namespace trestle {
namespace {

// The sizes that decide how tensors of one shape are read (how a fused QKV splits into heads, a Mamba projection into
// its parts, MLA's projections into their heads): equal tensors under different values here are different models.
// Sizes that change shapes are left to the tensor accounting, which names the tensor.
std::vector<std::pair<std::string, std::int64_t>> layout_sizes(const BridgeModel& m) {
  std::vector<std::pair<std::string, std::int64_t>> sizes = {{"num_attention_heads", m.hf.num_attention_heads}};
  if (m.deepseek()) {
    sizes.insert(sizes.end(), {{"q_lora_rank", m.q_lora_rank},
                               {"kv_lora_rank", m.kv_lora_rank},
                               {"qk_nope_head_dim", m.qk_nope_head_dim},
                               {"qk_rope_head_dim", m.qk_rope_head_dim},
                               {"v_head_dim", m.v_head_dim}});
  } else {
    sizes.insert(sizes.end(), {{"num_key_value_heads", m.hf.num_kv_heads}, {"head_dim", m.hf.head_dim}});
  }
  if (m.nemotron_h()) {
    sizes.insert(sizes.end(), {{"mamba_num_heads", m.mamba_num_heads},
                               {"mamba_head_dim", m.mamba_head_dim},
                               {"n_groups", m.mamba_num_groups},
                               {"ssm_state_size", m.mamba_state_dim}});
  }
  if (m.gated_delta_net) {
    sizes.insert(sizes.end(), {{"linear_num_key_heads", m.linear_num_key_heads},
                               {"linear_num_value_heads", m.linear_num_value_heads},
                               {"linear_key_head_dim", m.linear_key_head_dim},
                               {"linear_value_head_dim", m.linear_value_head_dim}});
  }
  return sizes;
}

// The Hugging Face directory's config.json (when it has one) must describe the checkpoint's model: its layout sizes
// (above), the same tensors (names and shapes: layers, sizes, vocabulary, tied embeddings, experts), the same RoPE
// base and norm epsilon. Not its architecture: a model made by Megatron from its args is described as the nearest one
// the args name. `vision_tower`: the directory nests its vision tower's names (both models are named so).
Status check_same_model(const BridgeModel& ours, const nlohmann::json& config_json, const std::string& config_path,
                        const std::string& checkpoint, bool vision_tower) {
  TRESTLE_ASSIGN_OR_RETURN(const HfModelConfig config, parse_hf_config(config_json, config_path));
  TRESTLE_ASSIGN_OR_RETURN(BridgeModel theirs, bridge_model_from_config(config));
  name_vision_tower(theirs, vision_tower);
  // Counted or listed from the stored tensors, not from config.json: multi-token-prediction layers, and the towers a
  // model carries as found (Gemma 4's).
  if (theirs.has_mtp() && ours.has_mtp()) theirs.mtp_layers = ours.mtp_layers;
  if (carries_towers_as_found(theirs) && carries_towers_as_found(ours)) theirs.vision_tensors = ours.vision_tensors;
  const auto expected = layout_sizes(ours);
  const auto found = layout_sizes(theirs);
  for (std::size_t i = 0; i < expected.size() && i < found.size(); ++i) {
    if (expected[i].second != found[i].second) {
      return Status::Error(config_path + ": " + found[i].first + " is " + std::to_string(found[i].second) + ", but " +
                           checkpoint + "'s model has " + std::to_string(expected[i].second) +
                           "; the same tensors would be read as a different model");
    }
  }
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan mine, make_bridge_plan(ours, NormNaming::kLocal, ExpertLayout::kOriginal));
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan other,
                           make_bridge_plan(theirs, NormNaming::kLocal, ExpertLayout::kOriginal));
  const auto expected_shapes = canonical_shapes(mine), described = canonical_shapes(other);
  auto missing_from = [&](const std::map<std::string, Shape>& a, const std::map<std::string, Shape>& b) {
    for (const auto& [name, shape] : a)
      if (!b.count(name)) return name;
    return std::string();
  };
  for (const auto& [name, shape] : expected_shapes)
    if (const auto it = described.find(name); it != described.end() && it->second != shape)
      return Status::Error(config_path + " describes " + name + " as " + to_string(it->second) + ", but " + checkpoint +
                           "'s model has it as " + to_string(shape) + ": another model");
  if (const std::string name = missing_from(expected_shapes, described); !name.empty())
    return Status::Error(config_path + " describes a model without " + name + ", which " + checkpoint +
                         "'s model has: another model");
  if (const std::string name = missing_from(described, expected_shapes); !name.empty())
    return Status::Error(config_path + " describes a model with " + name + ", which " + checkpoint +
                         "'s model does not have: another model");
  for (const auto& [key, mine_value, theirs_value] :
       {std::tuple{"rope_theta", ours.hf.rope_theta, theirs.hf.rope_theta},
        std::tuple{"the norm epsilon", ours.hf.norm_eps, theirs.hf.norm_eps}})
    if (mine_value && theirs_value && *mine_value != *theirs_value)
      return Status::Error(config_path + ": " + key + " is " + std::to_string(*theirs_value) + ", but " + checkpoint +
                           "'s model has " + std::to_string(*mine_value) + ": another model");
  // What the same tensors compute, beyond their shapes: the whole Megatron description a trainer builds from each
  // (RoPE scaling, rotary share, windows, soft-capping, ...), but for the longest sequence it was set up for.
  auto described_as_megatron = [](const BridgeModel& model) {
    BridgedModel bridged;
    bridged.model = model;
    nlohmann::json megatron = bridged_model_to_json(bridged).at("megatron");
    for (const char* apart : {"max_position_embeddings", "padded_vocab_size", "carried_tensors"}) megatron.erase(apart);
    return megatron;
  };
  const nlohmann::json a = described_as_megatron(ours), b = described_as_megatron(theirs);
  for (const auto& [key, value] : b.items())
    if (!a.contains(key) || a[key] != value)
      return Status::Error(config_path + " describes " + key + " as " + value.dump() + ", but " + checkpoint +
                           "'s model has " + (a.contains(key) ? a[key].dump() : std::string("none")) +
                           ": another model");
  for (const auto& [key, value] : a.items())
    if (!b.contains(key))
      return Status::Error(config_path + " describes no " + key + ", but " + checkpoint + "'s model has " +
                           value.dump() + ": another model");
  return OkStatus();
}

}  // namespace

Result<BridgeComparison> compare_with_hf(const CanonicalSource& checkpoint, const std::string& hf_dir) {
  const BridgedModel& bridged = checkpoint.model();
  TRESTLE_RETURN_IF_ERROR(check_hf_dir_links(hf_dir));  // the files convert would refuse are not read here either
  TRESTLE_ASSIGN_OR_RETURN(auto source, SafetensorsCheckpoint::open(hf_dir));
  std::vector<std::string> names;
  std::map<std::string, Shape> stored;
  std::map<std::string, DType> dtypes;
  for (const auto& t : checkpoint.tensors()) {
    if (t.name.starts_with("optimizer.")) continue;  // training state has no Hugging Face counterpart
    names.push_back(t.name);
    stored[t.name] = t.shape;
    dtypes[t.name] = t.dtype;
  }
  std::map<std::string, Shape> present;
  for (const auto& name : source.names()) present[name] = source.find(name)->entry->shape;
  BridgeModel model = bridged.model;
  name_vision_tower(model, has_nested_vision_tower(source.names()));  // compared under the names it has
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan,
                           make_bridge_plan(model, detect_norm_naming(names), detect_expert_layout(model, present)));
  TRESTLE_RETURN_IF_ERROR(account_quantized(source, plan.hf, present, hf_dir));
  TRESTLE_RETURN_IF_ERROR(check_shared_copies(bridged.model, source, present, hf_dir));
  TRESTLE_RETURN_IF_ERROR(check_accounting(hf_shapes(plan), present, hf_dir));
  TRESTLE_RETURN_IF_ERROR(check_accounting(canonical_shapes(plan), stored, checkpoint.description()));
  // A quantised directory is compared dequantised, as its own config.json says.
  HfQuantization quantization;
  const std::string config = (std::filesystem::path(hf_dir) / "config.json").string();
  if (std::filesystem::exists(config)) {
    TRESTLE_ASSIGN_OR_RETURN(const auto json, read_json_file(config));
    TRESTLE_RETURN_IF_ERROR(
        check_same_model(model, json, config, checkpoint.description(), has_nested_vision_tower(source.names())));
    TRESTLE_ASSIGN_OR_RETURN(quantization, hf_quantization(json, config));
  }
  TRESTLE_ASSIGN_OR_RETURN(auto hf_tensors, stored_hf_tensors(source, plan.hf, quantization));
  const std::uint64_t budget = default_cache_budget(hf_tensors);
  SourceTensorCache cache(std::move(hf_tensors), budget);
  const auto sources = hf_sources_per_tensor(plan);

  BridgeComparison out;
  std::vector<std::byte> loaded;
  constexpr std::int64_t kSlice = 1 << 20;  // elements compared at a time, as f64
  std::vector<double> ours(kSlice), theirs(kSlice);
  for (std::size_t index = 0; index < plan.tensors.size(); ++index) {
    const BridgeTensor& t = plan.tensors[index];
    const DType dtype = dtypes.at(t.name);
    TRESTLE_ASSIGN_OR_RETURN(const auto pinned, cache.pin(sources[index]));
    const auto& views = pinned.views();
    const std::size_t size = dtype_size(dtype);
    loaded.resize(static_cast<std::size_t>(numel(t.shape)) * size);
    TRESTLE_RETURN_IF_ERROR(checkpoint.read(t.name, Piece{whole_box(t.shape), std::nullopt}, loaded));
    double diff = 0;
    for (std::int64_t begin = 0; begin < numel(t.shape); begin += kSlice) {
      const auto n = static_cast<std::size_t>(std::min(kSlice, numel(t.shape) - begin));
      const auto mine = std::as_writable_bytes(std::span(ours.data(), n));
      TRESTLE_RETURN_IF_ERROR(cast_elements(
          dtype, std::span(loaded).subspan(static_cast<std::size_t>(begin) * size, n * size), DType::kF64, mine));
      TRESTLE_RETURN_IF_ERROR(gather_canonical(t, begin, static_cast<std::int64_t>(n), views, DType::kF64,
                                               std::as_writable_bytes(std::span(theirs.data(), n))));
      for (std::size_t i = 0; i < n; ++i) {
        if (std::isnan(ours[i]) || std::isnan(theirs[i])) {
          if (std::isnan(ours[i]) != std::isnan(theirs[i])) diff = std::numeric_limits<double>::infinity();
          continue;
        }
        if (ours[i] != theirs[i]) diff = std::max(diff, std::fabs(ours[i] - theirs[i]));
      }
    }
    out.tensors.push_back({t.name, diff});
    out.max_abs_diff = std::max(out.max_abs_diff, diff);
  }
  return out;
}

}  // namespace trestle
