// The distributed optimizer's state as Megatron-LM saves it by default ('dp_reshardable'): per gradient-buffer bucket
// one flat tensor per state ("[chained_<i>.]optimizer.distributed.dp_group_idx_<G>.gbuf_idx_<chunk>.dtype_<dtypes>.
// bucket_idx_<k>.<param | exp_avg | exp_avg_sq>", the bucket's elements up to its last parameter, each data-parallel
// rank's shard a chunk), where G is the model-parallel rank (the expert-model-parallel rank for the experts'
// optimizer, `chained_1` beside the dense `chained_0` under expert parallelism). Each canonical tensor's state is
// found by rebuilding the buffers: the parameters of every rank's model chunks in Megatron's order
// (megatron_buffer_params.h) laid out as the distributed optimizer lays them (grad_buffer_layout.h), checked against
// the stored bucket sizes.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/status.h"
#include "convert/bridge/bridge_model_json.h"
#include "convert/bridge/megatron_args.h"
#include "convert/formats/torch/dcp_checkpoint.h"
#include "parallel/layout/model_spec.h"

namespace trestle {

// `box` of a canonical tensor, its elements row-major at [offset, offset + box.numel()) of the flat tensor `key`.
struct FlatStateSegment {
  std::string key;
  std::int64_t offset = 0;
  Box box;
};

struct DpReshardableState {
  std::map<std::string, std::vector<FlatStateSegment>> segments;  // Trestle optimizer tensor -> its boxes, covering it
  std::map<std::string, DType> dtypes;
  std::set<std::string> entries;     // every checkpoint entry (tensor or object) the state accounts for
  std::optional<std::int64_t> step;  // Adam's step, from the optimizer's param_groups
  std::optional<nlohmann::json> loss_scaler;  // an fp16 model's ({"scale", "growth_tracker", "hysteresis_tracker"})
  bool empty() const { return entries.empty(); }
};

// Empty when the checkpoint holds no such entries. `tensors`: the model's canonical tensors; `padded_vocab`: the
// stored embedding's rows; `module_spec`: the layer specification that built the model (its parameter order;
// megatron_module_spec_from_args). Errors name the checkpoint and the entry that does not fit.
Result<DpReshardableState> locate_dp_reshardable_state(const DcpCheckpoint& ckpt, const BridgedModel& model,
                                                       const std::vector<const CanonicalTensor*>& tensors,
                                                       std::int64_t padded_vocab,
                                                       const MegatronModuleSpec& module_spec);

// Fills `out` (piece's elements of `dtype`) from the segments.
Status read_flat_state(const DcpCheckpoint& ckpt, const std::vector<FlatStateSegment>& segments, DType dtype,
                       const Piece& piece, std::span<std::byte> out);

}  // namespace trestle
