#include "train/loop/pipeline_runner.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/pipeline_schedule.h"

namespace trestle::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// A forward whose backward has not run yet.
struct InFlight {
  at::Tensor input;   // the received activations (a leaf requiring grad); undefined on the first virtual stage
  at::Tensor output;  // the hidden states sent on, or the scaled loss on the last virtual stage
  std::shared_ptr<const LayerContext> context;
};

// The index of the first backward from which on every backward is its chunk's last of the iteration: from there,
// each parameter's gradient is complete once its chunk's backward has run. -1 without backwards.
int arm_index(const std::vector<parallel::PipelineStep>& steps, int chunks) {
  std::vector<int> last(static_cast<std::size_t>(chunks), -1);
  for (std::size_t i = 0; i < steps.size(); ++i)
    if (!steps[i].forward) last[static_cast<std::size_t>(steps[i].chunk)] = static_cast<int>(i);
  int last_partial = -1;
  for (std::size_t i = 0; i < steps.size(); ++i)
    if (!steps[i].forward && static_cast<int>(i) != last[static_cast<std::size_t>(steps[i].chunk)])
      last_partial = static_cast<int>(i);
  for (std::size_t i = static_cast<std::size_t>(last_partial + 1); i < steps.size(); ++i)
    if (!steps[i].forward) return static_cast<int>(i);
  return -1;
}

class Messages {
 public:
  Messages(const parallel::ProcessGroup& group, int stage, int virtual_stages, PipelineTimes& times)
      : group_(group), stage_(stage), virtual_stages_(virtual_stages), times_(times) {}

  // Activations of virtual stage `from` (to from + 1) or, with `gradient`, the gradient of virtual stage `from`'s
  // input (to from - 1), of micro-batch m.
  Status send(const at::Tensor& tensor, int m, int from, bool gradient) {
    const int to = gradient ? from - 1 : from + 1;
    std::vector<at::Tensor> tensors{tensor.detach().contiguous()};
    try {
      auto work = group_.backend->send(tensors, peer(to), tag(m, from, gradient));
      pending_.push_back({std::move(tensors), std::move(work), describe(m, from, to, gradient)});
    } catch (const std::exception& e) {
      return failed("sending", describe(m, from, to, gradient), e);
    }
    return OkStatus();
  }

  Result<at::Tensor> receive(at::IntArrayRef shape, const at::TensorOptions& options, int m, int from, bool gradient) {
    const int to = gradient ? from - 1 : from + 1;
    std::vector<at::Tensor> tensors{at::empty(shape, options)};
    const auto start = Clock::now();
    try {
      group_.backend->recv(tensors, peer(from), tag(m, from, gradient))->wait();
    } catch (const std::exception& e) {
      return failed("receiving", describe(m, from, to, gradient), e);
    }
    times_.waiting += seconds_since(start);
    return tensors[0];
  }

  // Waits for every send to complete.
  Status finish() {
    const auto start = Clock::now();
    for (auto& p : pending_) {
      try {
        p.work->wait();
      } catch (const std::exception& e) {
        pending_.clear();
        return failed("sending", p.what, e);
      }
    }
    pending_.clear();
    times_.waiting += seconds_since(start);
    return OkStatus();
  }

 private:
  struct Pending {
    std::vector<at::Tensor> tensors;  // kept alive until the send completes
    c10::intrusive_ptr<c10d::Work> work;
    std::string what;
  };

  int peer(int virtual_stage) const { return virtual_stage % group_.size(); }
  int tag(int m, int from, bool gradient) const { return (m * virtual_stages_ + from) * 2 + (gradient ? 1 : 0); }

  std::string describe(int m, int from, int to, bool gradient) const {
    return std::string(gradient ? "the activation gradients" : "the activations") + " of micro-batch " +
           std::to_string(m) + " from virtual stage " + std::to_string(from) + " (rank " +
           std::to_string(group_.ranks[static_cast<std::size_t>(peer(from))]) + ") to virtual stage " +
           std::to_string(to) + " (rank " + std::to_string(group_.ranks[static_cast<std::size_t>(peer(to))]) + ")";
  }

  Status failed(const char* doing, const std::string& what, const std::exception& e) const {
    return Status::Error("pipeline stage " + std::to_string(stage_) + ": " + doing + " " + what +
                         " failed (a peer died or hung): " + e.what());
  }

  const parallel::ProcessGroup& group_;
  int stage_;
  int virtual_stages_;
  PipelineTimes& times_;
  std::vector<Pending> pending_;
};

}  // namespace

PipelineRunner::PipelineRunner(GptModel& model, const parallel::ProcessGroup& pipeline, at::Device device)
    : model_(model), pipeline_(pipeline), device_(device) {}

