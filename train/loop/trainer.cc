#include "train/loop/trainer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#ifdef TRESTLE_HAVE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "ckpt/checkpoint_dir.h"
#include "ckpt/checksum.h"
#include "ckpt/fault_point.h"
#include "ckpt/manifest.h"
#include "ckpt/process_memory.h"
#include "ckpt/torch_async_save.h"
#include "parallel/layout/parallel_layout.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/process_group_collective.h"
#include "train/log/tensorboard_writer.h"
#include "train/log/train_log.h"
#include "train/loop/grad_reduction.h"
#include "train/loop/model_flops.h"
#include "train/loop/pipeline_runner.h"
#include "train/model/context_parallel.h"
#include "train/model/gpt_model.h"
#include "train/model/model_init.h"
#include "train/model/moe_router.h"

namespace trestle::train {
namespace {

using Clock = std::chrono::steady_clock;

// "dp group of ranks [0, 2]", for errors.
std::string describe(const char* kind, const parallel::ProcessGroup& group) {
  std::string ranks;
  for (int r : group.ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  return std::string(kind) + " group of ranks [" + ranks + "]";
}

// In place: the sum over `group` of `values` (identity for a group of one); `device` is where the group's tensors
// live (the CPU for Gloo, this rank's GPU for NCCL).
Status all_reduce_sum(const parallel::ProcessGroup& group, const at::Device& device, const char* kind,
                      std::vector<double>& values, const char* what) {
  if (group.size() <= 1 || !group.backend) return OkStatus();
  std::vector<at::Tensor> tensors{at::tensor(values, at::kDouble).to(device)};
  try {
    group.backend->allreduce(tensors)->wait();
  } catch (const std::exception& e) {
    return Status::Error(std::string("all-reduce of the ") + what + " in the " + describe(kind, group) +
                         " failed (a peer died or hung): " + e.what());
  }
  const at::Tensor result = tensors[0].cpu();
  const double* data = result.data_ptr<double>();
  values.assign(data, data + values.size());
  return OkStatus();
}

// Runs f (a step or an evaluation), turning what it throws into an error: a collective inside the model (tensor,
// sequence, context or expert parallel) throws c10d's DistError, or Gloo's own exception, which LibTorch's CPU backend
// lets through, when a peer died or hung.
template <typename F>
auto guarded(F&& f) -> decltype(f()) {
  const auto error = [](bool collective, const char* what) {
    return Status::Error(collective ? std::string("a collective in the model failed (a peer died or hung): ") + what
                                    : std::string(what));
  };
  try {
    return f();
  } catch (const c10::Error& e) {
    return error(dynamic_cast<const c10::DistError*>(&e) != nullptr, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return error(std::string_view(typeid(e).name()).find("gloo") != std::string_view::npos, e.what());
  }
}

Status barrier(Collective& world, const char* what) {
  auto gathered = world.all_gather(std::string());
  if (!gathered.ok())
    return Status::Error(std::string("waiting for every rank ") + what + ": " + gathered.status().message());
  return OkStatus();
}

// One iteration's losses: the lm loss, with multi-token prediction each depth's (Megatron's "mtp_<d> loss"), and in
// MoE models the router losses Megatron tracks (IterationReport::router_losses, with their per-layer values).
struct StepLosses {
  double lm = 0;
  std::vector<double> mtp;
  std::vector<std::pair<std::string, double>> router;
  std::vector<std::vector<double>> router_per_layer;
};

// What --log-num-zeros-in-grad and --log-params-norm add to a step's log (none when not asked, or skipped).
struct StepNorms {
  std::optional<double> num_zeros_in_grad;
  std::optional<double> params_norm;
};

// Peak memory of this process so far: the CUDA caching allocator's peak allocation on a GPU, else the peak RSS.
std::uint64_t peak_memory_bytes(const at::Device& device) {
#ifdef TRESTLE_HAVE_TORCH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    return static_cast<std::uint64_t>(stats.allocated_bytes[0].peak);  // [0]: the aggregate over pool kinds
  }
#endif
  (void)device;
  return peak_rss_bytes();
}

class Reporter {
 public:
  Reporter(const TrainConfig& config, bool writes, double flops_per_token, int world_size)
      : config_(config), writes_(writes), flops_per_token_(flops_per_token), world_size_(world_size) {}

  Status open() {
    if (!writes_) return OkStatus();
    if (config_.tensorboard_dir) {
      auto writer = TensorBoardWriter::open(*config_.tensorboard_dir);
      if (!writer.ok()) return writer.status();
      tensorboard_.emplace(std::move(*writer));
    }
    if (config_.json_log) {
      const bool torn = ends_inside_a_line(*config_.json_log);
      json_.open(*config_.json_log, std::ios::app);
      if (!json_) return Status::Error(*config_.json_log + ": cannot open the JSON log for appending");
      if (torn) {  // a killed run's last record, cut short: this run's records start on a line of their own
        std::printf(" note: %s ends inside a record (a run killed while writing it); appending on a new line\n",
                    config_.json_log->c_str());
        TRESTLE_RETURN_IF_ERROR(append_json(""));
      }
    }
    return OkStatus();
  }

  void start_interval() { interval_.start = json_interval_.start = Clock::now(); }
  // Leaves the time since `since` (an evaluation's) out of the interval's timing, as Megatron stops its interval
  // timer around evaluations.
  void exclude_since(Clock::time_point since) {
    const Clock::duration excluded = Clock::now() - since;
    interval_.start += excluded;
    json_interval_.start += excluded;
    if (carried_) carried_->start += excluded;
  }
  // Megatron's training_log: a line at every log_interval-th iteration, and one after the run's first iteration.
  bool logs(std::int64_t iteration) const { return iteration % config_.log_interval == 0 || first_; }

  // One finished iteration; prints and writes at log_interval. `skipped`: its step was skipped (fp16 overflow);
  // `skipped_samples`: the run's samples passed over by --iterations-to-skip.
  Status iteration(std::int64_t iteration, std::int64_t consumed, std::int64_t global_batch, double lr,
                   const StepLosses& losses, std::optional<double> grad_norm, const StepNorms& norms, bool skipped,
                   std::int64_t skipped_samples, double loss_scale, std::vector<double> pipeline_idle_share) {
    interval_.add(global_batch, losses, skipped);
    json_interval_.add(global_batch, losses, skipped);
    stepped_ = stepped_ || !skipped;
    // The iteration's own values: what TensorBoard gets (Megatron's), on its own interval; the console line, JSON and
    // timing at the log interval replace the losses by the interval's means.
    IterationReport r;
    r.iteration = iteration;
    r.train_iters = config_.train_iters;
    r.consumed_samples = consumed;
    r.learning_rate = lr;
    r.global_batch_size = global_batch;
    r.world_size = world_size_;
    r.loss_tracked = stepped_;
    r.lm_loss = losses.lm;
    r.mtp_losses = losses.mtp;
    r.router_losses = losses.router;
    r.router_losses_per_layer = losses.router_per_layer;
    r.grad_norm = grad_norm;
    r.num_zeros_in_grad = norms.num_zeros_in_grad;
    r.params_norm = norms.params_norm;
    r.skipped_samples = skipped_samples;
    r.loss_scale = loss_scale;
    r.pipeline_idle_share = std::move(pipeline_idle_share);
    if (writes_ && tensorboard_) {
      const bool scalars = iteration % config_.tensorboard_log_interval == 0;
      if (scalars) TRESTLE_RETURN_IF_ERROR(write_tensorboard_iteration(*tensorboard_, r, config_.tensorboard_choices));
      TRESTLE_RETURN_IF_ERROR(write_tensorboard_mtp(*tensorboard_, r));
      TRESTLE_RETURN_IF_ERROR(write_tensorboard_router(*tensorboard_, r));
      if (scalars || !r.mtp_losses.empty() || !r.router_losses.empty()) TRESTLE_RETURN_IF_ERROR(tensorboard_->flush());
    }
    if (!logs(iteration)) return OkStatus();
    const bool first_line = std::exchange(first_, false);
    r.peak_memory_bytes = peak_memory_bytes(config_.device);
    // The JSON record: the means over the iterations since the previous record.
    const IterationReport own = json_interval_.summarise(r, flops_per_token_, world_size_);
    json_interval_ = fresh_interval();
    // The console line and TensorBoard's timing are Megatron's: its first line (after the run's first iteration)
    // resets nothing, so the next one covers that iteration too, also where the first ended an interval itself
    // (--log-interval 1: the second line averages iterations 1 and 2).
    const IterationReport console = carried_ ? carried_->merged(interval_).summarise(r, flops_per_token_, world_size_)
                                             : interval_.summarise(r, flops_per_token_, world_size_);
    if (first_line && iteration % config_.log_interval != 0) {
      // The first line, inside an interval: the interval goes on, for both.
    } else {
      carried_.reset();
      if (first_line) carried_ = interval_;
      interval_ = fresh_interval();
    }
    if (!writes_) return OkStatus();
    std::printf("%s\n", megatron_log_line(console, log_timestamp()).c_str());
    std::fflush(stdout);
    if (json_.is_open()) TRESTLE_RETURN_IF_ERROR(append_json(json_log_line(own)));
    if (tensorboard_ && !first_line) {  // the first iteration's time is the start's (Megatron writes it not)
      TRESTLE_RETURN_IF_ERROR(write_tensorboard_timing(*tensorboard_, console, config_.tensorboard_choices));
      TRESTLE_RETURN_IF_ERROR(tensorboard_->flush());
    }
    return OkStatus();
  }

  Status validation(const std::string& prefix, std::int64_t iteration, std::int64_t consumed, double loss) {
    if (!writes_) return OkStatus();
    const double ppl = std::exp(std::min(20.0, loss));
    char line[256];
    std::snprintf(line, sizeof line, " validation loss at %s | lm loss value: %.6E | lm loss PPL: %.6E | ",
                  prefix.c_str(), loss, ppl);
    const std::string dashes(std::string(line).size() + 1, '-');
    std::printf("%s\n%s\n%s\n", dashes.c_str(), line, dashes.c_str());
    std::fflush(stdout);
    if (json_.is_open())
      TRESTLE_RETURN_IF_ERROR(append_json(
          nlohmann::json{{"validation", prefix}, {"iteration", iteration}, {"lm_loss", loss}, {"lm_loss_ppl", ppl}}
              .dump()));
    // Megatron's --skip-train evaluates without writing to TensorBoard; the perplexity with
    // --log-validation-ppl-to-tensorboard.
    if (tensorboard_ && !config_.skip_train) {
      TRESTLE_RETURN_IF_ERROR(tensorboard_->add_scalar("lm loss validation", static_cast<float>(loss), iteration));
      TRESTLE_RETURN_IF_ERROR(
          tensorboard_->add_scalar("lm loss validation vs samples", static_cast<float>(loss), consumed));
      if (config_.tensorboard_choices.validation_ppl) {
        TRESTLE_RETURN_IF_ERROR(tensorboard_->add_scalar("lm loss validation ppl", static_cast<float>(ppl), iteration));
        TRESTLE_RETURN_IF_ERROR(
            tensorboard_->add_scalar("lm loss validation ppl vs samples", static_cast<float>(ppl), consumed));
      }
      TRESTLE_RETURN_IF_ERROR(tensorboard_->flush());
    }
    return OkStatus();
  }

  void say(const std::string& message) {
    if (!writes_) return;
    std::printf("%s\n", message.c_str());
    std::fflush(stdout);
  }

 private:
  // Whether the file exists and its last byte is not a newline.
  static bool ends_inside_a_line(const std::string& path) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in || in.tellg() <= 0) return false;
    in.seekg(-1, std::ios::end);
    return in.get() != '\n';
  }

  // One record and its newline in one write, so that a reader never sees a line without its end unless the
  // process was killed inside the write; a failed write (a full disk) ends the run naming the file.
  Status append_json(const std::string& record) {
    json_ << record + "\n" << std::flush;
    if (!json_) return Status::Error(*config_.json_log + ": cannot append to the JSON log (is the disk full?)");
    return OkStatus();
  }

