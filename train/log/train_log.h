// One training iteration's report in the forms Megatron users read: the console line of Megatron-LM's training_log
// (" [time] iteration N/T | consumed samples: ... | lm loss: ... |"), a JSON line with the same figures, and the
// TensorBoard scalars Megatron writes ("lm loss", "learning-rate", "grad-norm", ... and their "vs samples" forms).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/status.h"
#include "train/log/tensorboard_writer.h"

namespace trestle {

// Which of Megatron's optional TensorBoard scalars a run writes, as its flags choose them:
// --no-log-loss-scale-to-tensorboard, --log-timers-to-tensorboard (iteration-time),
// --log-world-size-to-tensorboard and --log-validation-ppl-to-tensorboard.
struct TensorBoardChoices {
  bool loss_scale = true;
  bool timers = false;
  bool world_size = false;
  bool validation_ppl = false;
};

struct IterationReport {
  std::int64_t iteration = 0;
  std::int64_t train_iters = 0;
  std::int64_t consumed_samples = 0;
  double seconds_per_iteration = 0;
  double learning_rate = 0;
  std::int64_t global_batch_size = 0;
  int world_size = 0;
  double lm_loss = 0;                    // the mean over the interval's stepped (not skipped) iterations
  std::int64_t advanced_iterations = 1;  // the interval's stepped iterations; with none, no loss is logged ...
  bool loss_tracked = false;             // ... unless an earlier step of the run advanced: then 0, as Megatron's
  std::int64_t skipped_samples = 0;      // the run's samples passed over (--iterations-to-skip), Megatron's
  // Multi-token prediction: depth d's loss ("mtp_<d> loss"), d = 1..D; empty without MTP layers.
  std::vector<double> mtp_losses;
  // MoE: the router losses Megatron tracks ("load_balancing_loss", "z_loss", ...), in its log's order: each the mean
  // over the MoE layers of the iteration's mean over its micro-batches, logged (as the interval's sum over its
  // iterations, skipped ones included, divided by its stepped ones) where above 0. Empty in dense models.
  std::vector<std::pair<std::string, double>> router_losses;
  // With --moe-per-layer-logging, each router loss's value per layer (decoder layers, then MTP layers): TensorBoard's
  // moe/<name>_layer_<i>. Empty otherwise.
  std::vector<std::vector<double>> router_losses_per_layer;
  double loss_scale = 1.0;
  std::optional<double> grad_norm;
  std::optional<double>
      num_zeros_in_grad;  // --log-num-zeros-in-grad: zero elements of the (clipped) gradients (a count)
  std::optional<double> params_norm;        // --log-params-norm: the L2 norm of the parameters after the step
  std::int64_t skipped_iterations = 0;      // the interval's iterations whose step was skipped (fp16 overflow)
  std::int64_t nan_iterations = 0;
  double tokens_per_second = 0;
  std::optional<double> mfu;  // model FLOPs utilisation, 0..1, when the peak FLOP/s of the device is known
  // --log-throughput: Megatron's "throughput per GPU (TFLOP/s/GPU)", its model FLOPs over the time, per rank.
  std::optional<double> throughput_tflops;
  // Peak memory of this process so far: on a GPU the caching allocator's peak allocation, else the peak RSS.
  std::optional<std::uint64_t> peak_memory_bytes;
  // With pipeline parallelism: per stage, the share of its iteration time spent waiting for other stages' messages
  // (the pipeline bubble and communication), averaged over the stage's ranks.
  std::vector<double> pipeline_idle_share;
};

// Megatron-LM's console line, with Trestle's tokens/s and MFU after its own fields. `timestamp` is
// "YYYY-MM-DD HH:MM:SS".
std::string megatron_log_line(const IterationReport& r, const std::string& timestamp);
std::string json_log_line(const IterationReport& r);  // one JSON object, no newline
// Megatron's TensorBoard scalars of one iteration (its own values, not an interval's means), written every
// --tensorboard-log-interval iterations: learning-rate, batch-size, lm loss, loss-scale, world-size (as `choices`
// say), grad-norm, num-zeros and params-norm, each also "vs samples".
Status write_tensorboard_iteration(TensorBoardWriter& writer, const IterationReport& r,
                                   const TensorBoardChoices& choices = {});
// The multi-token-prediction depths' losses ("mtp_<d> loss") and the router losses (with --moe-per-layer-logging per
// layer too), which Megatron writes every iteration.
Status write_tensorboard_mtp(TensorBoardWriter& writer, const IterationReport& r);
Status write_tensorboard_router(TensorBoardWriter& writer, const IterationReport& r);
// The logging interval's timing, written with the console line: iteration-time and, with --log-throughput, throughput
// (with `choices.timers`, as Megatron's --log-timers-to-tensorboard), and tokens-per-second.
Status write_tensorboard_timing(TensorBoardWriter& writer, const IterationReport& r,
                                const TensorBoardChoices& choices = {});
// All four.
Status write_tensorboard(TensorBoardWriter& writer, const IterationReport& r, const TensorBoardChoices& choices = {});
// The local time as megatron_log_line wants it.
std::string log_timestamp();

}  // namespace trestle
