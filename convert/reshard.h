// Resharding a checkpoint from one Megatron layout to another (tp, pp with even or uneven stages, vpp, ep,
// dp), model and optimizer state, streaming: each piece of the target layout is read from the source by the load
// planner (only the overlapping bytes of the source chunks) just before it is written. Which rank holds what comes
// from bridge_layout.h, the same rules the converter uses.
//
// Tensor names: model weights are the bridge plan's canonical Megatron names; optimizer state is
// "optimizer.<state>.<weight name>" (e.g. optimizer.exp_avg.decoder.layers.0.mlp.linear_fc1.weight) with the
// weight's global shape, stored as distributed-optimizer flat shards; other "optimizer.*" tensors (step counters) are
// kept whole on every rank. Anything else is an error naming it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/layout_tensor.h"
#include "ckpt/save.h"
#include "parallel/layout/model_spec.h"
#include "parallel/layout/parallel_layout.h"

namespace trestle {

// What changes; everything not given keeps the source's value (uneven first/last stage sizes reset to an even split
// when pp or vpp changes).
struct LayoutChange {
  std::optional<int> tp = {};
  std::optional<int> pp = {};
  std::optional<int> vpp = {};
  std::optional<int> ep = {};
  std::optional<int> etp = {};  // the routed experts' own tensor-parallel size (kept when tp changes)
  std::optional<int> dp = {};
  std::optional<std::int64_t> first_stage_layers = {};
  std::optional<std::int64_t> last_stage_layers = {};
  // Megatron's --pipeline-model-parallel-layout: every virtual stage's layers (with_pipeline_layout), in place of vpp
  // and the first / last stage sizes; applied once the model is known.
  std::optional<std::string> pipeline_layout = {};
};

// The target layout: `source` with `change` applied (all but its pipeline_layout string).
ParallelLayout apply_layout_change(const ParallelLayout& source, const LayoutChange& change);

struct BridgeModel;
// `layout` split as Megatron's --pipeline-model-parallel-layout TEXT says for `model` (pipeline_layout_string.h: its
// vpp and every virtual stage's decoder layers; the first / last stage sizes cleared); errors name the flag. A hybrid
// model (Nemotron-H) is refused, as Megatron refuses the layout beside its layer pattern.
Result<ParallelLayout> with_pipeline_layout(ParallelLayout layout, const std::string& text, const BridgeModel& model);

struct ReshardOptions {
  LayoutChange change;
  SaveOptions save;
  int concurrent_writers = 2;
  bool dry_run = false;
  bool progress = true;
};

struct ReshardReport {
  ParallelLayout from, to;
  std::uint64_t tensors = 0, optimizer_tensors = 0, pieces = 0;
  std::uint64_t bytes_read = 0, bytes_written = 0;
  double seconds = 0;
  std::uint64_t peak_rss_bytes = 0;
  std::string plan;
};

class CanonicalSource;
struct BridgedModel;
// Reshard's accounting of a checkpoint's tensors against its model description: each is a weight of the model's plan
// or optimizer state of one (with the weight's shape), and every weight is there with its planned shape; anything else
// is an error naming it. `source` names the checkpoint in errors.
Status check_checkpoint_tensors(const BridgedModel& bridged, const std::vector<LayoutTensor>& tensors,
                                const std::string& source);

// SOURCE: any checkpoint seen as canonical tensors (canonical_source.h); its layout is the one its model records.
// Optimizer state moves along when the source has it (Trestle). DST: a new or empty directory, written as a Trestle
// checkpoint at the source's iteration. (torch_dist output: torch_dist_writer.h with apply_layout_change's layout.)
Result<ReshardReport> reshard_to_trestle(const CanonicalSource& source, const std::string& dst,
                                         const ReshardOptions& options);

}  // namespace trestle
