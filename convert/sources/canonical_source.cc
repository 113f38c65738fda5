#include "convert/sources/canonical_source.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string_view>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/hex_digest.h"
#include "ckpt/json_file.h"
#include "ckpt/manifest.h"
#include "ckpt/regular_file.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/bridge/megatron_args.h"
#include "convert/formats/torch/megatron_legacy.h"

namespace trestle {
namespace fs = std::filesystem;

std::string_view format_name(CheckpointFormat format) {
  switch (format) {
    case CheckpointFormat::kHf:
      return "hf";
    case CheckpointFormat::kTrestle:
      return "trestle";
    case CheckpointFormat::kTorchDist:
      return "megatron-dist";
    case CheckpointFormat::kLegacy:
      return "megatron-legacy";
    case CheckpointFormat::kHfPeft:
      return "hf-peft";
  }
  return "?";
}

Result<CheckpointFormat> parse_format(const std::string& name) {
  for (auto f : {CheckpointFormat::kHf, CheckpointFormat::kTrestle, CheckpointFormat::kTorchDist,
                 CheckpointFormat::kLegacy, CheckpointFormat::kHfPeft})
    if (format_name(f) == name) return f;
  if (name == "torch_dist" || name == "torch-dist") return CheckpointFormat::kTorchDist;
  return Status::Error("unknown checkpoint format '" + name +
                       "' (formats: hf, trestle, megatron-dist (torch_dist), megatron-legacy, hf-peft)");
}

namespace {

// True when some iter_* directory under root holds `file`.
bool any_iteration_holds(const fs::path& root, const char* file) {
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code file_ec;
    if (it->path().filename().string().starts_with("iter_") && fs::exists(it->path() / file, file_ec)) return true;
  }
  return false;
}

}  // namespace

Result<CheckpointFormat> detect_format(const std::string& path, std::optional<std::int64_t> iteration) {
  std::error_code ec;
  const fs::path p(path);
  if (!fs::is_directory(p, ec)) return Status::Error(path + ": not a directory");
  if (fs::exists(p / "manifest.json", ec)) return CheckpointFormat::kTrestle;
  if (fs::exists(p / ".metadata", ec)) return CheckpointFormat::kTorchDist;
  if (iteration && *iteration >= 0) {
    const fs::path iter = p / iteration_dir_name(*iteration);
    if (fs::exists(iter / "manifest.json", ec)) return CheckpointFormat::kTrestle;
    if (fs::exists(iter / ".metadata", ec)) return CheckpointFormat::kTorchDist;
    if (is_legacy_checkpoint(iter.string())) return CheckpointFormat::kLegacy;
  }
  if (is_legacy_checkpoint(path)) return CheckpointFormat::kLegacy;
  const auto tracker = read_tracker(path);
  const bool has_hf_config = fs::exists(p / "adapter_config.json", ec) || fs::exists(p / "config.json", ec);
  if (!tracker.ok() && !has_hf_config) return tracker.status();
  const bool has_tracker = tracker.ok() && tracker->present;
  if (has_tracker) {
    const fs::path iter = tracked_iteration_dir(path, *tracker);
    if (fs::exists(iter / "manifest.json", ec)) return CheckpointFormat::kTrestle;
    if (fs::exists(iter / ".metadata", ec)) return CheckpointFormat::kTorchDist;
  }
  if (has_tracker && !has_hf_config) {
    // A tracker naming no iteration found here (or no number at all) is still the root of a Megatron-style checkpoint:
    // its format's reader says what the tracker holds and which iterations are committed.
    return any_iteration_holds(p, ".metadata") ? CheckpointFormat::kTorchDist : CheckpointFormat::kTrestle;
  }
  if (fs::exists(p / "adapter_config.json", ec)) return CheckpointFormat::kHfPeft;
  if (fs::exists(p / "config.json", ec)) return CheckpointFormat::kHf;
  // A root whose tracker is gone: its iterations say the format, and that format's reader says what is missing.
  if (any_iteration_holds(p, ".metadata")) return CheckpointFormat::kTorchDist;
  if (any_iteration_holds(p, "manifest.json")) return CheckpointFormat::kTrestle;
  // A root a Trestle job saves into before its first commit (its lock, a save's staging): its reader says that nothing
  // is committed there yet.
  if (holds_uncommitted_save(path)) return CheckpointFormat::kTrestle;
  return Status::Error(
      path +
      ": not a checkpoint Trestle recognises (looked for .metadata (torch_dist), manifest.json "
      "or a tracker file (trestle), mp_rank_* directories (megatron-legacy), adapter_config.json (hf-peft), "
      "config.json (hf))");
}

Status CanonicalSource::read_many(std::span<const LoadRequest> requests) const {
  for (const auto& r : requests) {
    const LayoutTensor* t = find(r.name);
    if (!t) return Status::Error(description() + ": no tensor '" + r.name + "'");
    TRESTLE_RETURN_IF_ERROR(
        read(r.name, r.piece, {r.destination, static_cast<std::size_t>(r.piece.numel()) * dtype_size(t->dtype)}));
  }
  return OkStatus();
}

const LayoutTensor* CanonicalSource::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