  const TrainConfig& config_;
  bool writes_;
  double flops_per_token_;
  int world_size_;
  std::optional<TensorBoardWriter> tensorboard_;
  std::ofstream json_;
  // The iterations since a log line: their sums, as Megatron's total_loss_dict and interval timer keep them.
  struct Interval {
    Clock::time_point start = Clock::now();
    std::int64_t samples = 0;  // their global batches' samples (they differ under --rampup-batch-size)
    double loss_sum = 0;       // over the stepped iterations
    std::vector<double> mtp_sums;
    std::vector<double> router_sums;                    // over all the iterations, skipped ones included (Megatron's)
    std::int64_t count = 0, advanced = 0, skipped = 0;  // iterations: all, stepped, skipped
    std::int64_t nan = 0;  // skipped iterations whose loss was inf or NaN (Megatron's "number of nan iterations")

    void add(std::int64_t global_batch, const StepLosses& losses, bool skipped_step) {
      samples += global_batch;
      mtp_sums.resize(losses.mtp.size(), 0.0);
      router_sums.resize(losses.router.size(), 0.0);
      for (std::size_t k = 0; k < losses.router.size(); ++k) router_sums[k] += losses.router[k].second;
      if (skipped_step) {
        ++skipped;
        bool finite = std::isfinite(losses.lm);
        for (double m : losses.mtp) finite = finite && std::isfinite(m);
        for (const auto& router : losses.router) finite = finite && std::isfinite(router.second);
        if (!finite) ++nan;
      } else {
        ++advanced;
        loss_sum += losses.lm;
        for (std::size_t d = 0; d < losses.mtp.size(); ++d) mtp_sums[d] += losses.mtp[d];
      }
      ++count;
    }
    // This interval followed by `later`, from this one's start.
    Interval merged(const Interval& later) const {
      Interval m = later;
      m.start = start;
      m.samples += samples;
      m.loss_sum += loss_sum;
      m.mtp_sums.resize(std::max(m.mtp_sums.size(), mtp_sums.size()), 0.0);
      for (std::size_t d = 0; d < mtp_sums.size(); ++d) m.mtp_sums[d] += mtp_sums[d];
      m.router_sums.resize(std::max(m.router_sums.size(), router_sums.size()), 0.0);
      for (std::size_t k = 0; k < router_sums.size(); ++k) m.router_sums[k] += router_sums[k];
      m.count += count;
      m.advanced += advanced;
      m.skipped += skipped;
      m.nan += nan;
      return m;
    }
    // `r` (the last iteration's report) with the interval's means, timing and throughput.
    IterationReport summarise(IterationReport r, double flops_per_token, int world_size) const {
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count() / count;
      r.seconds_per_iteration = seconds;
      r.advanced_iterations = advanced;
      r.skipped_iterations = skipped;
      r.nan_iterations = nan;
      const double stepped = static_cast<double>(std::max<std::int64_t>(1, advanced));
      r.lm_loss = loss_sum / stepped;
      r.mtp_losses.clear();
      for (double m : mtp_sums) r.mtp_losses.push_back(m / stepped);
      for (std::size_t k = 0; k < r.router_losses.size() && k < router_sums.size(); ++k)
        r.router_losses[k].second = router_sums[k] / stepped;
      const double tokens = static_cast<double>(samples * seq_length) / count;
      r.tokens_per_second = tokens / seconds;
      if (peak_tflops && *peak_tflops > 0)
        r.mfu = flops_per_token * tokens / seconds / (*peak_tflops * 1e12 * world_size);
      if (log_throughput) r.throughput_tflops = flops_per_token * tokens / seconds / (1e12 * world_size);
      return r;
    }
    std::int64_t seq_length = 0;
    std::optional<double> peak_tflops;
    bool log_throughput = false;
  };
  Interval fresh_interval() const {
    Interval fresh;
    fresh.seq_length = config_.seq_length;
    fresh.peak_tflops = config_.peak_tflops;
    fresh.log_throughput = config_.log_throughput;
    return fresh;
  }
  Interval interval_ = fresh_interval();
  Interval json_interval_ = fresh_interval();  // since the previous JSON record
  bool stepped_ = false;                       // an iteration of the run stepped (Megatron then logs its loss keys)
  std::optional<Interval> carried_;  // the first line's iterations where it ended an interval: the next line's too
  bool first_ = true;                // no iteration of this run reported yet
};

class Loop {
 public:
  Loop(const parallel::ParallelState& state, const TrainConfig& config)
      : state_(state), config_(config), layout_(config.layout ? *config.layout : state.layout()) {}

  Status run();

 private:
  // Rank 0 takes --save's lock (lock_save_root) for the whole run; every rank fails alike when another job holds it.
  Status lock_save_root();
  Status check_inter_document_masking() const;
  Status build_model();
  Status load_or_initialize();
  Status build_data();
  Result<LossSum> forward_backward(const data::SampleSource& source, std::int64_t first_sample, bool backward);
  Result<TokenBatch> micro_batch(const data::SampleSource& source, std::int64_t first_sample, std::int64_t m) const;
  // The scalar a micro-batch's backward starts from (Megatron's loss normalisation); adds its sums to `sum`.
  Result<at::Tensor> micro_batch_loss(const ChunkForward& forward, const TokenBatch& batch, LossSum& sum,
                                      double scale);
  Status sum_embedding_copy_grads();
  // --log-params-norm: the L2 norm of the fp32 masters into last_norms_, reduced over `group` (the gradient norm's).
  Status log_params_norm(const parallel::ProcessGroup& group, const char* group_kind);
  Status divide_by_counted_tokens(double tokens, std::vector<at::Tensor>& grads);
  Status balance_expert_bias();
  // Every rank: each stage's share of time waiting on messages since the last call (on the reporting rank; empty
  // without a pipeline).
  Result<std::vector<double>> pipeline_idle_shares();
  Result<StepLosses> train_step();
  // The router losses of the step's forwards as Megatron's training log reports them (IterationReport::router_losses);
  // every rank, with the world's one reduction; nothing in a model without the losses.
  Status read_router_losses(StepLosses& losses);
  // Every rank loads one checkpoint: a rank whose --load tracker names an older iteration than another's loads the
  // newest (Megatron's max), and ranks whose checkpoints still differ (another --load, another file system) end the
  // job naming them, before anything is trained. Collective; `reader` is reopened where needed.
  Status agree_on_checkpoint(Result<CheckpointReader>& reader);
  // Every rank saves under the same --save (first: the save lock is taken together), and reads the same samples
  // (the training split's size and its first samples' tokens, whatever path each node reads them under): a node given
  // other flags ends the job naming its rank before any step. Collective.
  Status agree_on_save();
  Status agree_on_data();
  // The first rank whose `value` is not rank 0's (none when every rank's is the same). Collective.
  Result<std::optional<int>> first_rank_differing(const std::string& value, const char* what);
  // Megatron's --check-for-nan-in-loss-and-grad, after the step's gradient reduction: every rank's local losses and
  // (without fp16's loss scaling, whose skip handles them) its gradients as they entered the reduction must be finite.
  // The ranks share what they saw, so all of them fail alike, naming each rank and what it found.
  Status check_finite(const LossValues& sum);
  Result<double> evaluate(const data::SampleSource& split, std::int64_t first_sample);
  // The validation split's next evaluation (from consumed_valid_samples on, which it advances), as Megatron's one
  // validation iterator reads the split through a run and its resumes.
  Result<double> evaluate_validation();
  Status set_iteration_batch();
  std::int64_t scheduled_global_batch(std::int64_t consumed) const;       // the ramp-up's or step schedule's batch
  Result<BatchShape> scheduled_batch_shape(std::int64_t consumed) const;  // ... split and checked
  Status check_scheduled_batches() const;  // every batch the schedule reaches before --train-iters, up front
  Status check_pipeline_schedule(std::int64_t micro_batches) const;  // Megatron's checks of a pipeline schedule
  // Starts the save of this iteration, first committing the one in flight. A failed save (its write or commit, or
  // this one's planning or staging) is an error with --exit-on-save-failure (the default), else a warning, and
  // training goes on to try again at the next save.
  // The last save of a run (at its end, --exit-interval or a signal) fails the run either way.
  Status save(bool last = false);
  Status start_save();
  // Waits for the save in flight and commits it, saying so; a failure goes to save_failed.
  Status commit(bool last);
  Status save_ended(const Status& outcome, bool last);  // the save in flight is over: says so, or save_failed
  // Megatron's maybe_finalize_async_save(blocking=False), after every iteration: commits the save in flight as soon
  // as every rank's background write has ended (or reports its failure), not at the next save, so that a kill in
  // between keeps it. With a before_commit (the torch_dist form), rank 0 then runs it and commits behind training, and
  // a later check, once that has ended, agrees on the result. A collective over the world while a save is in flight;
  // nothing at all otherwise.
  Status commit_if_written();
  Status save_failed(std::int64_t iteration, const Status& error, bool last);
  Status finish();  // commits the save in flight (its failure is an error either way)
  // After a collective failed (a peer died or hung): which ranks never said the same, as " (rank 1 stopped ...)".
  std::string missing_ranks(const Status& failure) const;
  // --exit-signal-handler: whether any rank has received SIGTERM or SIGINT (a collective over the world).
  Result<bool> exit_signal_received();
  Result<std::optional<std::string>> past_exit_duration();

  const parallel::ParallelState& state_;
  const TrainConfig& config_;
  const ParallelLayout layout_;
  BatchShape shape_;       // this iteration's (under --rampup-batch-size its global batch grows)
  BatchShape eval_shape_;  // evaluation's: --global-batch-size's, or --eval-global-batch-size's
  BatchOptions batch_options_;
  std::unique_ptr<GptModel> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::optional<LrSchedule> schedule_;
  std::optional<LossScaler> scaler_;  // fp16 only
  std::unique_ptr<GradReduction> buckets_;
  std::unique_ptr<PipelineRunner> pipeline_;      // pp > 1
  std::vector<OptimizerSlice> optimizer_slices_;  // per optimizer entry: its parameter's piece, or a flat range of it
  std::vector<at::Tensor> owned_grads_;           // distributed optimizer: per entry, its reduced gradient
  std::vector<bool> counted_here_;                // per optimizer entry: its gradient counts in the norm here
  PipelineTimes pipeline_times_;                  // summed over the iterations since the last log line
  data::GptSplits data_;
  std::unique_ptr<parallel::ProcessGroupCollective> world_;
  std::unique_ptr<AsyncSaver> saver_;
  std::optional<FileLock> save_lock_;  // rank 0's, with --save
  TrainingProgress progress_;
  std::optional<double> last_grad_norm_;  // none for a skipped iteration
  StepNorms last_norms_;                  // --log-num-zeros-in-grad, --log-params-norm
  std::int64_t last_saved_ = -1;      // the iteration of the last save started (-1: none, or it failed)
  std::int64_t in_flight_ = -1;       // the iteration of the save being written (-1: none)
  std::int64_t first_iteration_ = 0;  // where this run started (the loaded iteration)
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();  // --exit-duration-in-mins
};

// --exit-signal-handler: the signal a worker received (0: none). The handler only notes it; the training loop reads it
// between iterations.
volatile std::sig_atomic_t received_exit_signal = 0;
extern "C" void note_exit_signal(int sig) { received_exit_signal = sig; }

// Installs note_exit_signal for SIGTERM, SIGINT and `extra` (Megatron's --exit-signal) for its lifetime (when asked
// to).
class ExitSignalHandler {
 public:
  ExitSignalHandler(bool install, int extra) : installed_(install) {
    if (!installed_) return;
    received_exit_signal = 0;
    struct sigaction action {};
    action.sa_handler = note_exit_signal;
    action.sa_flags = SA_RESTART;  // blocking calls in progress (collectives, writes) go on
    sigemptyset(&action.sa_mask);
    for (const int sig : {SIGTERM, SIGINT, extra}) {
      if (std::find(handled_.begin(), handled_.end(), sig) != handled_.end()) continue;
      handled_.push_back(sig);
      ::sigaction(sig, &action, &old_[handled_.size() - 1]);
    }
  }
  ExitSignalHandler(const ExitSignalHandler&) = delete;
  ExitSignalHandler& operator=(const ExitSignalHandler&) = delete;
  // Once a signal has been noted the handler stays: a repeat (a scheduler's process-group kill and the launcher's
  // copy of it) reaching a worker that has saved and is on its way out must not kill it.
  ~ExitSignalHandler() {
    if (!installed_ || received_exit_signal != 0) return;
    for (std::size_t i = 0; i < handled_.size(); ++i) ::sigaction(handled_[i], &old_[i], nullptr);
  }

