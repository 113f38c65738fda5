// Hugging Face -> Hugging Face: re-writes a safetensors checkpoint with Trestle's streaming writer (new shard size,
// optional float dtype change), copying config, tokenizer and generation files through.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ckpt/dtype.h"
#include "ckpt/status.h"

namespace trestle {

struct HfRewriteOptions {
  std::uint64_t max_shard_bytes = 5'000'000'000;  // save_pretrained's default "5GB"
  std::optional<DType> dtype;                     // cast floating tensors; nullopt keeps each tensor's dtype
  bool progress = true;
  bool dry_run = false;  // check the source and say what would be written; write nothing
};

struct HfRewriteReport {
  std::string plan;  // a dry run's: what would be written
  std::uint64_t tensors = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::size_t shards = 0;
};

// DST must not exist or be an empty directory, so no earlier checkpoint is mixed with the new one.
Result<HfRewriteReport> rewrite_hf_checkpoint(const std::string& src, const std::string& dst,
                                              const HfRewriteOptions& options);

}  // namespace trestle
