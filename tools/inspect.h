// The format-specific halves of `trestle inspect`.
#pragma once

#include <string>

namespace trestle::cli {

struct InspectOptions {
  bool as_json = false;
  bool checksums = false;
  bool chunks = false;
};

int inspect_safetensors(const std::string& path, const InspectOptions& options);
int inspect_trestle(const std::string& path, const InspectOptions& options);
// True when path is a Trestle checkpoint root (tracker or iter_* directories) or one iteration directory.
bool is_trestle_checkpoint(const std::string& path);
int inspect_torch_dist(const std::string& path, const InspectOptions& options);
int inspect_legacy(const std::string& path, const InspectOptions& options);
bool is_torch_dist_checkpoint(const std::string& path);  // a DCP .metadata here or in the tracker's iteration
int inspect_dataset(const std::string& path, const InspectOptions& options);  // inspect_dataset.cc
bool is_indexed_dataset(const std::string& path);  // PREFIX, PREFIX.idx or PREFIX.bin with PREFIX.idx present

}  // namespace trestle::cli
