#include "ckpt/checkpoint_path.h"

#include <filesystem>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/manifest.h"

namespace trestle {

namespace fs = std::filesystem;

Result<CheckpointReader> open_checkpoint_path(const std::string& path, std::optional<std::int64_t> iteration,
                                              const IoOptions& io) {
  std::error_code ec;
  if (!fs::exists(fs::path(path) / kManifestFile, ec)) return CheckpointReader::open(path, iteration, io);
  TRESTLE_ASSIGN_OR_RETURN(const Manifest manifest, read_manifest((fs::path(path) / kManifestFile).string()));
  if (iteration && *iteration != manifest.iteration)
    return Status::Error(path + " is iteration " + std::to_string(manifest.iteration) + ", not " +
                         std::to_string(*iteration));
  const fs::path dir = fs::path(path).lexically_normal();
  return CheckpointReader::open((dir.has_filename() ? dir : dir.parent_path()).parent_path().string(),
                                manifest.iteration, io);
}

}  // namespace trestle