// A model's weights are floating-point numbers: an integer or boolean one is a damaged or hostile file, which would
// otherwise be converted as it is (optimizer state keeps its own types: a step count).
Result<std::unique_ptr<CanonicalSource>> with_float_weights(Result<std::unique_ptr<CanonicalSource>> source) {
  if (!source.ok()) return source;
  for (const LayoutTensor& t : (*source)->tensors())
    if (!t.name.starts_with("optimizer.") && !is_floating(t.dtype))
      return Status::Error((*source)->description() + ": tensor '" + t.name + "' is stored as " +
                           std::string(dtype_name(t.dtype)) +
                           "; a model weight must be floating point (f32, bf16, "
                           "f16, f64 or f8)");
  return source;
}

Result<std::unique_ptr<CanonicalSource>> open_source_of_format(CheckpointFormat format, const std::string& path,
                                                               const SourceOptions& options) {
  switch (format) {
    case CheckpointFormat::kHf:
      return open_hf_source(path, options);
    case CheckpointFormat::kTrestle:
      return open_trestle_source(path, options);
    case CheckpointFormat::kTorchDist:
      return open_torch_dist_source(path, options);
    case CheckpointFormat::kLegacy:
      return open_legacy_source(path, options);
    case CheckpointFormat::kHfPeft:
      return Status::Error(path +
                           " is a PEFT adapter, not a model: it converts to an adapter checkpoint for a base "
                           "(--from hf-peft DIR --base BASE --to trestle CKPT)");
  }
  return Status::Error("unknown format");
}

}  // namespace

Result<std::unique_ptr<CanonicalSource>> open_canonical_source(CheckpointFormat format, const std::string& path,
                                                               const SourceOptions& options) {
  auto source = with_float_weights(open_source_of_format(format, path, options));
  if (source.ok()) (*source)->path_ = path;
  return source;
}

Status copy_side_files(const CanonicalSource& source, const std::string& to) {
  return copy_side_files(source.side_files_dir(), to, source.model().side_files, source.side_file_links());
}

namespace {

// A description's error names the file it came from.
template <class T>
Result<T> named(Result<T> result, const std::string& path) {
  if (result.ok() || result.status().message().find(path) != std::string::npos) return result;
  return result.status().with_context(path);
}

}  // namespace

Result<BridgedModel> megatron_source_model(const SourceOptions& options, const std::string& kept_model,
                                           const PickleValue* args, const std::string& source) {
  std::error_code ec;
  if (options.hf_config.empty() && fs::exists(fs::symlink_status(kept_model, ec))) {
    TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link(kept_model));
    TRESTLE_ASSIGN_OR_RETURN(const nlohmann::json kept, read_json_file(kept_model));
    return named(bridged_model_from_json(kept, kept_model), kept_model);
  }
  const bool has_args = is_megatron_args(args);
  if (options.hf_config.empty()) {
    if (args && !args->is(PickleKind::kNone)) return bridged_model_from_args(args, source);
    return Status::Error(source +
                         ": nothing describes the model: no Megatron args (argparse.Namespace 'args' in "
                         "common.pt or the rank files) and no " +
                         std::string(kKeptModelFile) + "; give the model's config.json with --hf-config");
  }
  std::string config_path = options.hf_config;
  if (fs::is_directory(config_path, ec)) config_path = (fs::path(config_path) / "config.json").string();
  TRESTLE_ASSIGN_OR_RETURN(const HfModelConfig config, read_hf_config(config_path));
  BridgedModel b;
  TRESTLE_ASSIGN_OR_RETURN(b.model, named(bridge_model_from_config(config), config_path));
  if (has_args) {  // the layout that saved it, whatever else args describe
    TRESTLE_ASSIGN_OR_RETURN(b.layout, megatron_layout_from_args(args, source));
  }
  return b;
}

void count_stored_mtp_layers(BridgedModel& model, const std::vector<std::string>& names) {
  if (!model.model.has_mtp() || model.model.mtp_layers != 0) return;
  // One pass over the names (a stranger's file may hold many), then the layers 0, 1, ... that are all there.
  static constexpr std::string_view kLayers = "mtp.layers.", kProjection = ".eh_proj.weight";
  std::set<std::int64_t> stored;
  for (const std::string& n : names) {
    const std::size_t at = n.rfind(kLayers);
    if (at == std::string::npos || (at > 0 && n[at - 1] != '.') || !n.ends_with(kProjection) ||
        n.size() < at + kLayers.size() + kProjection.size())
      continue;
    const std::string_view digits(n.data() + at + kLayers.size(), n.size() - at - kLayers.size() - kProjection.size());
    if (digits.empty() || digits.size() > 9 ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    stored.insert(std::stoll(std::string(digits)));
  }
  while (stored.count(model.model.mtp_layers)) ++model.model.mtp_layers;
}

Result<std::string> weights_origin_digest(const nlohmann::json& training, const std::string& manifest_path) {
  const auto record = training.is_object() ? training.find(kWeightsOriginKey) : training.end();
  if (!training.is_object() || record == training.end()) return manifest_file_digest(manifest_path);
  if (!record->is_string() || !is_hex_digest(record->get_ref<const std::string&>()))
    return Status::Error(manifest_path + ": training state: " + kWeightsOriginKey + " is " +
                         record->dump().substr(0, 80) +
                         ", expected the 16 lower-case hexadecimal digits of a manifest's digest");
  return record->get<std::string>();
}

}  // namespace trestle
