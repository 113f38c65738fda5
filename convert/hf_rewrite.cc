#include "convert/hf_rewrite.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "ckpt/atomic_file.h"
#include "ckpt/byte_size.h"
#include "ckpt/dtype_cast.h"
#include "ckpt/json_file.h"
#include "ckpt/progress.h"
#include "convert/bridge/architectures.h"
#include "convert/bridge/hf_config.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "convert/output_dir.h"
#include "convert/sources/hf_model.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

// config.json records the dtype; when tensors are cast, the copy says the new one, in a vision-language model's parts
// too (as set_model_dtype does for a converted model's).
Status copy_config(const fs::path& from, const fs::path& to, std::optional<DType> dtype) {
  TRESTLE_ASSIGN_OR_RETURN(nlohmann::ordered_json config, read_ordered_json_file(from.string()));
  const std::string torch = std::string(torch_name(*dtype)).substr(6);
  auto mark = [&](nlohmann::ordered_json& part) {
    for (const char* key : {"dtype", "torch_dtype"})
      if (part.contains(key)) part[key] = torch;
  };
  mark(config);
  for (const char* nested : {"text_config", "vision_config"})
    if (config.contains(nested) && config[nested].is_object()) mark(config[nested]);
  return write_file_atomically(to.string(), config.dump(2) + "\n");
}

// The side files as they are, and config.json (checked on open) with the dtype of cast tensors.
Status copy_side_and_config_files(const std::string& src, const std::string& dst, std::optional<DType> dtype) {
  TRESTLE_RETURN_IF_ERROR(copy_side_files(src, dst, hf_side_files(src), SideFileLinks::kFollow));
  const fs::path config = fs::path(src) / "config.json";
  if (dtype) return copy_config(config, fs::path(dst) / "config.json", dtype);
  return copy_hf_config_file(src, dst);
}

}  // namespace

Result<HfRewriteReport> rewrite_hf_checkpoint(const std::string& src, const std::string& dst,
                                              const HfRewriteOptions& options) {
  std::error_code ec;
  const bool directory = fs::is_directory(src, ec);
  if (directory) {
    TRESTLE_RETURN_IF_ERROR(check_hf_dir_links(src));  // before any file is opened
    // A model directory is its config and its weights. Both are read before anything is written; a model of a family
    // the bridge converts is checked as hf -> trestle checks it (each tensor the config's model has, once, in its shape
    // and a dtype it can hold). Other safetensors directories are rewritten as they are. (A single .safetensors file
    // has no config.)
    TRESTLE_ASSIGN_OR_RETURN(const HfModelConfig config, read_hf_config((fs::path(src) / "config.json").string()));
    const auto& known = supported_architectures();
    if (std::find(known.begin(), known.end(), config.architecture) != known.end())
      TRESTLE_RETURN_IF_ERROR(open_hf_model(src, NormNaming::kLocal).status());
  }
  TRESTLE_ASSIGN_OR_RETURN(auto source, SafetensorsCheckpoint::open(src));
  if (source.size() == 0) return Status::Error(src + ": holds no tensors, so no model to rewrite");
  std::vector<TensorSpec> specs;
  std::uint64_t total_in = 0, total_out = 0;
  for (const auto& name : source.names()) {
    const auto& entry = *source.find(name)->entry;
    DType out = entry.dtype;
    if (options.dtype && is_floating(entry.dtype) && can_cast(entry.dtype, *options.dtype)) out = *options.dtype;
    specs.push_back({name, out, entry.shape});
    total_in += entry.nbytes();
    total_out += specs.back().nbytes();
  }
  if (options.dry_run) {
    TRESTLE_RETURN_IF_ERROR(StagedOutput::check_destination(dst, src));
    HfRewriteReport plan;
    plan.tensors = specs.size();
    plan.plan = "would write " + dst + ": " + std::to_string(specs.size()) + " tensors, " + format_bytes(total_out) +
                " (read " + format_bytes(total_in) + "), in shards of at most " +
                format_bytes(options.max_shard_bytes) + "; nothing written (--dry-run)\n";
    return plan;
  }
  TRESTLE_ASSIGN_OR_RETURN(StagedOutput output, StagedOutput::begin(dst, src));
  TRESTLE_RETURN_IF_ERROR(output.check_room(total_out));
  // Keep the source's metadata (transformers requires "format": "pt").
  std::map<std::string, std::string> metadata = source.files().front().metadata();
  if (!metadata.count("format")) metadata["format"] = "pt";
  TRESTLE_ASSIGN_OR_RETURN(auto writer,
                           ShardedSafetensorsWriter::create(output.path(), specs, options.max_shard_bytes, metadata));

  HfRewriteReport report;
  Progress progress("rewrite " + fs::path(src).filename().string(), total_in, options.progress);
  std::vector<std::byte> cast_buffer;
  for (const auto& spec : specs) {
    TRESTLE_ASSIGN_OR_RETURN(const ConstTensorView view, source.view(spec.name));
    if (view.dtype == spec.dtype) {
      TRESTLE_RETURN_IF_ERROR(writer->write(spec.name, view.bytes()));
    } else {
      cast_buffer.resize(spec.nbytes());
      TRESTLE_RETURN_IF_ERROR(cast_elements(view.dtype, view.bytes(), spec.dtype, cast_buffer));
      TRESTLE_RETURN_IF_ERROR(writer->write(spec.name, cast_buffer));
    }
    report.tensors += 1;
    report.bytes_read += view.nbytes();
    report.bytes_written += spec.nbytes();
    TRESTLE_RETURN_IF_ERROR(progress.advance(view.nbytes()));
  }
  TRESTLE_RETURN_IF_ERROR(writer->commit());
  progress.finish();
  if (directory) TRESTLE_RETURN_IF_ERROR(copy_side_and_config_files(src, output.path(), options.dtype));
  TRESTLE_RETURN_IF_ERROR(output.commit());
  report.shards = writer->shard_files().size();
  return report;
}

}  // namespace trestle
