// The training loop of Megatron's pretrain() for a GPT model without pipeline stages: per iteration, the global batch's
// micro-batches (micro_batches.h) run forward and backward with Megatron's loss normalisation (each micro-batch's
// token-mean loss over the number of micro-batches), the data-parallel gradient all-reduce overlaps the last backward
// (grad_buckets.h), then the tensor-parallel norm gradients are summed, the global gradient norm clipped, and AdamW
// steps with the scheduler's learning rate and weight decay. Logs like Megatron (console, JSON lines, TensorBoard),
// evaluates on the validation split, and saves asynchronously every save_interval iterations (train_checkpoint.h).
// Every rank runs it; ranks meet only in collectives, so a failed peer surfaces as an error naming the collective.
#pragma once

#include <c10/core/Device.h>

#include <csignal>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ckpt/load.h"
#include "parallel/layout/lora_spec.h"
#include "parallel/layout/model_spec.h"
#include "parallel/parallel_state.h"
#include "train/data/gpt_data_builder.h"
#include "train/log/train_log.h"
#include "train/loop/micro_batches.h"
#include "train/loop/step_profiler.h"
#include "train/loop/train_checkpoint.h"
#include "train/model/moe_router.h"
#include "train/optim/adamw.h"
#include "train/optim/loss_scaler.h"
#include "train/optim/lr_schedule.h"

