// Hugging Face <-> Megatron-layout conversion, streaming: each rank's pieces are produced one at a time from the
// memory-mapped source (HF -> Trestle), or each canonical tensor of any source is loaded once and scattered into the
// safetensors shards (-> HF). Peak memory is about the largest piece or tensor plus I/O buffers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/save.h"
#include "convert/bridge/bridge_model_json.h"

namespace trestle {

struct ConversionReport {
  std::uint64_t tensors = 0;  // tensors produced
  std::uint64_t pieces = 0;   // chunks written (HF -> Trestle)
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  double seconds = 0;
  std::uint64_t peak_rss_bytes = 0;
  std::string plan;  // the human-readable plan (always filled; the whole output of a dry run)
  std::vector<std::string> notes;  // what the conversion could not keep exactly, for stderr even when quiet
};

struct HfToTrestleOptions {
  ParallelLayout layout;
  std::optional<std::string> pipeline_layout;         // Megatron's --pipeline-model-parallel-layout over layout's pp
  NormNaming norms = NormNaming::kTransformerEngine;  // layer-norm names of the Megatron tensors written
  std::optional<DType> dtype;                         // cast floating tensors; nullopt keeps each tensor's dtype
  std::int64_t iteration = 0;
  SaveOptions save;
  // Rank files written at once (each holds one piece buffer and its staging); raised to tp, so the tensor-parallel
  // ranks of a stage, which share their source tensors, write together.
  int concurrent_writers = 2;
  bool dry_run = false;
  bool progress = true;
};

// SRC is a Hugging Face model directory (config.json + safetensors); DST a new (or empty) Trestle checkpoint root.
Result<ConversionReport> convert_hf_to_trestle(const std::string& src, const std::string& dst,
                                               const HfToTrestleOptions& options);

struct ToHfOptions {
  std::optional<DType> dtype;
  std::optional<ExpertLayout> experts;  // default: the layout the source had
  std::uint64_t max_shard_bytes = 5'000'000'000;
  bool dry_run = false;
  bool progress = true;
};

class CanonicalSource;
// SOURCE is any checkpoint seen as canonical tensors (canonical_source.h: Trestle, torch_dist, legacy, in any layout);
// DST a new or empty directory. Optimizer state in the source is skipped.
Result<ConversionReport> convert_to_hf(const CanonicalSource& source, const std::string& dst,
                                       const ToHfOptions& options);

}  // namespace trestle
