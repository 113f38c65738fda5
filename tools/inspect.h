// The format-specific halves of `trestle inspect`: each prints what a checkpoint holds, or fails naming the file.
#pragma once

#include <string>

#include "ckpt/status.h"

namespace trestle::cli {

struct InspectOptions {
  bool as_json = false;
  bool checksums = false;
  bool chunks = false;
};

Status inspect_safetensors(const std::string& path, const InspectOptions& options);
Status inspect_trestle(const std::string& path, const InspectOptions& options);
// True when path is a Trestle checkpoint root (tracker or iter_* directories) or one iteration directory.
bool is_trestle_checkpoint(const std::string& path);
Status inspect_torch_dist(const std::string& path, const InspectOptions& options);
Status inspect_legacy(const std::string& path, const InspectOptions& options);
bool is_torch_dist_checkpoint(const std::string& path);  // a DCP .metadata here or in the tracker's iteration
Status inspect_dataset(const std::string& path, const InspectOptions& options);  // inspect_dataset.cc
bool is_indexed_dataset(const std::string& path);  // PREFIX, PREFIX.idx or PREFIX.bin with PREFIX.idx present

}  // namespace trestle::cli
