// A Trestle checkpoint as a canonical source: the manifest already names canonical tensors and describes the model;
// reads go through the load planner (only the overlapping bytes of each chunk, checksummed).
#include <algorithm>
#include <filesystem>
#include <mutex>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/load.h"
#include "convert/bridge/bridge_copy.h"
#include "convert/sources/canonical_source.h"
#include "parallel/layout/parallel_layout.h"

namespace trestle {
namespace {

class TrestleSource final : public CanonicalSource {
 public:
  // `model_only`: the optimizer state ("optimizer.*") is left out, as if not stored. `origin`: its weights origin.
  TrestleSource(CheckpointReader reader, BridgedModel model, const std::string& root, bool model_only,
                std::string origin)
      : reader_(std::move(reader)) {
    weights_origin_ = std::move(origin);
    const Manifest& m = reader_.manifest();
    model_ = std::move(model);
    for (const auto& [name, entry] : m.tensors)
      if (!model_only || !name.starts_with("optimizer.")) tensors_.push_back({name, entry.dtype, entry.global_shape});
    iteration_ = m.iteration;
    training_ = m.training;
    // Side files recorded in the iteration (hf_files/ inside the commit); older checkpoints kept them beside it.
    const bool recorded = std::any_of(m.files.begin(), m.files.end(), [](const auto& f) {
      return f.first.starts_with(std::string(kSideFilesDir) + "/");
    });
    side_files_dir_ =
        ((recorded ? std::filesystem::path(reader_.directory()) : std::filesystem::path(root)) / kSideFilesDir)
            .string();
  }

  std::string description() const override { return "trestle " + reader_.directory(); }

  Status read(const std::string& name, const Piece& piece, std::span<std::byte> out) const override {
    const LoadRequest request{name, piece, out.data()};
    return read_many({&request, 1});
  }

  Status read_many(std::span<const LoadRequest> requests) const override {
    std::lock_guard lock(mutex_);  // one planner and its buffers, shared by the callers
    LoadStats stats;
    Status s = reader_.load(requests, &stats, kReadBufferBytes);
    bytes_read_ += stats.bytes_read;
    return s;
  }

 private:
  CheckpointReader reader_;
  mutable std::mutex mutex_;
};

}  // namespace

Result<std::unique_ptr<CanonicalSource>> open_trestle_source(const std::string& path, const SourceOptions& options) {
  // A root (its tracker's iteration, or the one asked for), or an iteration directory itself.
  std::error_code ec;
  const bool directory = std::filesystem::exists(std::filesystem::path(path) / kManifestFile, ec);
  TRESTLE_ASSIGN_OR_RETURN(auto reader,
                           directory ? CheckpointReader::open_directory(path, streaming_read_options())
                                     : CheckpointReader::open(path, options.iteration, streaming_read_options()));
  if (directory && options.iteration && *options.iteration != reader.manifest().iteration)
    return Status::Error(path + " is iteration " + std::to_string(reader.manifest().iteration) + ", not " +
                         std::to_string(*options.iteration));
  const Manifest& manifest = reader.manifest();
  if (manifest.model.empty() || !manifest.model.contains("parallel"))
    return Status::Error(reader.directory() +
                         ": the manifest does not describe a Megatron model (no model.parallel), so the tensors' "
                         "layout rules are unknown; it must be written by trestle convert, reshard or the trainer");
  TRESTLE_ASSIGN_OR_RETURN(BridgedModel model, bridged_model_from_json(manifest.model, reader.directory()));
  // The layout that wrote it (the trainer resumes by it; inspect shows it) must be one.
  if (!manifest.layout.empty())
    TRESTLE_RETURN_IF_ERROR(layout_from_json(manifest.layout, reader.directory() + "/manifest.json").status());
  // Its recorded files are copied into every output (hf_files/ into a Hugging Face directory, a reshard's iteration):
  // checked first against their records, as the tensors' blocks are checked when read.
  TRESTLE_RETURN_IF_ERROR(reader.verify_files());
  TRESTLE_ASSIGN_OR_RETURN(std::string origin,
                           weights_origin_digest(manifest.training, reader.directory() + "/" + kManifestFile));
  return std::unique_ptr<CanonicalSource>(
      new TrestleSource(std::move(reader), std::move(model), path, options.model_only, std::move(origin)));
}

}  // namespace trestle
