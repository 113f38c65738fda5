// The conversions as whole operations on plain requests, shared by the CLI (tools/convert.cc, tools/reshard.cc) and the
// Python package (trestle.convert, trestle.reshard): pick the path for the formats, open the source, run it, and
// return what to show the user (the plan, then a one-line summary of what was written).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ckpt/manifest.h"
#include "convert/bridge_convert.h"
#include "convert/dp_reshardable_write.h"
#include "convert/reshard.h"
#include "convert/sources/canonical_source.h"

namespace trestle {

struct ConvertRequest {
  CheckpointFormat from = CheckpointFormat::kHf;
  CheckpointFormat to = CheckpointFormat::kHf;
  std::string src, dst;
  ParallelLayout layout;  // the destination's (trestle, megatron-dist)
  // Megatron's --pipeline-model-parallel-layout for the destination (with_pipeline_layout, once the model is known);
  // none: layout's sizes decide.
  std::optional<std::string> pipeline_layout;
  // megatron-dist from a Megatron checkpoint: the vocabulary padding multiple the source records, not layout's.
  bool keep_vocab_divisor = false;
  NormNaming norms = NormNaming::kTransformerEngine;
  std::optional<DType> dtype;  // cast floating tensors (hf, trestle destinations); nullopt keeps them
  std::uint64_t max_shard_bytes = 5'000'000'000;
  Codec codec = Codec::kRaw;
  std::optional<ExpertLayout> experts;  // none: the layout the source had
  SourceOptions source;
  std::optional<std::int64_t> iteration;  // written (hf -> trestle / megatron-dist) and read
  bool model_only = false;
  // megatron-dist: the optimizer state as the distributed optimizer's 'dp_reshardable' buffers (else model space).
  std::optional<DpReshardableWriteOptions> dp_reshardable;
  // megatron-dist, model space: the param groups' hyper-parameters for common.pt (TorchDistWriteOptions).
  std::optional<DpReshardableWriteOptions> param_groups;
  // LoRA: the base checkpoint (hf-peft -> trestle; with merge_lora, where the adapters' base is when it moved), and
  // trestle -> hf of an adapter checkpoint as the merged full model.
  std::optional<std::string> base;
  bool merge_lora = false;
  bool dry_run = false;
  bool progress = true;
};

// Checks the combination (trestle -> trestle is a reshard, legacy is read-only, ...) before anything is read.
Status check_convert_request(const ConvertRequest& request);
// Runs the conversion; returns the plan and the summary line.
Result<std::string> run_convert_request(const ConvertRequest& request);

struct ReshardRequest {
  std::string in, out;
  LayoutChange change;  // sizes not given keep the source's
  SourceOptions source;
  std::optional<CheckpointFormat> to;  // default: torch_dist for a torch_dist source, else trestle
  Codec codec = Codec::kRaw;
  // torch_dist output: the optimizer state as 'dp_reshardable' buffers (their dp 0: the written layout's, change.dp
  // or the source's).
  std::optional<DpReshardableWriteOptions> dp_reshardable;
  std::optional<DpReshardableWriteOptions> param_groups;  // torch_dist output in model space, as ConvertRequest's
  bool dry_run = false;
  bool progress = true;
};

Result<std::string> run_reshard_request(const ReshardRequest& request);

// "keep" -> nullopt; bf16, fp16, fp32 (the casts a conversion offers).
Result<std::optional<DType>> parse_conversion_dtype(const std::string& text);

}  // namespace trestle