 private:
  bool installed_;
  std::vector<int> handled_;
  struct sigaction old_[3]{};
};

// megatron-core runs --dataloader-inter-document-masking as packed sequences (THD), where what a document boundary
// means for the layers below is its own: Trestle refuses those rather than train them otherwise.
Status Loop::check_inter_document_masking() const {
  if (!config_.inter_document_masking) return OkStatus();
  const GptModelSpec& spec = config_.spec;
  const char* refused = nullptr;
  if (spec.hybrid_layers.find('M') != std::string::npos)
    refused = "the model's Mamba layers: megatron-core restarts their convolution and state at each document";
  else if (spec.has_linear_attention())
    refused = "the model's Gated DeltaNet layers: megatron-core restarts their state at each document";
  else if (spec.mtp_num_layers > 0)
    refused = "multi-token prediction: megatron-core shifts its tokens, labels and loss mask within each document";
  else if (spec.is_moe() && config_.moe_load_balancing.sequence > 0 && config_.micro_batch_size > 1)
    refused =
        "seq_aux_loss at a micro-batch size above 1: megatron-core packs a micro-batch's samples into one "
        "sequence, so its sequence-level balance spans them";
  if (refused == nullptr) return OkStatus();
  return Status::Error(std::string("--dataloader-inter-document-masking is not supported with ") + refused +
                       ", which Trestle does not do");
}

Status Loop::build_model() {
  const auto& layout = layout_;
  const auto& sizes = state_.layout();
  if (layout.tp != sizes.tp || layout.pp != sizes.pp || layout.cp != sizes.cp || layout.ep != sizes.ep ||
      layout.dp() != sizes.dp() || layout.expert_tp() != sizes.expert_tp())
    return Status::Error("the model's layout " + layout_sizes_to_json(layout).dump() +
                         " does not match the parallel state's " + layout_sizes_to_json(sizes).dump());
  TRESTLE_RETURN_IF_ERROR(check_inter_document_masking());
  // Context parallelism splits each sequence into 2 x cp chunks (none at cp 1); sequence parallelism splits each
  // rank's part over the tensor-parallel ranks.
  const std::int64_t chunks = layout.cp > 1 ? 2 * layout.cp : 1;
  if (config_.seq_length % chunks != 0 ||
      (config_.sequence_parallel && (config_.seq_length / layout.cp) % layout.tp != 0)) {
    const std::string split = layout.cp > 1 ? " must divide into 2 x cp = " + std::to_string(chunks) + " chunks" : "";
    return Status::Error("--seq-length " + std::to_string(config_.seq_length) + split +
                         (config_.sequence_parallel ? (split.empty() ? " must divide" : " whose pairs divide") +
                                                          std::string(" by the tensor-parallel size ") +
                                                          std::to_string(layout.tp) + " (--sequence-parallel)"
                                                    : ""));
  }
  const auto& tp = state_.tp_group();
  TpGroup group{tp.size() > 1 ? tp.backend : nullptr, state_.coordinates().tp_rank, layout.tp};
  ModelOptions options;
  options.sequence_parallel = config_.sequence_parallel;
  options.recompute = config_.recompute;
  options.dtype = config_.bf16 ? at::kBFloat16 : config_.fp16 ? at::kHalf : at::kFloat;
  options.device = config_.device;
  options.pipeline_stage = state_.coordinates().pp_rank;
  options.moe_load_balancing = config_.moe_load_balancing;
  options.moe_z_loss_coeff = config_.moe_z_loss_coeff;
  options.moe_capacity = config_.moe_capacity;
  options.moe_router_dtype = config_.moe_router_dtype;
  options.moe_grouped_gemm = config_.moe_grouped_gemm;
  options.fused_kernels = config_.fused_kernels;
  options.fused_output_loss = config_.fused_kernels;
  options.lora = config_.lora;
  const auto& cp = state_.cp_group();
  options.cp = CpRing{cp.size() > 1 ? cp.backend : nullptr, state_.coordinates().cp_rank, layout.cp};
  const auto& ep = state_.ep_group();
  options.ep = TpGroup{ep.size() > 1 ? ep.backend : nullptr, ep.rank, ep.size()};
  const auto& dp = state_.dp_group();
  options.dp = TpGroup{dp.size() > 1 ? dp.backend : nullptr, dp.rank, dp.size()};
  const auto& etp = state_.expert_tp_group();
  options.expert_tp = TpGroup{etp.size() > 1 ? etp.backend : nullptr, etp.rank, etp.size()};
  auto model = GptModel::create(config_.spec, layout, group, options);
  if (!model.ok()) return model.status();
  model_ = std::move(*model);
  if (layout.pp > 1) {
    // Megatron's checks of the schedule, before anything runs (training's, and evaluation's when its batch differs).
    TRESTLE_RETURN_IF_ERROR(check_pipeline_schedule(shape_.micro_batches()));
    if (eval_shape_.micro_batches() != shape_.micro_batches())
      TRESTLE_RETURN_IF_ERROR(check_pipeline_schedule(eval_shape_.micro_batches())
                                  .with_context("evaluation (--eval-global-batch-size, --eval-micro-batch-size)"));
    pipeline_ = std::make_unique<PipelineRunner>(*model_, state_.pp_group(), config_.device);
  }
  auto& params = model_->parameters();
  // Megatron's gradient norm counts a tensor-parallel replica once, and the last stage's copy of a tied embedding not
  // at all (the first stage's counts it). Under expert parallelism (or expert tensor parallelism of its own) the ranks
  // of a model-parallel group hold different experts (or pieces), so the norm spans every rank and each replica counts
  // on one data-parallel rank only.
  const bool expert_parallel = layout.experts_apart();
  std::vector<bool> counted;
  for (auto& p : params) {
    const bool embedding = p.name() == "embedding.word_embeddings.weight";
    const bool tied_copy = model_->holds_embedding_copy() && embedding;
    const int tp_rank = p.canonical.expert >= 0 ? state_.coordinates().etp_rank : state_.coordinates().tp_rank;
    bool counts = !tied_copy && (p.canonical.split != TpSplit::kReplicated || tp_rank == 0);
    if (expert_parallel && !config_.use_distributed_optimizer)
      counts = counts && (p.canonical.expert >= 0 ? state_.expert_dp_group() : state_.dp_cp_group()).rank == 0;
    counted.push_back(counts);
  }
  // Gradients are averaged over the data- and context-parallel ranks (megatron-core's 1 / dp_cp; summed with
  // --calculate-per-token-loss, then divided by the counted tokens). Under expert
  // parallelism the experts' (a buffer of their own, as in Megatron) over the ranks holding the same experts, scaled
  // alike: each expert's gradient already sums the tokens its expert-parallel group sent it.
  std::vector<GradReduction::Part> parts;
  // Megatron-LM's get_model: --ddp-num-buckets sizes the buckets of every buffer by all of this rank's parameters.
  std::int64_t bucket_elements = config_.ddp_bucket_elements;
  if (config_.ddp_num_buckets > 0) {
    std::int64_t rank_parameters = 0;
    for (const auto& p : params) rank_parameters += p.tensor.numel();
    bucket_elements = std::max<std::int64_t>(1, rank_parameters / config_.ddp_num_buckets);
  }
  for (const bool experts : {false, true}) {
    const auto& reducing = experts ? state_.expert_dp_group() : state_.dp_cp_group();
    GradReduction::Part part;
    std::vector<at::Tensor> tensors;
    std::vector<bool> shared_embedding;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if ((expert_parallel && params[i].canonical.expert >= 0) != experts) continue;
      part.params.push_back(i);
      tensors.push_back(params[i].tensor);
      shared_embedding.push_back(config_.spec.tied_embeddings &&
                                 params[i].name() == "embedding.word_embeddings.weight");
    }
    if (tensors.empty()) continue;
    std::optional<GradBuckets::Sharded> sharded;
    if (config_.use_distributed_optimizer) sharded = GradBuckets::Sharded{reducing.rank, shared_embedding};
    const char* kind = experts ? "expert-data-parallel" : layout.cp > 1 ? "data-and-context-parallel" : "data-parallel";
    auto buckets = GradBuckets::create(
        tensors, reducing.size() > 1 ? reducing.backend : nullptr, reducing.size(),
        bucket_elements > 0 ? bucket_elements : GradBuckets::default_bucket_elements(reducing.size()),
        describe(kind, reducing), config_.grads_in_fp32 ? at::kFloat : tensors.front().scalar_type(), sharded,
        config_.calculate_per_token_loss ? 1.0 : 1.0 / (layout.dp() * layout.cp));
    if (!buckets.ok()) return buckets.status();
    part.buckets = std::move(*buckets);
    // Megatron's line, once per buffer (the dense parameters', the experts') on each pipeline stage.
    const RankCoordinates& at = state_.coordinates();
    if (at.tp_rank == 0 && at.cp_rank == 0 && at.dp_rank == 0)
      std::printf(" Number of buckets for gradient all-reduce / reduce-scatter: %zu (%s, stage %d)\n",
                  part.buckets->bucket_count(), kind, at.pp_rank);
    parts.push_back(std::move(part));
  }
  auto reduction = GradReduction::create(params.size(), std::move(parts));
  if (!reduction.ok()) return reduction.status();
  buckets_ = std::make_unique<GradReduction>(std::move(*reduction));
  // Megatron: no weight decay for biases and one-dimensional parameters (norms); with --apply-wd-to-qk-layernorm the
  // query and key norms are decayed all the same (megatron-core's get_standard_config_overrides).
  auto decays = [qk_norms = config_.apply_wd_to_qk_layernorm](const ModelParameter& p) {
    const std::string& name = p.name();
    if (qk_norms && (name.find("q_layernorm.") != std::string::npos || name.find("k_layernorm.") != std::string::npos))
      return true;
    return p.tensor.dim() >= 2 && !name.ends_with(".bias");
  };
  // Megatron's is_embedding_or_output_parameter: the word embeddings (each stage's copy) and the output layer.
  const bool decoupled = config_.schedule.decoupled_max_lr.has_value();
  auto takes_decoupled_lr = [decoupled](const ModelParameter& p) {
    return decoupled && (p.name() == "embedding.word_embeddings.weight" || p.name() == "output_layer.weight");
  };
  std::vector<OptimizedParameter> optimized;
  if (config_.use_distributed_optimizer) {
    // The optimizer's masters and moments exist only for the pieces of this rank's shards.
    for (const GradReduction::Owned& owned : buckets_->owned()) {
      const ModelParameter& p = params[owned.param];
      const auto [begin, end] = owned.in_param;
      optimized.push_back(
          {p.name(), p.tensor.detach().view(-1).narrow(0, begin, end - begin), decays(p), takes_decoupled_lr(p)});
      optimizer_slices_.push_back({owned.param, FlatRange{begin, end}});
      owned_grads_.push_back(owned.grad);
      counted_here_.push_back(counted[owned.param]);
    }
  } else {
    for (auto& p : params) optimized.push_back({p.name(), p.tensor, decays(p), takes_decoupled_lr(p)});
    optimizer_slices_ = whole_optimizer_slices(model_->parameter_store());
    counted_here_ = counted;
  }
  optimizer_ = std::make_unique<AdamW>(std::move(optimized), config_.adam);
  if (config_.gradient_accumulation_fusion)
    model_->fuse_weight_grads([this](const at::Tensor& weight) { return buckets_->fused_sink(weight); });
  auto schedule = LrSchedule::create(config_.schedule);
  if (!schedule.ok()) return schedule.status();
  schedule_.emplace(std::move(*schedule));
  // Megatron's optimizer takes a grad scaler for fp16 (dynamic unless --loss-scale), and a constant --loss-scale under
  // bf16 or the distributed optimizer too (megatron-core's get_megatron_optimizer).
  const bool constant = !config_.loss_scaler.dynamic;
  if (config_.fp16 || (constant && (config_.bf16 || config_.use_distributed_optimizer))) {
    auto scaler = LossScaler::create(config_.loss_scaler);
    if (!scaler.ok()) return scaler.status();
    scaler_.emplace(std::move(*scaler));
  }
  return OkStatus();
}