LossValues LossSum::read(std::size_t mtp_depth) const {
  LossValues values;
  values.mtp.assign(mtp_depth, 0.0);
  if (!totals.defined()) return values;
  const at::Tensor host = totals.to(at::kCPU, at::kDouble).contiguous();
  const double* v = host.data_ptr<double>();
  values.loss = v[0];
  values.tokens = v[1];
  for (std::size_t d = 0; d < mtp_depth && static_cast<std::int64_t>(d) + 2 < host.numel(); ++d)
    values.mtp[d] = v[d + 2];
  return values;
}

Result<LossSum> PipelineRunner::run(const PipelineRunOptions& options,
                                    const std::function<Result<TokenBatch>(int)>& batch) {
  const int pp = model_.layout().pp, stage = model_.stage(), chunks = model_.chunks();
  if (pipeline_.size() != pp || pipeline_.rank != stage || !pipeline_.backend)
    return Status::Error("the pipeline group (rank " + std::to_string(pipeline_.rank) + " of " +
                         std::to_string(pipeline_.size()) + ") does not match the model's stage " +
                         std::to_string(stage) + " of " + std::to_string(pp));
  parallel::PipelineScheduleConfig config;
  config.pp = pp;
  config.chunks = chunks;
  config.microbatches = options.micro_batches;
  config.microbatch_group = options.microbatch_group;
  config.forward_only = !options.backward;
  TRESTLE_RETURN_IF_ERROR(parallel::check_pipeline_schedule_config(config));
  const std::vector<parallel::PipelineStep> steps = parallel::pipeline_schedule(config, stage);
  const int arm_at = options.backward ? arm_index(steps, chunks) : -1;

  times_ = {};
  const auto start = Clock::now();
  Messages messages(pipeline_, stage, pp * chunks, times_);
  std::vector<std::optional<TokenBatch>> batches(static_cast<std::size_t>(options.micro_batches));
  std::map<std::pair<int, int>, InFlight> in_flight;
  const at::TensorOptions activation = at::TensorOptions().dtype(model_.activation_dtype()).device(device_);
  LossSum sum;

  for (std::size_t i = 0; i < steps.size(); ++i) {
    const parallel::PipelineStep& step = steps[i];
    const int m = step.microbatch, chunk = step.chunk, v = chunk * pp + stage;
    if (step.forward) {
      auto& b = batches[static_cast<std::size_t>(m)];
      if (!b) {
        auto read = batch(m);
        if (!read.ok()) return read.status();
        b = std::move(*read);
      }
      InFlight f;
      if (!model_.is_first_virtual_stage(chunk)) {
        const std::int64_t seq = model_.hidden_sequence(b->tokens.size(1));
        auto input = messages.receive({seq, b->tokens.size(0), model_.stage_width(chunk)}, activation, m, v - 1,
                                      /*gradient=*/false);
        if (!input.ok()) return input.status();
        f.input = input->requires_grad_(options.backward);
      }
      ChunkForward out = model_.forward_chunk(chunk, f.input, b->tokens, b->positions, b->mtp_tokens, b->documents);
      f.context = out.context;
      if (model_.is_last_virtual_stage(chunk)) {
        auto loss = options.loss(out, *b, sum);
        if (!loss.ok()) return loss.status();
        f.output = std::move(*loss);
      } else {
        TRESTLE_RETURN_IF_ERROR(messages.send(out.output, m, v, /*gradient=*/false));
        f.output = out.output;
      }
      if (options.backward) in_flight[{m, chunk}] = std::move(f);
      continue;
    }
    if (static_cast<int>(i) == arm_at && options.arm_gradient_reduction) options.arm_gradient_reduction();
    auto found = in_flight.find({m, chunk});
    if (found == in_flight.end())
      return Status::Error("pipeline stage " + std::to_string(stage) + ": backward of micro-batch " +
                           std::to_string(m) + " before its forward");
    InFlight f = std::move(found->second);
    in_flight.erase(found);
    if (model_.is_last_virtual_stage(chunk)) {
      torch::autograd::backward({f.output});
    } else {
      auto grad = messages.receive(f.output.sizes(), activation, m, v + 1, /*gradient=*/true);
      if (!grad.ok()) return grad.status();
      torch::autograd::backward({f.output}, {*grad});
    }
    if (!model_.is_first_virtual_stage(chunk))
      TRESTLE_RETURN_IF_ERROR(messages.send(f.input.grad(), m, v, /*gradient=*/true));
  }
  TRESTLE_RETURN_IF_ERROR(messages.finish());
  times_.total = seconds_since(start);
  return sum;
}

}  // namespace trestle::train
