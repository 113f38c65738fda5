#include "convert/bridge_verify.h"

#include <cmath>
#include <filesystem>
#include <limits>

#include "ckpt/dtype_cast.h"
#include "ckpt/json_file.h"
#include "convert/bridge/bridge_copy.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/sources/canonical_source.h"
#include "convert/sources/hf_model.h"

namespace trestle {

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
  TRESTLE_RETURN_IF_ERROR(check_mtp_copies(bridged.model, source, present, hf_dir));
  TRESTLE_RETURN_IF_ERROR(check_accounting(hf_shapes(plan), present, hf_dir));
  TRESTLE_RETURN_IF_ERROR(check_accounting(canonical_shapes(plan), stored, checkpoint.description()));
  // A quantised directory is compared dequantised, as its own config.json says.
  HfQuantization quantization;
  const std::string config = (std::filesystem::path(hf_dir) / "config.json").string();
  if (std::filesystem::exists(config)) {
    TRESTLE_ASSIGN_OR_RETURN(const auto json, read_json_file(config));
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