Status Loop::load_or_initialize() {
  if (config_.lora) {
    // The frozen base, whatever layout it was saved in.
    auto base = CheckpointReader::open(*config_.pretrained_checkpoint, config_.pretrained_iteration);
    if (!base.ok()) return base.status();
    TRESTLE_RETURN_IF_ERROR(load_model_pieces(model_->base_parameter_store(), *base));
    TRESTLE_RETURN_IF_ERROR(load_model_pieces(model_->carried_store(), *base));  // a vision tower: the base's
    TRESTLE_RETURN_IF_ERROR(model_->load_expert_bias_state(&*base));             // the base's, frozen as the rest
    if (state_.rank() == state_.world_size() - 1) {
      std::printf(" loaded the base %s (frozen); LoRA %s adapters of rank %lld, alpha %g on %s\n",
                  base->directory().c_str(), std::string(lora_type_name(config_.lora->type)).c_str(),
                  static_cast<long long>(config_.lora->rank), config_.lora->alpha,
                  nlohmann::json(config_.lora->targets).dump().c_str());
      if (config_.spec.mtp_num_layers > 0)
        std::printf(" note: the adapters sit on the decoder's layers; the %lld multi-token-prediction layer(s) stay "
                    "frozen (Megatron-Bridge's LoRA adapts their linears too)\n",
                    static_cast<long long>(config_.spec.mtp_num_layers));
      std::fflush(stdout);
    }
  }
  if (!config_.load) {
    at::manual_seed(config_.seed);
    InitOptions init;
    init.seed = config_.seed;
    init.init_method_std = config_.init_method_std;
    init.embedding_init_method_std = config_.embedding_init_method_std;
    init.num_layers = config_.spec.num_layers;
    init.hybrid = config_.spec.hybrid();
    init.zero_centered_norms = config_.spec.zero_centered_norms;
    init.conv_kernel = config_.spec.mamba_conv_kernel;
    TRESTLE_RETURN_IF_ERROR(initialize_parameters(model_->parameter_store(), init));
    if (!config_.lora) {
      TRESTLE_RETURN_IF_ERROR(initialize_parameters(model_->carried_store(), init));
      TRESTLE_RETURN_IF_ERROR(model_->load_expert_bias_state(nullptr));
    }
    optimizer_->parameters_to_masters();
    return OkStatus();
  }
  auto reader = CheckpointReader::open(*config_.load, config_.load_iteration);
  if (!reader.ok()) return reader.status();
  TRESTLE_RETURN_IF_ERROR(agree_on_checkpoint(reader));
  TrainingLoadOptions options;
  options.weights_only = config_.finetune;
  options.load_optimizer = config_.load_optimizer;
  options.load_rng = config_.load_rng;
  options.rank = state_.rank();
  options.layout = layout_sizes_to_json(layout_);
  options.device = config_.device;
  if (!options.load_rng || config_.finetune) at::manual_seed(config_.seed);
  auto loaded = load_training_checkpoint(*reader, model_->parameter_store(), *optimizer_, optimizer_slices_, options);
  if (!loaded.ok()) return loaded.status();
  if (!config_.lora) {
    TRESTLE_RETURN_IF_ERROR(load_model_pieces(model_->carried_store(), *reader));
    TRESTLE_RETURN_IF_ERROR(model_->load_expert_bias_state(&*reader));
  }
  if (!loaded->rng_loaded) at::manual_seed(config_.seed);
  progress_ = loaded->progress;
  if (config_.release) {  // iteration 0, the consumed samples as recorded; no scheduler or loss scale
    progress_.iteration = 0;
    progress_.scheduler = nlohmann::json::object();
    progress_.loss_scaler = nlohmann::json::object();
  }
  // A converted Megatron checkpoint may carry its scheduler's state (steps counted as ours: samples; older Megatron
  // named them num_iters). Megatron loads it with the optimizer's: under --no-load-optim (or --finetune) the schedule
  // and the fp16 loss scale start afresh.
  const bool saved_schedule = progress_.scheduler.contains("num_steps") || progress_.scheduler.contains("num_iters");
  const bool schedule_restored = !config_.finetune && config_.load_optimizer && saved_schedule;
  if (!config_.finetune && !config_.load_optimizer && !config_.skip_train && progress_.iteration > 0 &&
      state_.rank() == state_.world_size() - 1) {
    std::printf(
        " note: --no-load-optim: the learning-rate schedule%s starts again from its first step, as Megatron's "
        "(which loads them with the optimizer's state)\n",
        scaler_ ? " and the loss scale" : "");
    std::fflush(stdout);
  }
  if (schedule_restored) {
    auto differences = schedule_->restore(progress_.scheduler, config_.saved_schedule);
    if (!differences.ok()) return differences.status().with_context(reader->directory());
    if (!differences->empty() && state_.rank() == state_.world_size() - 1) {
      const bool ours = config_.saved_schedule == LrSchedule::Saved::kOverride;
      std::printf(" note: the learning-rate schedule differs from the checkpoint's (%s); %s\n", differences->c_str(),
                  ours ? "this run's is used, as with Megatron's --override-opt_param-scheduler (without that flag "
                         "Megatron refuses the difference; --use-checkpoint-opt_param-scheduler keeps the checkpoint's)"
                       : "the checkpoint's is used (--use-checkpoint-opt_param-scheduler)");
      std::fflush(stdout);
    }
  }
  if (scaler_ && !config_.finetune && config_.load_optimizer && progress_.loss_scaler.contains("scale"))
    TRESTLE_RETURN_IF_ERROR(scaler_->restore(progress_.loss_scaler));
  // A checkpoint from elsewhere (Megatron's, converted) records its iteration but not our progress: Megatron's
  // constant global batch gives the samples consumed, and the scheduler's steps unless its state came along.
  const bool derived = !config_.finetune && !loaded->progress_recorded && progress_.iteration > 0;
  // --override-ckpt-iteration rewinds (or advances) the data the same way, as Megatron's does (a weights-only load
  // too: --pretrained-checkpoint's or a release's; Megatron refuses it only beside the --finetune flag).
  const bool overridden = config_.override_ckpt_iteration.has_value();
  if (overridden) progress_.iteration = *config_.override_ckpt_iteration;
  if (derived || overridden) progress_.consumed_train_samples = progress_.iteration * config_.global_batch_size;
  if (overridden) progress_.skipped_train_samples = 0;  // as Megatron's override
  // A scheduler that came without its state (a converted Megatron checkpoint's, which records its consumed samples
  // or not) steps to the samples consumed.
  if (!saved_schedule && !config_.finetune && config_.load_optimizer && progress_.iteration > 0)
    schedule_->step(progress_.consumed_train_samples);
  // A checkpoint that records no validation progress (Megatron's backward compatibility, an iteration-based run): the
  // periodic evaluations its iterations passed, from --start-eval-at-iter on, read their samples.
  if (!config_.finetune && progress_.iteration > 0 && progress_.consumed_valid_samples == 0 && !config_.train_samples &&
      config_.eval_interval > 0)
    progress_.consumed_valid_samples =
        std::max<std::int64_t>(
            0, progress_.iteration / config_.eval_interval - config_.start_eval_at_iter / config_.eval_interval) *
        config_.eval_iters * config_.eval_global_batch_size.value_or(config_.global_batch_size);
  if (state_.rank() == state_.world_size() - 1) {
    std::printf(
        " loaded %s (iteration %lld, %lld consumed samples)%s%s\n",
        config_.load_shown.value_or(reader->directory()).c_str(), static_cast<long long>(reader->manifest().iteration),
        static_cast<long long>(progress_.consumed_train_samples),
        config_.finetune ? (", weights only (" + config_.finetune_reason + ")").c_str()
        : config_.release
            ? ", its weights and consumed samples from iteration 0 (a release checkpoint, as Megatron loads one)"
        : loaded->optimizer_loaded ? ", with optimizer state"
                                   : ", no optimizer state: the optimizer starts fresh",
        overridden ? (", resuming as iteration " + std::to_string(progress_.iteration) +
                      " (--override-ckpt-iteration): consumed samples = iteration x global batch size, " +
                      (schedule_restored                             ? "the scheduler's state as saved"
                       : config_.load_optimizer && !config_.finetune ? "the scheduler stepped to them"
                                                                     : "the schedule from its first step"))
                         .c_str()
        : loaded->rng_loaded ? ", RNG state restored"
        : derived            ? ", consumed samples = iteration x global batch size"
                             : "");
    if (loaded->rng_absent && !config_.release && reader->manifest().iteration > 0)
      std::printf(
          " note: the checkpoint holds no RNG state for this layout's ranks (saved with --no-save-rng?): the "
          "generators start from --seed %llu; Megatron-LM stops here unless given --no-load-rng\n",
          static_cast<unsigned long long>(config_.seed));
    std::fflush(stdout);
  }
  return OkStatus();
}

Status Loop::build_data() {
  data::GptDataOptions options = config_.data;
  options.samples = split_sample_counts(config_);
  if (options.mock) {  // the mock documents' tokens are the model's vocabulary's (Megatron's NullTokenizer's)
    const std::int64_t vocab = model_->spec().vocab_size;
    options.mock->vocab_size = vocab;
    if (options.mock->eod < 0) options.mock->eod = vocab - 1;
    if (options.mock->eod >= vocab)
      return Status::Error("--mock-data: --eod-token-id " + std::to_string(options.mock->eod) +
                           " is outside the model's vocabulary of " + std::to_string(vocab));
  }
  options.config.sequence_length = static_cast<std::int32_t>(config_.seq_length);
  options.config.random_seed = static_cast<std::uint32_t>(config_.seed);
  // Rank 0 builds (and caches) the indices first; the others then read its cache, as Megatron does.
  Result<data::GptSplits> splits = Status::Error("not built");
  if (state_.rank() == 0) splits = data::build_gpt_splits(options);
  TRESTLE_RETURN_IF_ERROR(barrier(*world_, "to build the dataset indices"));
  if (state_.rank() != 0) splits = data::build_gpt_splits(options);
  if (!splits.ok()) return Status::Error("building the datasets: " + splits.status().message());
  data_ = std::move(*splits);
  if (!data_.splits[0]) return Status::Error("the training split is empty (--split " + options.split + ")");
  batch_options_.sequence_length = config_.seq_length;
  batch_options_.pad_token_id = options.config.pad_token_id;
  batch_options_.eod_mask_loss = config_.eod_mask_loss;
  // The mock documents end with their own end-of-document token (--eod-token-id, or the vocabulary's last).
  batch_options_.eod_token_id = options.mock ? options.mock->eod : config_.eod_token_id;
  batch_options_.reset_attention_mask = config_.reset_attention_mask;
  batch_options_.inter_document_masking = config_.inter_document_masking;
  batch_options_.vocab_size = config_.spec.vocab_size;
  return OkStatus();
}

