// One iteration's forward (and backward) passes over the micro-batches on one pipeline stage, in the order of
// Megatron-Core's schedules (parallel/pipeline_schedule.h: 1F1B, or interleaved over the stage's model chunks).
// Activations go to the next virtual stage and their gradients back to the previous one by point-to-point messages on
// the pipeline group: sends are asynchronous, a receive waits where its step needs the data, and every message is
// tagged with its micro-batch, virtual stage and direction, so the schedule's dependency order (proved free of
// deadlocks by check_pipeline_schedules) is all the ranks need. The loss is taken on the last virtual stage by the
// caller's `loss`, whose result backward starts from. A peer that
// dies or hangs ends the iteration with an error naming the stage and the message, after the group's timeout.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <vector>

#include "ckpt/status.h"
#include "parallel/parallel_state.h"
#include "train/loop/micro_batches.h"
#include "train/model/gpt_model.h"

namespace trestle::train {

// A loss sum read back to the host.
struct LossValues {
  double loss = 0;
  double tokens = 0;
  // Multi-token prediction: per depth, the sum over the micro-batches of this rank's share of each one's mean loss.
  std::vector<double> mtp;
};

// Sum of the per-token losses and the number of counted tokens over the micro-batches (the last stage's; zero on
// the others), kept on the device so that no micro-batch waits for the host to read its loss.
struct LossSum {
  // [loss sum, counted tokens, then each MTP depth's mean] in double; undefined until a micro-batch adds to it.
  at::Tensor totals;

  void add(const at::Tensor& values) { totals = totals.defined() ? totals + values : values; }
  // The sums on the host (one synchronisation); `mtp_depth` values for MTP, zeros where nothing was added.
  LossValues read(std::size_t mtp_depth) const;
};

// Seconds of the latest run: waiting for messages (receives, and the sends' completion at the end) and in all.
struct PipelineTimes {
  double waiting = 0;
  double total = 0;
};

struct PipelineRunOptions {
  int micro_batches = 1;
  bool backward = true;
  int microbatch_group = 0;  // Megatron's microbatch_group_size_per_vp_stage (interleaved); 0: pp
  // Called just before the first backward after which every parameter only receives its last gradient of the
  // iteration (the data-parallel buckets may then start as they complete).
  std::function<void()> arm_gradient_reduction;
  // On the last virtual stage: micro-batch's forward (logits) -> the scalar its backward starts from; adds to the sums.
  std::function<Result<at::Tensor>(const ChunkForward& forward, const TokenBatch& batch, LossSum& sum)> loss;
};

class PipelineRunner {
 public:
  // `pipeline`: the pipeline group of this rank (its group rank is the stage); `device`: where activations live.
  PipelineRunner(GptModel& model, const parallel::ProcessGroup& pipeline, at::Device device);

  // Runs the iteration; `batch(m)` gives micro-batch m's inputs (read once per micro-batch).
  Result<LossSum> run(const PipelineRunOptions& options, const std::function<Result<TokenBatch>(int)>& batch);
  const PipelineTimes& times() const { return times_; }

 private:
  GptModel& model_;
  const parallel::ProcessGroup& pipeline_;
  at::Device device_;
  PipelineTimes times_;
};

}  // namespace trestle::train
