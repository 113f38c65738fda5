// The order of work on each pipeline stage, as Megatron-Core's schedules run it: 1F1B (one model chunk per stage) and
// interleaved 1F1B (virtual pipeline: several chunks per stage, micro-batches taken in groups), each with warmup
// forwards, a steady state of one forward then one backward, and cooldown backwards. Pure arithmetic, no
// communication: the trainer's pipeline executes these steps, and check_pipeline_schedules proves that a set of
// stages' orders can all finish when each step waits for the step that feeds it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::parallel {

struct PipelineScheduleConfig {
  int pp = 1;                  // pipeline stages (ranks)
  int chunks = 1;              // model chunks per stage (virtual pipeline size; 1: plain 1F1B)
  int microbatches = 1;        // per step, per data-parallel rank
  int microbatch_group = 0;    // Megatron's microbatch_group_size_per_vp_stage; 0: pp
  bool forward_only = false;
};

// Megatron's get_pp_rank_microbatches for one stage.
struct PipelineCounts {
  int total = 0;                    // microbatches x chunks
  int warmup = 0;                   // forwards before the first backward
  int remaining = 0;                // total - warmup: steady-state forward/backward pairs
  bool all_in_warmup = false;
};

struct PipelineStep {
  bool forward = true;
  int microbatch = 0;
  int chunk = 0;  // model chunk on this stage; the virtual stage is chunk * pp + rank
  bool operator==(const PipelineStep&) const = default;
};

// Checks the configuration as Megatron does: sizes at least 1; when interleaved, pp > 1, the group size between pp
// and the microbatches, and a last group (microbatches % group) of 0 or at least pp.
Status check_pipeline_schedule_config(const PipelineScheduleConfig& config);

PipelineCounts pipeline_counts(const PipelineScheduleConfig& config, int rank);

// (microbatch, chunk) of every virtual micro-batch in order: Megatron's get_schedule_table.
std::vector<std::pair<int, int>> pipeline_schedule_table(const PipelineScheduleConfig& config);

// Stage `rank`'s steps in execution order.
std::vector<PipelineStep> pipeline_schedule(const PipelineScheduleConfig& config, int rank);

// Runs every stage's order against the dependencies (forward of virtual stage s needs the forward of s - 1 on the same
// micro-batch, backward of s needs the backward of s + 1, or the stage's own forward on the last virtual stage) and
// fails naming the stuck steps if the stages cannot all finish, or if a step is missing or repeated.
Status check_pipeline_schedules(const PipelineScheduleConfig& config);
// The same check for given orders, one per stage (orders[rank]).
Status check_pipeline_orders(const PipelineScheduleConfig& config,
                             const std::vector<std::vector<PipelineStep>>& orders);

std::string to_string(const PipelineStep& step);  // "F3c1", "B0c0"

}  // namespace trestle::parallel