Result<TokenBatch> Loop::micro_batch(const data::SampleSource& source, std::int64_t first_sample,
                                     std::int64_t m) const {
  auto batch = read_token_batch(source, micro_batch_samples(shape_, first_sample, state_.coordinates().dp_rank, m),
                                batch_options_);
  if (!batch.ok()) {
    std::string paths;
    for (const auto& prefix : config_.data.blend.prefixes) paths += (paths.empty() ? "" : " ") + prefix;
    return batch.status().with_context("--data-path " + paths);
  }
  if (const std::int64_t depth = config_.spec.mtp_num_layers; depth > 0) {
    batch->mtp_tokens = shifted_ahead(batch->tokens, depth);
    batch->mtp_labels = shifted_ahead(batch->labels, depth);
    batch->mtp_loss_mask = shifted_ahead(batch->loss_mask, depth);
  }
  if (layout_.cp > 1) {
    // This rank's two chunks of every sequence (Megatron's get_batch_on_this_cp_rank).
    const int cp = layout_.cp, rank = state_.coordinates().cp_rank;
    for (at::Tensor* t : {&batch->tokens, &batch->labels, &batch->loss_mask, &batch->positions})
      *t = cp_slice(*t, 1, cp, rank);
    for (at::Tensor* t : {&batch->mtp_tokens, &batch->mtp_labels, &batch->mtp_loss_mask})
      if (t->defined()) *t = cp_slice(*t, 2, cp, rank);
  }
  return on_device(std::move(*batch), config_.device);
}

// The micro-batch's loss as megatron-core's: the mean over this rank's counted tokens, plus, with multi-token
// prediction, each depth's mean times mtp_loss_scaling_factor / depths (its MTPLossAutoScaler), scaled by the loss
// scale over the number of micro-batches. Under context parallelism each rank's mean is over its own chunks' tokens
// and the gradients are averaged over the context-parallel ranks (as over the data-parallel ones), so an unevenly
// masked sequence trains on the mean of the ranks' means, as in megatron-core; the logged loss is the token mean.
// With --calculate-per-token-loss the sums themselves, times the loss scale: the gradients are summed over the ranks
// and divided by the global batch's counted tokens after their reduction (divide_by_counted_tokens).
Result<at::Tensor> Loop::micro_batch_loss(const ChunkForward& forward, const TokenBatch& batch, LossSum& sum,
                                          double scale) {
  const std::size_t depth = forward.mtp_logits.size();
  const bool per_token = config_.calculate_per_token_loss;
  const double step_scale = per_token ? scale : scale / static_cast<double>(shape_.micro_batches());
  // Each term's loss is Σ weight · per-token loss, the weights being the loss mask times what the term's sum is
  // scaled by (the model makes the output layer's gradients for those weights as it computes the loss).
  at::Tensor loss;
  std::vector<at::Tensor> totals;
  auto add = [&](const at::Tensor& output, const at::Tensor& labels, const at::Tensor& loss_mask, double factor,
                 bool is_mtp) {
    const at::Tensor mask = loss_mask.to(config_.device, at::kFloat);
    const at::Tensor count = mask.sum();
    const at::Tensor weights =
        per_token ? mask * (factor * step_scale) : mask * (factor * step_scale) / count.clamp_min(1.0);
    WeightedOutputLoss term = model_->weighted_loss_from_output(output, labels, weights);
    at::Tensor masked_sum = (term.per_token * mask).sum();
    if (!is_mtp && config_.test_nan_in == "loss" && state_.rank() == config_.test_nan_rank &&
        progress_.iteration + 1 == config_.test_nan_iteration) {
      masked_sum = masked_sum * std::numeric_limits<double>::quiet_NaN();
      term.sum = term.sum * std::numeric_limits<double>::quiet_NaN();
    }
    if (is_mtp) {
      totals.push_back((masked_sum / count.clamp_min(1.0)).to(at::kDouble));
    } else {
      totals.push_back(masked_sum.to(at::kDouble));
      totals.push_back(count.to(at::kDouble));
    }
    loss = loss.defined() ? loss + term.sum : term.sum;
  };
  add(forward.output, batch.labels, batch.loss_mask, 1.0, false);
  for (std::size_t d = 0; d < depth; ++d) {
    const auto i = static_cast<std::int64_t>(d);
    add(forward.mtp_logits[d], batch.mtp_labels[i], batch.mtp_loss_mask[i],
        config_.mtp_loss_scaling_factor / static_cast<double>(depth), true);
  }
  sum.add(at::stack(totals));
  return loss;
}

Result<LossSum> Loop::forward_backward(const data::SampleSource& source, std::int64_t first_sample, bool backward) {
  const std::int64_t micro_batches = shape_.micro_batches();
  const double scale = scaler_ ? scaler_->scale() : 1.0;
  // The gradients are averaged over the context-parallel ranks, whose auxiliary losses each cover their own tokens
  // of the whole sequences' loss: megatron-core scales them by cp. Per-token: by the tokens each router saw, the
  // gradients being divided by the counted tokens later.
  if (config_.calculate_per_token_loss) model_->set_aux_loss_backward_scale(scale, /*times_tokens=*/true);
  else model_->set_aux_loss_backward_scale(scale * layout_.cp / static_cast<double>(micro_batches));
  if (pipeline_) {
    PipelineRunOptions options;
    options.micro_batches = static_cast<int>(micro_batches);
    options.backward = backward;
    options.microbatch_group = config_.microbatch_group_size_per_vp_stage;
    options.loss = [&](const ChunkForward& forward, const TokenBatch& batch, LossSum& sum) {
      return micro_batch_loss(forward, batch, sum, scale);
    };
    options.arm_gradient_reduction = [this] { buckets_->arm(); };
    auto sum = pipeline_->run(options, [&](int m) { return micro_batch(source, first_sample, m); });
    if (backward) {
      pipeline_times_.waiting += pipeline_->times().waiting;
      pipeline_times_.total += pipeline_->times().total;
    }
    return sum;
  }
  LossSum sum;
  for (std::int64_t m = 0; m < micro_batches; ++m) {
    auto batch = micro_batch(source, first_sample, m);
    if (!batch.ok()) return batch.status();
    const ChunkForward forward =
        model_->forward_chunk(0, at::Tensor(), batch->tokens, batch->positions, batch->mtp_tokens, batch->documents);
    auto loss = micro_batch_loss(forward, *batch, sum, scale);
    if (!loss.ok()) return loss.status();
    if (!backward) continue;
    if (m == micro_batches - 1) buckets_->arm();
    loss->backward();
  }
  return sum;
}

Result<std::vector<double>> Loop::pipeline_idle_shares() {
  if (!pipeline_) return std::vector<double>();
  const std::string mine = std::to_string(state_.coordinates().pp_rank) + " " +
                           std::to_string(pipeline_times_.waiting) + " " + std::to_string(pipeline_times_.total);
  pipeline_times_ = {};
  auto gathered = world_->all_gather(mine);
  if (!gathered.ok()) return gathered.status();
  std::vector<double> share(static_cast<std::size_t>(layout_.pp), 0.0), ranks(share.size(), 0.0);
  for (const std::string& entry : *gathered) {
    int stage = -1;
    double waiting = 0, total = 0;
    if (std::sscanf(entry.c_str(), "%d %lf %lf", &stage, &waiting, &total) != 3 || stage < 0 || stage >= layout_.pp)
      return Status::Error("a rank reported malformed pipeline timings: " + entry);
    share[static_cast<std::size_t>(stage)] += total > 0 ? waiting / total : 0.0;
    ranks[static_cast<std::size_t>(stage)] += 1;
  }
  for (std::size_t s = 0; s < share.size(); ++s) share[s] /= std::max(ranks[s], 1.0);
  return share;
}

// Megatron's _allreduce_word_embedding_grads: with tied embeddings or multi-token prediction over several stages, the
// first stage's embedding and the last stage's copy (its output layer, or what its MTP layers embed with) are one
// weight, so each gets the sum of both gradients (after the data-parallel reduction).
Status Loop::log_params_norm(const parallel::ProcessGroup& group, const char* group_kind) {
  if (!config_.log_params_norm) return OkStatus();
  // Of the fp32 masters after the step (megatron-core's main params), summed as the gradient norm is.
  std::vector<at::Tensor> masters;
  for (std::size_t i = 0; i < optimizer_->parameters().size(); ++i) masters.push_back(optimizer_->fp32_param(i));
  Status status = OkStatus();
  last_norms_.params_norm = global_grad_norm(
      masters, counted_here_,
      [&](double squares) {
        std::vector<double> values{squares};
        if (auto s = all_reduce_sum(group, config_.device, group_kind, values, "parameter norm"); !s.ok()) status = s;
        return values[0];
      },
      config_.fused_kernels);
  return status;
}

Status Loop::sum_embedding_copy_grads() {
  const auto& group = state_.embedding_group();
  const bool copied = config_.spec.tied_embeddings || config_.spec.mtp_num_layers > 0;
  // Under LoRA the embedding is frozen: no gradient to sum.
  if (!copied || config_.lora || layout_.pp == 1 || !group.member() || group.size() <= 1) return OkStatus();
  const auto& params = model_->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].name() != "embedding.word_embeddings.weight") continue;
    std::vector<at::Tensor> grads{buckets_->grads()[i]};
    try {
      group.backend->allreduce(grads)->wait();
    } catch (const std::exception& e) {
      return Status::Error("all-reduce of the tied embedding's gradient in the " + describe("embedding", group) +
                           " failed (a peer died or hung): " + e.what());
    }
    return OkStatus();
  }
  return Status::Error("a first or last pipeline stage holds no embedding to tie to the output layer");
}

// Megatron's aux-loss-free balancing (finalize_model_grads' _update_router_expert_bias): the tokens each router sent
// to each expert over the global batch, summed over the tensor-, data- and context-parallel ranks, move every expert's
// bias by the update rate towards balance: bias + rate · sign(mean load - load), added in fp32 (Megatron's bias is an
// fp32 buffer) to the bias's fp32 state. No gradient moves the bias (the optimizer sees a zero one), so the new values
// go to the parameter (in the model's dtype) and to the optimizer's fp32 master alike.
Status Loop::balance_expert_bias() {
  const auto balances = model_->expert_balances();
  // Under LoRA the base (its expert bias included) stays as loaded: the adapter checkpoints do not hold it.
  if (balances.empty() || config_.lora) return OkStatus();
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> loads;
  for (const auto& b : balances) loads.push_back(*b.load);
  at::Tensor load = at::stack(loads);  // [layers, experts]
  model_->tp_group().all_reduce_sum(load);
  if (const auto& dp_cp = state_.dp_cp_group(); dp_cp.size() > 1) {
    std::vector<at::Tensor> one{load};
    try {
      dp_cp.backend->allreduce(one)->wait();
    } catch (const std::exception& e) {
      return Status::Error("all-reduce of the experts' loads in the " + describe("data-and-context-parallel", dp_cp) +
                           " failed (a peer died or hung): " + e.what());
    }
  }
  const at::Tensor step =
      at::sign(load.sum(-1, /*keepdim=*/true) / load.size(-1) - load) * config_.moe_router_bias_update_rate;
  const auto& params = model_->parameters();
  for (std::size_t l = 0; l < balances.size(); ++l) {
    const at::Tensor updated = *balances[l].state + step[static_cast<std::int64_t>(l)];
    balances[l].state->copy_(updated);
    balances[l].bias.detach().copy_(updated);
    balances[l].load->zero_();
    for (std::size_t i = 0; i < optimizer_slices_.size(); ++i) {
      const OptimizerSlice& slice = optimizer_slices_[i];
      if (!params[slice.parameter].tensor.is_same(balances[l].bias)) continue;
      at::Tensor values = updated.view(-1);
      if (slice.range) values = values.narrow(0, slice.range->start, slice.range->stop - slice.range->start);
      optimizer_->fp32_param(i).copy_(values.view_as(optimizer_->fp32_param(i)));
    }
  }
  return OkStatus();
}

