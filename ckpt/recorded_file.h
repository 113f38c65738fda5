// Whole files a checkpoint carries beside its tensors (a converted model's tokenizer and generation config): copied
// into the iteration before it is committed, recorded in the manifest with their size and xxh3-64, and checked on
// open (size) and by verify (contents), so a committed checkpoint never lacks one or holds a torn one.
#pragma once

#include <cstdint>
#include <string>

#include "ckpt/status.h"

namespace trestle {

struct RecordedFile {
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
  bool operator==(const RecordedFile&) const = default;
};

// A name for a recorded file: relative, made of plain components ("hf_files/tokenizer.json"), none of them '.', '..'
// or empty. `where` prefixes the error.
Status check_recorded_file_name(const std::string& name, const std::string& where);

// Copies `source` (links followed: the caller decides whether a link may be read) to `destination`, a new file that
// is synced, creating its parent directories; returns its size and digest.
Result<RecordedFile> copy_recorded_file(const std::string& source, const std::string& destination);

// The size and digest of `path` (not followed when a link: a checkpoint's own files are never links).
Result<RecordedFile> digest_recorded_file(const std::string& path);

}  // namespace trestle