namespace trestle::train {

struct TrainConfig {
  // Model and where its weights come from.
  GptModelSpec spec;
  // The model's layout: the parallel state's sizes plus virtual pipeline chunks and uneven first/last stages (none:
  // the parallel state's layout as it is).
  std::optional<ParallelLayout> layout;
  nlohmann::json model_json;  // the manifest's model description for this run's saves (layout already updated)
  std::vector<CheckpointInfo::File> carried_files;  // whole files every save carries (tokenizer, generation config)
  std::optional<std::string> load;                  // a Trestle checkpoint root (else: initialised from scratch)
  std::optional<std::int64_t> load_iteration;
  std::optional<std::string> load_shown;  // what the load line names: a converted --load's source, not its copy
  // LoRA: adapters trained on the frozen base read from pretrained_checkpoint (its pretrained_iteration); `load` then
  // names an adapter checkpoint, and saves hold the adapters only (the manifest's model description records lora_base).
  std::optional<LoraConfig> lora;
  std::optional<std::string> pretrained_checkpoint;  // the root
  std::int64_t pretrained_iteration = 0;
  std::optional<LoraBase> lora_base;
  bool finetune = false;
  // What made the load weights only, for its line: "--finetune" or --pretrained-checkpoint's fine-tuning.
  std::string finetune_reason = "--finetune";
  // Megatron's release checkpoint: its weights and the samples its args record as consumed, from iteration 0 (not a
  // fine-tuning: load_checkpoint keeps a release's consumed samples); optimizer, scheduler and RNG start afresh.
  bool release = false;
  bool load_optimizer = true;
  bool save_optimizer = true;  // Megatron's --no-save-optim: false saves the weights and training state only
  bool load_rng = true;
  bool save_rng = true;  // Megatron's --no-save-rng clears it
  // Megatron's --override-ckpt-iteration: the loaded checkpoint resumes as if saved at this iteration (consumed
  // samples = iteration x global batch size, so the data replays from there); its scheduler's state is kept.
  std::optional<std::int64_t> override_ckpt_iteration;
  // A resumed learning-rate schedule that differs from the checkpoint's: this run's (said in a note), or the
  // checkpoint's (--use-checkpoint-opt_param-scheduler).
  LrSchedule::Saved saved_schedule = LrSchedule::Saved::kOverride;
  bool sequence_parallel = false;
  bool recompute = false;
  bool bf16 = false;
  bool fp16 = false;                         // fp16 parameters, fp32 masters, loss scaling
  bool grads_in_fp32 = false;                // Megatron's accumulate_allreduce_grads_in_fp32 (its default for bf16)
  bool gradient_accumulation_fusion = true;  // linear weights' gradients GEMM-accumulated into the buffers (Megatron's)
  int microbatch_group_size_per_vp_stage = 0;  // interleaved pipeline's micro-batch group (Megatron's); 0: pp
  // Megatron's --use-distributed-optimizer: gradients reduce-scattered to data-parallel shards, fp32 masters and Adam
  // moments only for this rank's shard, parameters all-gathered after the step; saved as flat ranges of the pieces.
  bool use_distributed_optimizer = false;
  // Megatron's load-balancing losses (MoE models): --moe-router-load-balancing-type with --moe-aux-loss-coeff.
  LoadBalancingCoefficients moe_load_balancing;
  double moe_z_loss_coeff = 0.0;    // Megatron's router z-loss coefficient (MoE models)
  // Megatron's --moe-expert-capacity-factor, --moe-token-drop-policy and --moe-pad-expert-input-to-capacity.
  ExpertCapacity moe_capacity;
  // Megatron's --moe-router-dtype: the router's precision (kFloat, kDouble); Undefined: the model's.
  at::ScalarType moe_router_dtype = at::ScalarType::Undefined;
  // Megatron's --moe-router-bias-update-rate: how far the router's expert bias (models with one) moves after each
  // global batch against each expert's load offset.
  double moe_router_bias_update_rate = 1e-3;
  // Megatron's --mtp-loss-scaling-factor: the multi-token-prediction losses (models with MTP layers) join the lm loss
  // as their mean over the depths times this.
  double mtp_loss_scaling_factor = 0.1;
  bool moe_grouped_gemm = false;  // MoE: each projection of the local experts as one grouped GEMM (CUDA)
  bool fused_kernels = true;      // the model's fused kernels (train/model/fused_kernels.h) and the gradient norm's
  at::Device device = at::kCPU;   // where the model runs: the CPU (Gloo) or this rank's GPU (NCCL)
  LossScalerConfig loss_scaler;   // for fp16
  std::uint64_t seed = 1234;
  double init_method_std = 0.02;
  std::optional<double> embedding_init_method_std;  // Megatron's: the word embeddings' own (from scratch)
  // Batches and data.
  std::int64_t micro_batch_size = 1;
  std::int64_t global_batch_size = 1;
  // Megatron-LM 0.19's --eval-micro-batch-size / --eval-global-batch-size (none: the training ones).
  std::optional<std::int64_t> eval_micro_batch_size, eval_global_batch_size;
  std::optional<BatchRampup> rampup;  // Megatron's --rampup-batch-size: the global batch grows to global_batch_size
  // Megatron's --decrease-batch-size-if-needed: a global batch (constant or ramped) that does not divide into
  // micro-batches of every data-parallel rank runs as the largest multiple that does (evaluation's batch too, as
  // Megatron's evaluate divides it).
  bool decrease_batch_size_if_needed = false;
  // Megatron-LM 0.19's --step-batch-size-schedule: the global batch by samples consumed (global_batch_size is then
  // micro-batch x data-parallel size, as Megatron sets it: evaluation's batch and the iteration units' samples).
  std::optional<BatchSizeSteps> batch_steps;
  std::int64_t seq_length = 0;
  std::int64_t train_iters = 0;
  // Megatron's --train-samples: the training split's size (train_iters is then train_samples / global batch).
  std::optional<std::int64_t> train_samples;
  data::GptDataOptions data;  // blend, split and dataset config (its sample counts are filled in from the iterations)
  bool eod_mask_loss = false;
  std::int64_t eod_token_id = -1;
  // Megatron's --reset-attention-mask: a token attends only to its own document's tokens (eod_token_id ends one).
  bool reset_attention_mask = false;
  // Megatron's --dataloader-inter-document-masking: the documents are the dataset's (the parts each sample was read
  // from), and positions restart at each; softmax attention keeps within them.
  bool inter_document_masking = false;
  // Megatron's --calculate-per-token-loss: the gradient is the mean over the global batch's counted tokens (summed
  // over micro-batches and ranks, then divided by their number) rather than the mean of the micro-batches' means.
  bool calculate_per_token_loss = false;
  // Optimizer and schedule (the schedule's steps are in samples, as Megatron's).
  AdamWConfig adam;
  double clip_grad = 1.0;
  LrScheduleConfig schedule;
  // Megatron's --apply-wd-to-qk-layernorm: the query and key norms (q_layernorm, k_layernorm) are decayed too; every
  // other norm and bias is not.
  bool apply_wd_to_qk_layernorm = false;
  std::int64_t ddp_bucket_elements = 0;  // 0: Megatron's default
  // Megatron's --ddp-num-buckets: buckets of (this rank's parameter count / N) elements; 0: ddp_bucket_elements.
  std::int64_t ddp_num_buckets = 0;
  // Checkpoints, evaluation, logging.
  std::optional<std::string> save;
  std::int64_t save_interval = 0;  // 0: save only at the end (when --save is given)
  // Megatron's --iterations-to-skip (1-indexed, as Megatron-LM reads them since core_v0.17): these iterations consume
  // their global batch and do nothing else (no step, no scheduler step, no log, save or evaluation).
  std::set<std::int64_t> iterations_to_skip;
  // Megatron's --skip-train: no training (nor saving); the loaded model is evaluated on the validation and test splits.
  bool skip_train = false;
  std::int64_t exit_interval = 0;  // Megatron's --exit-interval: save (with --save) and stop at a multiple of it
  // Megatron's --exit-duration-in-mins: save (with --save) and stop after the first iteration that ends when any rank
  // has run this long since the trainer started (0: never).
  double exit_duration_minutes = 0;
  bool log_params_norm = false;        // Megatron's --log-params-norm
  bool log_num_zeros_in_grad = false;  // Megatron's --log-num-zeros-in-grad
  bool moe_per_layer_logging = false;  // Megatron's --moe-per-layer-logging: per-layer router losses to TensorBoard
  SaveOptions save_options;
  // A save that fails (its write, sync or commit) ends the job with the error (true, the default); false warns and
  // tries again at the next save. The last save of a run fails it either way.
  bool exit_on_save_failure = true;
  // Megatron's --check-for-nan-in-loss-and-grad: a NaN or Inf in any rank's loss or gradients ends the job, naming the
  // iteration and the ranks (fp16's loss scaling still skips steps whose gradients overflowed).
  bool check_for_nan_in_loss_and_grad = true;
  // Megatron's --exit-signal-handler: SIGTERM, SIGINT or exit_signal on any rank finishes the step, saves (with
  // --save), commits and ends the run successfully.
  bool exit_signal_handler = false;
  int exit_signal = SIGTERM;  // Megatron's --exit-signal: handled beside SIGTERM and SIGINT
  std::int64_t eval_interval = 1000;
  std::int64_t start_eval_at_iter = 0;  // Megatron-LM 0.19's: no periodic evaluation before this iteration
  std::int64_t eval_iters = 100;
  std::int64_t log_interval = 100;
  std::optional<std::string> tensorboard_dir;
  std::int64_t tensorboard_log_interval = 1;  // Megatron's: TensorBoard gets each such iteration's own values
  TensorBoardChoices tensorboard_choices;     // Megatron's optional scalars, as its flags choose them
  ProfileOptions profile;  // Megatron's --profile --use-pytorch-profiler
  std::optional<std::string> json_log;
  std::optional<double> peak_tflops;  // per device, for MFU
  bool log_throughput = false;        // Megatron's --log-throughput: TFLOP/s per GPU in the console line
  nlohmann::json args;                // the run's arguments, recorded in every save
  // Test hooks: this rank SIGKILLs itself when it starts the given iteration (a worker dying mid-run).
  int test_kill_rank = -1;
  std::int64_t test_kill_iteration = -1;
  // Test hooks: at iteration test_nan_iteration, rank test_nan_rank's loss ("loss") or a gradient ("grad") is NaN.
  // Test hooks: rank test_hang_rank stops answering (sleeps forever) when it starts iteration test_hang_iteration.
  int test_hang_rank = -1;
  std::int64_t test_hang_iteration = -1;
  std::string test_nan_in;
  int test_nan_rank = -1;
  std::int64_t test_nan_iteration = -1;
};

// Runs the whole job on this rank. Errors name the step that failed (loading, a batch, a collective, a save).
Status train(const parallel::ParallelState& state, const TrainConfig& config);

// Megatron's count of samples each split needs: --train-samples, else train_iters × global batch; validation
// (train_iters / eval_interval + 1 less start_eval_at_iter / eval_interval, or 1 with --skip-train) × eval_iters ×
// evaluation's global batch; test eval_iters × evaluation's global batch.
std::array<std::optional<std::int64_t>, 3> split_sample_counts(const TrainConfig& config);

}  // namespace trestle::train