Status Loop::check_finite(const LossValues& sum) {
  bool loss_bad = !std::isfinite(sum.loss);
  for (const double m : sum.mtp) loss_bad = loss_bad || !std::isfinite(m);
  const std::string buckets = scaler_ ? std::string() : buckets_->nonfinite_buckets();
  const int world = state_.world_size(), rank = state_.rank();
  std::vector<double> seen(2 * static_cast<std::size_t>(world), 0.0);
  seen[static_cast<std::size_t>(rank)] = loss_bad ? 1 : 0;
  seen[static_cast<std::size_t>(world + rank)] = buckets.empty() ? 0 : 1;
  TRESTLE_RETURN_IF_ERROR(all_reduce_sum(state_.world_group(), config_.device, "world", seen, "NaN/Inf check"));
  std::string found;
  for (int r = 0; r < world; ++r) {
    std::string what;
    if (seen[static_cast<std::size_t>(r)] > 0) what = "the local forward loss";
    if (seen[static_cast<std::size_t>(world + r)] > 0)
      what += (what.empty() ? "" : " and ") + std::string("the local gradients before the data-parallel reduction") +
              (r == rank ? " (" + buckets + ")" : "");
    if (!what.empty()) found += (found.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + what);
  }
  if (found.empty()) return OkStatus();
  return Status::Error("found NaN or Inf in " + found +
                       " (--check-for-nan-in-loss-and-grad; no checkpoint is saved of this iteration)");
}

Result<std::optional<int>> Loop::first_rank_differing(const std::string& value, const char* what) {
  auto gathered = world_->all_gather(value);
  if (!gathered.ok()) return gathered.status().with_context(std::string("comparing the ranks' ") + what);
  for (std::size_t r = 1; r < gathered->size(); ++r)
    if ((*gathered)[r] != (*gathered)[0]) return std::optional<int>(static_cast<int>(r));
  return std::optional<int>();
}

Status Loop::agree_on_checkpoint(Result<CheckpointReader>& reader) {
  auto iterations = world_->all_gather(std::to_string(reader->manifest().iteration));
  if (!iterations.ok()) return iterations.status().with_context("comparing the ranks' loaded iterations");
  std::int64_t newest = 0;
  for (const std::string& iteration : *iterations) newest = std::max<std::int64_t>(newest, std::stoll(iteration));
  if (reader->manifest().iteration != newest) {
    // As Megatron's read_metadata: a rank whose tracker is behind the others' (a stale view of a shared file system)
    // loads the newest iteration any rank found, saying so.
    std::printf(
        " warning: rank %d: %s names iteration %lld, another rank's names %lld: loading %lld, as Megatron "
        "does\n",
        state_.rank(), config_.load->c_str(), static_cast<long long>(reader->manifest().iteration),
        static_cast<long long>(newest), static_cast<long long>(newest));
    std::fflush(stdout);
    reader = CheckpointReader::open(*config_.load, newest);
  }
  // Every rank reads, or fails to read, the same checkpoint (its manifest, iteration included) before any trains.
  std::string mine = "unreadable";
  if (reader.ok()) {
    const std::string manifest = manifest_file_text(reader->manifest());
    mine = to_hex(xxh3_64(std::as_bytes(std::span(manifest.data(), manifest.size()))));
  }
  auto digests = world_->all_gather(mine);
  if (!digests.ok()) return digests.status().with_context("comparing the ranks' loaded checkpoints");
  if (!reader.ok())
    return reader.status().with_context("iteration " + std::to_string(newest) + " (the newest any rank found)");
  for (std::size_t r = 0; r < digests->size(); ++r) {
    if ((*digests)[r] == "unreadable")
      return Status::Error("rank " + std::to_string(r) + " cannot read iteration " + std::to_string(newest) +
                           " of its --load " + *config_.load + " (the newest any rank found)");
    if ((*digests)[r] != (*digests)[0])
      return Status::Error("rank " + std::to_string(r) + " loaded another checkpoint than rank 0 (iteration " +
                           std::to_string(newest) + " of another manifest): every rank must load the same --load (" +
                           *config_.load + " here); are the nodes' arguments or file systems the same?");
  }
  return OkStatus();
}

Status Loop::agree_on_save() {
  TRESTLE_ASSIGN_OR_RETURN(const auto differing,
                           first_rank_differing(config_.save ? "save " + *config_.save : "no save", "--save"));
  if (differing)
    return Status::Error("rank " + std::to_string(*differing) + " saves under another --save than rank 0 (" +
                         (config_.save ? *config_.save : std::string("none")) + " on rank " +
                         std::to_string(state_.rank()) + "): every rank writes its part of one checkpoint there");
  return OkStatus();
}

Status Loop::agree_on_data() {
  const data::SampleSource& train = *data_.splits[0];
  std::string fingerprint = std::to_string(train.size());
  for (std::size_t i = 0; i < std::min<std::size_t>(train.size(), 4); ++i) {
    TRESTLE_ASSIGN_OR_RETURN(const data::Sample sample, train.sample(i));
    fingerprint.append(reinterpret_cast<const char*>(sample.tokens.data()),
                       sample.tokens.size() * sizeof(std::int64_t));
  }
  TRESTLE_ASSIGN_OR_RETURN(
      const auto differing,
      first_rank_differing(to_hex(xxh3_64(std::as_bytes(std::span(fingerprint.data(), fingerprint.size())))),
                           "training samples"));
  if (differing)
    return Status::Error("rank " + std::to_string(*differing) +
                         " reads other training samples than rank 0: every rank must read the same data "
                         "(--data-path and its flags; are the nodes' arguments and files the same?)");
  return OkStatus();
}

Status Loop::read_router_losses(StepLosses& losses) {
  const LoadBalancingCoefficients& lb = config_.moe_load_balancing;
  const std::pair<RouterLoss, bool> tracked[] = {{kZLoss, config_.moe_z_loss_coeff > 0},
                                                 {kLoadBalancingLoss, lb.micro_batch > 0},
                                                 {kSeqLoadBalancingLoss, lb.sequence > 0},
                                                 {kGlobalLoadBalancingLoss, lb.global_batch > 0}};
  // (Nothing is logged into the layers without a tracked loss.)
  if (!config_.spec.is_moe() || std::none_of(std::begin(tracked), std::end(tracked), [](auto t) { return t.second; }))
    return OkStatus();
  const at::Tensor local = model_->take_router_losses();
  const double* values = local.data_ptr<double>();
  // megatron-core's tracker: each layer's losses summed over the pipeline stages; the load-balancing losses over the
  // tensor- and context-parallel ranks (their terms add up to the layer's loss) and averaged over the data-parallel
  // ones, global_aux_loss's summed over all of them; the z-loss is the reporting (last) rank's own, summed over its
  // pipeline group. One sum over the world gives all of them.
  const std::int64_t rows = local.size(0);
  const auto& last_pipeline = state_.pp_group().ranks;
  const bool in_reporting_pipeline =
      std::find(last_pipeline.begin(), last_pipeline.end(), state_.world_size() - 1) != last_pipeline.end();
  const double dp = static_cast<double>(layout_.dp());
  std::vector<double> shares(static_cast<std::size_t>(rows * kRouterLosses), 0.0);
  for (std::int64_t i = 0; i < rows; ++i)
    for (int k = 0; k < kRouterLosses; ++k) {
      double value = values[i * kRouterLosses + k];
      if (k == kZLoss) value = in_reporting_pipeline ? value : 0.0;
      if (k == kLoadBalancingLoss || k == kSeqLoadBalancingLoss) value /= dp;
      shares[static_cast<std::size_t>(i * kRouterLosses + k)] = value;
    }
  TRESTLE_RETURN_IF_ERROR(all_reduce_sum(state_.world_group(), config_.device, "world", shares, "router losses"));
  // Each iteration's value is its micro-batches' mean; the log's, the mean over the MoE layers (MTP layers counted).
  std::int64_t moe_layers = config_.spec.mtp_num_layers;
  for (std::int64_t i = 0; i < config_.spec.num_layers; ++i) moe_layers += config_.spec.layer_is_moe(i) ? 1 : 0;
  const double per_micro_batch = 1.0 / static_cast<double>(shape_.micro_batches());
  // The log's order is megatron-core's tracker's on the reporting rank: the order its router computes them when that
  // rank holds an MoE layer (z-loss first), else the order training_log names them (z-loss last).
  std::vector<RouterLoss> order;
  for (const auto& [kind, on] : tracked)
    if (on && kind != kZLoss) order.push_back(kind);
  if (tracked[0].second) order.insert(model_->has_moe_layer() ? order.begin() : order.end(), kZLoss);
  for (const RouterLoss kind : order) {
    std::vector<double> per_layer;
    double sum = 0;
    for (std::int64_t i = 0; i < rows; ++i) {
      per_layer.push_back(shares[static_cast<std::size_t>(i * kRouterLosses + kind)] * per_micro_batch);
      sum += per_layer.back();
    }
    losses.router.emplace_back(kRouterLossNames[kind],
                               sum / static_cast<double>(std::max<std::int64_t>(1, moe_layers)));
    if (config_.moe_per_layer_logging) losses.router_per_layer.push_back(std::move(per_layer));
  }
  return OkStatus();
}

Result<StepLosses> Loop::train_step() {
  last_norms_ = {};  // a skipped step (fp16 overflow) logs none
  // fp16's loss scaling finds overflowing gradients itself (and skips the step).
  buckets_->check_nonfinite(config_.check_for_nan_in_loss_and_grad && !scaler_);
  buckets_->zero();
  if (config_.test_nan_in == "grad" && state_.rank() == config_.test_nan_rank &&
      progress_.iteration + 1 == config_.test_nan_iteration)
    buckets_->poison_next_step_for_test();
  auto sum = forward_backward(*data_.splits[0], progress_.consumed_train_samples, /*backward=*/true);
  model_->reset_global_expert_counts();
  if (!sum.ok()) return sum.status();
  TRESTLE_RETURN_IF_ERROR(buckets_->finish());
  const auto depth = static_cast<std::size_t>(config_.spec.mtp_num_layers);
  const LossValues summed = sum->read(depth);
  if (config_.check_for_nan_in_loss_and_grad) TRESTLE_RETURN_IF_ERROR(check_finite(summed));
  model_->finish_grads(buckets_->grads());
  TRESTLE_RETURN_IF_ERROR(sum_embedding_copy_grads());
  TRESTLE_RETURN_IF_ERROR(balance_expert_bias());
  // Multi-token prediction's losses as Megatron logs them: each micro-batch's mean on each rank, averaged over the
  // micro-batches and the data- and context-parallel ranks.
  std::vector<double> reported{summed.loss, summed.tokens};
  reported.insert(reported.end(), summed.mtp.begin(), summed.mtp.end());
  TRESTLE_RETURN_IF_ERROR(
      all_reduce_sum(state_.dp_cp_group(), config_.device, "data-and-context-parallel", reported, "reported loss"));
  StepLosses loss;
  loss.lm = reported[0] / std::max(reported[1], 1.0);
  for (std::size_t d = 0; d < depth; ++d)
    loss.mtp.push_back(reported[2 + d] / static_cast<double>(shape_.micro_batches() * layout_.dp() * layout_.cp));
  TRESTLE_RETURN_IF_ERROR(read_router_losses(loss));
  // With the distributed optimizer each rank holds only its shards' gradients: checks and norms span every rank.
  // So do they under expert parallelism, where a model-parallel group's ranks hold different experts.
  const bool sharded = config_.use_distributed_optimizer;
  const bool whole_world = sharded || layout_.experts_apart();
  const parallel::ProcessGroup& norm_group = whole_world ? state_.world_group() : state_.mp_group();
  const char* norm_group_kind = whole_world ? "world" : "model-parallel";
  auto& grads = optimizer_->main_grads(sharded ? owned_grads_ : buckets_->grads());
  if (config_.calculate_per_token_loss) TRESTLE_RETURN_IF_ERROR(divide_by_counted_tokens(summed.tokens, grads));
  if (scaler_) {
    // Unscale, and skip the step when any rank of the model saw an inf or NaN (Megatron's fp16 optimizer).
    at::Tensor all_finite;  // on the gradients' device, read once
    for (auto& g : grads) {
      if (!g.defined()) continue;
      g.mul_(1.0 / scaler_->scale());
      const at::Tensor finite = at::isfinite(g).all();
      all_finite = all_finite.defined() ? all_finite.logical_and(finite.to(all_finite.device())) : finite;
    }
    const bool found_inf = all_finite.defined() && !all_finite.item<bool>();
    std::vector<double> flag{found_inf ? 1.0 : 0.0};
    TRESTLE_RETURN_IF_ERROR(all_reduce_sum(norm_group, config_.device, norm_group_kind, flag, "inf/NaN check"));
    scaler_->update(flag[0] > 0);
    if (flag[0] > 0) {
      ++progress_.skipped_iterations;
      last_grad_norm_.reset();
      TRESTLE_RETURN_IF_ERROR(log_params_norm(norm_group, norm_group_kind));  // Megatron logs it on a skip too
      return loss;
    }
  }
  Status reduce_status = OkStatus();
  last_grad_norm_ = global_grad_norm(
      grads, counted_here_,
      [&](double squares) {
        std::vector<double> v{squares};
        if (auto s = all_reduce_sum(norm_group, config_.device, norm_group_kind, v, "gradient norm"); !s.ok())
          reduce_status = s;
        return v[0];
      },
      config_.fused_kernels);
  TRESTLE_RETURN_IF_ERROR(reduce_status);
  // Megatron's counts and norms span what the gradient norm spans: each replica once.
  auto reduce = [&](const char* what, std::vector<double> values) -> Result<double> {
    TRESTLE_RETURN_IF_ERROR(all_reduce_sum(norm_group, config_.device, norm_group_kind, values, what));
    return values[0];
  };
  if (config_.log_num_zeros_in_grad) {
    double zeros = 0;
    for (std::size_t i = 0; i < grads.size(); ++i)
      if (grads[i].defined() && counted_here_[i])
        zeros += static_cast<double>((grads[i] == 0).sum().item<std::int64_t>());
    TRESTLE_ASSIGN_OR_RETURN(last_norms_.num_zeros_in_grad, reduce("count of zero gradients", {zeros}));
  }
  TRESTLE_RETURN_IF_ERROR(optimizer_->step(
      schedule_->lr(), schedule_->weight_decay(), clip_coefficient(*last_grad_norm_, config_.clip_grad),
      schedule_->has_decoupled_lr() ? std::optional<double>(schedule_->decoupled_lr()) : std::nullopt));
  TRESTLE_RETURN_IF_ERROR(log_params_norm(norm_group, norm_group_kind));
  if (sharded) TRESTLE_RETURN_IF_ERROR(buckets_->all_gather_parameters());
  schedule_->step(shape_.global_batch_size);
  return loss;
}

// --calculate-per-token-loss (megatron-core's finalize_model_grads given num_tokens): the counted tokens of the last
// stage's micro-batches, passed to the other stages and summed over the data- and context-parallel ranks, divide every
// gradient (none when no token counted).
Status Loop::divide_by_counted_tokens(double tokens, std::vector<at::Tensor>& grads) {
  std::vector<double> counted{tokens};
  TRESTLE_RETURN_IF_ERROR(
      all_reduce_sum(state_.pp_group(), config_.device, "pipeline-parallel", counted, "counted tokens"));
  TRESTLE_RETURN_IF_ERROR(
      all_reduce_sum(state_.dp_cp_group(), config_.device, "data-and-context-parallel", counted, "counted tokens"));
  if (counted[0] <= 0) return OkStatus();
  c10::NoGradGuard no_grad;
  for (at::Tensor& g : grads)
    if (g.defined()) g.div_(counted[0]);
  return OkStatus();
}

// Megatron's update_num_microbatches(consumed, consistency_check=True) before each iteration: the global batch the
// ramp-up has reached, which must divide into micro-batches of every data-parallel rank (and, pipelined, satisfy
// the schedule).
Status Loop::set_iteration_batch() {
  if (!config_.rampup && !config_.batch_steps) return OkStatus();
  if (scheduled_global_batch(progress_.consumed_train_samples) == shape_.global_batch_size) return OkStatus();
  TRESTLE_ASSIGN_OR_RETURN(shape_, scheduled_batch_shape(progress_.consumed_train_samples));
  return OkStatus();
}

std::int64_t Loop::scheduled_global_batch(std::int64_t consumed) const {
  return config_.rampup ? ramped_global_batch(*config_.rampup, config_.global_batch_size, consumed)
                        : stepped_global_batch(*config_.batch_steps, consumed);
}

Result<BatchShape> Loop::scheduled_batch_shape(std::int64_t consumed) const {
  const std::int64_t global = scheduled_global_batch(consumed);
  const char* flag = config_.rampup ? "--rampup-batch-size" : "--step-batch-size-schedule";
  auto shape = make_batch_shape(config_.micro_batch_size, global, layout_.dp(), config_.decrease_batch_size_if_needed);
  if (!shape.ok())
    return shape.status().with_context(std::string(flag) + ", at " + std::to_string(consumed) + " consumed samples");
  if (pipeline_)
    TRESTLE_RETURN_IF_ERROR(check_pipeline_schedule(shape->micro_batches())
                                .with_context(std::string(flag) + "'s global batch " + std::to_string(global) +
                                              " (at " + std::to_string(consumed) + " consumed samples)"));
  return shape;
}

// Every global batch the ramp-up or the step schedule reaches from the loaded progress to --train-iters, checked as
// set_iteration_batch will check it, before the first step: Megatron finds a batch that does not split (or does not
// fit the pipeline schedule) only when it gets there, after the iterations before it.
Status Loop::check_scheduled_batches() const {
  if ((!config_.rampup && !config_.batch_steps) || config_.skip_train) return OkStatus();
  std::int64_t consumed = progress_.consumed_train_samples, global = 0, taken = 0;
  for (std::int64_t iteration = progress_.iteration; iteration < config_.train_iters; ++iteration) {
    if (const std::int64_t next = scheduled_global_batch(consumed); next != global) {
      TRESTLE_ASSIGN_OR_RETURN(const BatchShape shape, scheduled_batch_shape(consumed));
      global = next;
      taken = shape.global_batch_size;  // (less than `global` under --decrease-batch-size-if-needed)
    }
    consumed += taken;
    // Past the ramp-up, or the step schedule's last threshold, the batch stays what it is.
    const bool settled =
        config_.rampup ? consumed > config_.rampup->samples : consumed >= config_.batch_steps->steps.back().first;
    if (settled) return scheduled_batch_shape(consumed).status();
  }
  return OkStatus();
}

Status Loop::check_pipeline_schedule(std::int64_t micro_batches) const {
  parallel::PipelineScheduleConfig schedule;
  schedule.pp = layout_.pp;
  schedule.chunks = model_->chunks();
  schedule.microbatches = static_cast<int>(micro_batches);
  schedule.microbatch_group = config_.microbatch_group_size_per_vp_stage;
  return parallel::check_pipeline_schedule_config(schedule);
}

// The mean loss over eval_iters global batches of the split (the validation or the test split) from first_sample on.
Result<double> Loop::evaluate(const data::SampleSource& split, std::int64_t first_sample) {
  c10::NoGradGuard no_grad;
  std::vector<double> total{0, 0};
  // Evaluation reads whole evaluation batches, whatever the ramp-up is at (Megatron's).
  const BatchShape training = std::exchange(shape_, eval_shape_);
  for (std::int64_t i = 0; i < config_.eval_iters; ++i) {
    auto sum = forward_backward(split, first_sample + i * eval_shape_.global_batch_size, /*backward=*/false);
    if (!sum.ok()) {
      shape_ = training;
      return Status::Error("evaluation: " + sum.status().message());
    }
    const LossValues summed = sum->read(0);
    total[0] += summed.loss;
    total[1] += summed.tokens;
  }
  shape_ = training;
  TRESTLE_RETURN_IF_ERROR(
      all_reduce_sum(state_.dp_cp_group(), config_.device, "data-and-context-parallel", total, "validation loss"));
  return total[0] / std::max(total[1], 1.0);
}

Result<double> Loop::evaluate_validation() {
  auto loss = evaluate(*data_.splits[1], progress_.consumed_valid_samples);
  if (loss.ok()) progress_.consumed_valid_samples += config_.eval_iters * eval_shape_.global_batch_size;
  return loss;
}

// The end of a failed save's message: what a resume would load.
std::string tracker_after_failure(const std::string& root) {
  const auto latest = read_latest_iteration(root);
  if (latest.ok() && !latest->has_value()) return "No checkpoint has been committed yet";
  return "The tracker still names the last complete checkpoint";
}

Status Loop::save(bool last) {
  if (saver_->in_flight()) TRESTLE_RETURN_IF_ERROR(commit(last));
  if (Status s = start_save(); !s.ok()) {
    last_saved_ = -1;
    return save_failed(progress_.iteration, s, last);
  }
  return OkStatus();
}

Status Loop::commit(bool last) { return save_ended(saver_->finalize(), last); }

Status Loop::save_ended(const Status& outcome, bool last) {
  const std::int64_t iteration = in_flight_;
  in_flight_ = -1;
  if (!outcome.ok()) {
    last_saved_ = -1;
    return save_failed(iteration, outcome, last);
  }
  if (state_.rank() == state_.world_size() - 1) {
    std::printf(" committed checkpoint of iteration %lld in %s\n", static_cast<long long>(iteration),
                config_.save->c_str());
    std::fflush(stdout);
  }
  return OkStatus();
}

Status Loop::commit_if_written() {
  // Saves start at the same iterations on every rank, so either all of them have one in flight here or none has.
  if (!saver_ || !saver_->in_flight()) return OkStatus();
  // Summed: the MIN of "done" over the ranks. Every rank is at the same stage: start_commit() is a collective.
  const bool committing = saver_->commit_started();
  std::vector<double> busy{(committing ? saver_->commit_finished() : saver_->write_finished()) ? 0.0 : 1.0};
  TRESTLE_RETURN_IF_ERROR(all_reduce_sum(state_.world_group(), config_.device, "world", busy, "background-save check"));
  if (busy[0] > 0) return OkStatus();
  if (!committing && config_.save_options.before_commit) {
    // Rank 0's before_commit (the torch_dist form) writes a whole copy: it runs behind training as the write did.
    const Status started = saver_->start_commit();
    return started.ok() ? OkStatus() : save_ended(started, /*last=*/false);
  }
  return commit(/*last=*/false);
}

Status Loop::save_failed(std::int64_t iteration, const Status& error, bool last) {
  // A peer lost after rank 0's commit: the checkpoint is whole and tracked, and the job cannot go on.
  const auto tracked = read_latest_iteration(*config_.save);
  if (tracked.ok() && *tracked == iteration)
    return Status::Error("the checkpoint of iteration " + std::to_string(iteration) + " in " + *config_.save +
                         " was committed (the tracker names it), but the ranks could not confirm it: " +
                         error.message() + missing_ranks(error));
  const std::string what = "the checkpoint of iteration " + std::to_string(iteration) + " in " + *config_.save +
                           " was not saved: " + error.message() + missing_ranks(error) + ". " +
                           tracker_after_failure(*config_.save);
  if (last) return Status::Error(what);
  if (config_.exit_on_save_failure) return Status::Error(what + " (--exit-on-save-failure)");
  if (state_.rank() == state_.world_size() - 1) {
    std::fprintf(stderr, "WARNING: %s; training goes on and saves again at the next save (--no-exit-on-save-failure)\n",
                 what.c_str());
    std::fflush(stderr);
  }
  return OkStatus();
}

Status Loop::start_save() {
  progress_.scheduler = schedule_->state();
  if (scaler_) progress_.loss_scaler = scaler_->state();
  progress_.args = config_.args;
  progress_.megatron_args = {{"seq_length", config_.seq_length}};
  TrainingCheckpoint checkpoint;
  checkpoint.root = *config_.save;
  checkpoint.layout = layout_sizes_to_json(layout_);
  checkpoint.model = config_.model_json;
  checkpoint.files = config_.carried_files;
  checkpoint.progress = progress_;
  checkpoint.device = config_.device;
  checkpoint.save_rng = config_.save_rng;
  if (!config_.lora) checkpoint.saved_as = model_->expert_bias_states();  // fp32, as Megatron's buffers
  // As Megatron: an iteration saved again (a run resumed from before it, or one whose earlier commit was cut short)
  // replaces the old directory, in one atomic swap.
  SaveOptions options = config_.save_options;
  options.overwrite = true;
  const auto start = Clock::now();
  TRESTLE_RETURN_IF_ERROR(save_training_checkpoint_async(*saver_, *world_, checkpoint, model_->parameter_store(),
                                                         config_.save_optimizer ? optimizer_.get() : nullptr,
                                                         optimizer_slices_, options,
                                                         config_.lora ? nullptr : &model_->carried_store()));
  last_saved_ = in_flight_ = progress_.iteration;
  if (state_.rank() == state_.world_size() - 1) {
    std::printf(" saving checkpoint at iteration %7lld to %s (staged in %.1f ms; writing in the background)\n",
                static_cast<long long>(progress_.iteration), config_.save->c_str(),
                std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    std::fflush(stdout);
  }
  return OkStatus();
}

Status Loop::lock_save_root() {
  std::string failure;
  if (state_.rank() == 0) {
    auto lock = trestle::lock_save_root(*config_.save);
    if (lock.ok()) save_lock_.emplace(std::move(*lock));
    else failure = lock.status().message();
  }
  auto gathered = world_->all_gather(failure);
  if (!gathered.ok()) return Status::Error("waiting for rank 0 to lock --save: " + gathered.status().message());
  if (!gathered->front().empty()) return Status::Error(gathered->front());
  return OkStatus();
}

Status Loop::run() {
  auto shape = make_batch_shape(config_.micro_batch_size, config_.global_batch_size, layout_.dp(),
                                config_.decrease_batch_size_if_needed);
  if (!shape.ok()) return shape.status();
  shape_ = *shape;
  // Megatron-LM 0.19's --eval-micro-batch-size and --eval-global-batch-size (each the training one's by default).
  auto eval_shape = make_batch_shape(config_.eval_micro_batch_size.value_or(config_.micro_batch_size),
                                     config_.eval_global_batch_size.value_or(config_.global_batch_size), layout_.dp(),
                                     config_.decrease_batch_size_if_needed);
  if (!eval_shape.ok()) return eval_shape.status().with_context("evaluation (--eval-global-batch-size)");
  eval_shape_ = *eval_shape;
  // Installed before the model is built and loaded (minutes for a large one), as Megatron's is at initialization: a
  // signal then ends the job after its first step, saved, like any other.
  const ExitSignalHandler signal_handler(config_.exit_signal_handler, config_.exit_signal);
  hold_point("signal handler installed");
  world_ = std::make_unique<parallel::ProcessGroupCollective>(state_.world_group().backend, config_.device);
  TRESTLE_RETURN_IF_ERROR(agree_on_save());
  if (config_.save) TRESTLE_RETURN_IF_ERROR(lock_save_root());
  TRESTLE_RETURN_IF_ERROR(build_model());
  TRESTLE_RETURN_IF_ERROR(load_or_initialize());
  TRESTLE_RETURN_IF_ERROR(check_scheduled_batches());
  TRESTLE_RETURN_IF_ERROR(build_data());
  TRESTLE_RETURN_IF_ERROR(agree_on_data());
  if (config_.save)
    saver_ =
        std::make_unique<AsyncSaver>(1, config_.device.is_cuda() ? torch_pool_allocator() : allocate_locked_if_allowed);
  const bool writes = state_.rank() == state_.world_size() - 1;
  Reporter reporter(config_, writes,
                    model_flops_per_token(config_.spec, config_.seq_length, model_->padded_vocab_size()),
                    state_.world_size());
  TRESTLE_RETURN_IF_ERROR(reporter.open());
  const bool validate = config_.eval_iters > 0 && data_.splits[1] != nullptr;
  reporter.start_interval();
  first_iteration_ = progress_.iteration;
  StepProfiler profiler(config_.profile, state_.rank(), config_.device.is_cuda());
  if (config_.skip_train) reporter.say(" skipping training (--skip-train): evaluating only");
  while (!config_.skip_train && progress_.iteration < config_.train_iters) {
    TRESTLE_RETURN_IF_ERROR(set_iteration_batch());
    if (config_.iterations_to_skip.count(progress_.iteration + 1)) {  // as Megatron: the batch is passed over
      ++progress_.iteration;
      progress_.consumed_train_samples += shape_.global_batch_size;
      progress_.skipped_train_samples += shape_.global_batch_size;
      reporter.say(" skipped iteration " + std::to_string(progress_.iteration) + " (--iterations-to-skip)");
      continue;
    }
    profiler.before_iteration(progress_.iteration);
    if (state_.rank() == config_.test_kill_rank && progress_.iteration == config_.test_kill_iteration)
      std::raise(SIGKILL);
    if (state_.rank() == config_.test_hang_rank && progress_.iteration + 1 == config_.test_hang_iteration)
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    const std::int64_t skipped_before = progress_.skipped_iterations;
    auto loss = guarded([&] { return train_step(); });
    if (!loss.ok())
      return Status::Error("iteration " + std::to_string(progress_.iteration + 1) + ": " + loss.status().message() +
                           missing_ranks(loss.status()));
    ++progress_.iteration;
    progress_.consumed_train_samples += shape_.global_batch_size;
    auto profile = profiler.after_iteration(progress_.iteration);
    if (!profile.ok()) return profile.status();
    if (!profile->empty()) {
      std::fputs(profile->c_str(), stdout);
      std::fflush(stdout);
    }
    std::vector<double> idle;
    if (pipeline_ && reporter.logs(progress_.iteration)) {
      auto shares = pipeline_idle_shares();
      if (!shares.ok()) return shares.status();
      idle = std::move(*shares);
    }
    TRESTLE_RETURN_IF_ERROR(reporter.iteration(
        progress_.iteration, progress_.consumed_train_samples, shape_.global_batch_size, schedule_->lr(), *loss,
        last_grad_norm_, last_norms_, progress_.skipped_iterations > skipped_before, progress_.skipped_train_samples,
        scaler_ ? scaler_->scale() : 1.0, std::move(idle)));
    TRESTLE_RETURN_IF_ERROR(commit_if_written());
    // As Megatron's loop: the periodic evaluation (the last iteration's too, before the run's final one), then the
    // checkpoint and the exits, so that a checkpoint counts the validation samples read before it.
    if (validate && config_.eval_interval > 0 && progress_.iteration % config_.eval_interval == 0 &&
        progress_.iteration >= config_.start_eval_at_iter) {
      const Clock::time_point evaluation_start = Clock::now();
      auto valid = guarded([&] { return evaluate_validation(); });
      if (!valid.ok()) return valid.status();
      TRESTLE_RETURN_IF_ERROR(reporter.validation("iteration " + std::to_string(progress_.iteration),
                                                  progress_.iteration, progress_.consumed_train_samples, *valid));
      reporter.exclude_since(evaluation_start);
    }
    if (config_.save && config_.save_interval > 0 && progress_.iteration % config_.save_interval == 0)
      TRESTLE_RETURN_IF_ERROR(save());
    if (config_.exit_duration_minutes > 0) {
      auto over = past_exit_duration();
      if (!over.ok()) return over.status();
      if (over->has_value()) {
        if (config_.save && last_saved_ != progress_.iteration) TRESTLE_RETURN_IF_ERROR(save(/*last=*/true));
        TRESTLE_RETURN_IF_ERROR(finish());
        reporter.say(" exiting at iteration " + std::to_string(progress_.iteration) + " after " + **over +
                     " minutes (--exit-duration-in-mins)");
        return OkStatus();
      }
    }
    if (config_.exit_interval > 0 && progress_.iteration % config_.exit_interval == 0) {
      if (config_.save && last_saved_ != progress_.iteration) TRESTLE_RETURN_IF_ERROR(save(/*last=*/true));
      reporter.say(" exiting at iteration " + std::to_string(progress_.iteration) + " (--exit-interval)");
      return finish();
    }
    // Megatron's --exit-signal-handler: a SIGTERM, SIGINT or --exit-signal on any rank (Slurm's warning before
    // preemption) ends the job after this step, saved and committed.
    if (config_.exit_signal_handler) {
      auto received = exit_signal_received();
      if (!received.ok()) return received.status();
      if (*received) {
        if (config_.save && last_saved_ != progress_.iteration) TRESTLE_RETURN_IF_ERROR(save(/*last=*/true));
        TRESTLE_RETURN_IF_ERROR(finish());
        reporter.say(" exiting at iteration " + std::to_string(progress_.iteration) +
                     " after receiving a termination signal (--exit-signal-handler)");
        return OkStatus();
      }
    }
  }
  // A run that trained nothing (resumed at its last iteration) has nothing new to save.
  if (config_.save && last_saved_ != progress_.iteration && progress_.iteration > first_iteration_)
    TRESTLE_RETURN_IF_ERROR(save(/*last=*/true));
  // As Megatron ends a run: the validation split where the periodic evaluations left it (from its first batches
  // with --skip-train), then the test split from its first batches.
  for (const auto& [split, name] : {std::pair{1, "validation"}, std::pair{2, "test"}}) {
    if (config_.eval_iters == 0 || data_.splits[static_cast<std::size_t>(split)] == nullptr) continue;
    auto loss = guarded([&]() -> Result<double> {
      if (split == 2) return evaluate(*data_.splits[2], 0);
      if (config_.skip_train) return evaluate(*data_.splits[1], 0);
      return evaluate_validation();
    });
    if (!loss.ok()) return loss.status();
    TRESTLE_RETURN_IF_ERROR(
        reporter.validation("iteration " + std::to_string(progress_.iteration) + " on " + name + " set",
                            progress_.iteration, progress_.consumed_train_samples, *loss));
  }
  return finish();
}

Status Loop::finish() {
  if (!saver_ || !saver_->in_flight()) return OkStatus();
  return commit(/*last=*/true);
}

std::string Loop::missing_ranks(const Status& failure) const {
  if (failure.message().find("(a peer died or hung)") == std::string::npos) return {};
  // The others time out within about a step of this rank; a rank that died or hangs never reports.
  const std::vector<int> missing = state_.ranks_not_reporting_failure(std::chrono::seconds(10));
  if (missing.empty()) return {};
  std::string names;
  for (const int r : missing) names += (names.empty() ? "" : ", ") + std::to_string(r);
  return "; rank(s) " + names + " stopped answering or died (every other rank saw the failure)";
}

// Megatron's duration check: when any rank has trained longer than --exit-duration-in-mins (minutes since its trainer
// started), this rank's minutes; nothing otherwise.
Result<std::optional<std::string>> Loop::past_exit_duration() {
  const double minutes =
      std::chrono::duration<double, std::ratio<60>>(std::chrono::steady_clock::now() - started_).count();
  std::vector<double> over{minutes > config_.exit_duration_minutes ? 1.0 : 0.0};
  TRESTLE_RETURN_IF_ERROR(all_reduce_sum(state_.world_group(), config_.device, "world", over, "duration check"));
  if (over[0] == 0) return std::optional<std::string>();
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", minutes);
  return std::optional<std::string>(text);
}

Result<bool> Loop::exit_signal_received() {
  std::vector<double> received{received_exit_signal != 0 ? 1.0 : 0.0};
  TRESTLE_RETURN_IF_ERROR(
      all_reduce_sum(state_.world_group(), config_.device, "world", received, "exit-signal check"));
  return received[0] > 0;
}

}  // namespace

std::array<std::optional<std::int64_t>, 3> split_sample_counts(const TrainConfig& config) {
  const std::int64_t gbs = config.global_batch_size, eval_gbs = config.eval_global_batch_size.value_or(gbs);
  // --skip-train evaluates once (megatron-core 0.19's count), a training run at every eval-interval and at the end.
  // --start-eval-at-iter passes over the evaluation points before it (megatron-core 0.19's count).
  std::int64_t evaluations = 1;
  if (!config.skip_train && config.eval_interval > 0)
    evaluations = std::max<std::int64_t>(
        0, config.train_iters / config.eval_interval + 1 - config.start_eval_at_iter / config.eval_interval);
  return {config.train_samples.value_or(config.train_iters * gbs), evaluations * config.eval_iters * eval_gbs,
          config.eval_iters * eval_gbs};
}

Status train(const parallel::ParallelState& state, const TrainConfig& config) {
  Loop loop(state, config);
  return loop.run();
}

}  // namespace trestle::train
