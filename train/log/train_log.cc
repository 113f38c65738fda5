#include "train/log/train_log.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>
#include <string>

namespace trestle {
namespace {

template <typename... Args>
std::string format(const char* pattern, Args... args) {
  char buffer[256];
  const int n = std::snprintf(buffer, sizeof buffer, pattern, args...);
  return std::string(buffer, static_cast<std::size_t>(std::max(0, std::min<int>(n, sizeof buffer - 1))));
}

}  // namespace

std::string megatron_log_line(const IterationReport& r, const std::string& timestamp) {
  std::string s = " [" + timestamp + "]";
  s += format(" iteration %8lld/%8lld |", static_cast<long long>(r.iteration), static_cast<long long>(r.train_iters));
  s += format(" consumed samples: %12lld |", static_cast<long long>(r.consumed_samples));
  if (r.skipped_samples > 0) s += format(" skipped samples: %12lld |", static_cast<long long>(r.skipped_samples));
  s += format(" elapsed time per iteration (ms): %.1f |", r.seconds_per_iteration * 1000.0);
  if (r.throughput_tflops) s += format(" throughput per GPU (TFLOP/s/GPU): %.1f |", *r.throughput_tflops);
  s += format(" learning rate: %.6E |", r.learning_rate);
  s += format(" global batch size: %5lld |", static_cast<long long>(r.global_batch_size));
  // An interval of skipped steps only has no mean loss: Megatron prints none before the run's first stepped
  // iteration and 0 after it (its total_loss_dict then holds the key, reset to 0 at each line).
  const bool losses = r.advanced_iterations > 0 || r.loss_tracked;
  if (losses) s += format(" lm loss: %.6E |", r.advanced_iterations > 0 ? r.lm_loss : 0.0);
  for (const auto& [name, value] : r.router_losses)  // Megatron prints those above 0, stepped iterations or not
    if (value > 0) s += " " + name + format(": %.6E |", value);
  if (losses) {
    for (std::size_t d = 0; d < r.mtp_losses.size(); ++d)
      s += format(" mtp_%zu loss: %.6E |", d + 1, r.advanced_iterations > 0 ? r.mtp_losses[d] : 0.0);
  }
  s += format(" loss scale: %.1f |", r.loss_scale);
  if (r.grad_norm) s += format(" grad norm: %.3f |", *r.grad_norm);
  // A count, printed as Megatron-LM prints its integer (megatron-core 0.17's count_zeros_fp32 returns an int)
  if (r.num_zeros_in_grad) s += format(" num zeros: %lld |", std::llround(*r.num_zeros_in_grad));
  if (r.params_norm) s += format(" params norm: %.3f |", *r.params_norm);
  s += format(" number of skipped iterations: %3lld |", static_cast<long long>(r.skipped_iterations));
  s += format(" number of nan iterations: %3lld |", static_cast<long long>(r.nan_iterations));
  s += format(" tokens per second: %.1f |", r.tokens_per_second);
  if (r.mfu) s += format(" MFU: %.2f%% |", *r.mfu * 100.0);
  if (!r.pipeline_idle_share.empty()) {
    s += " pipeline idle per stage:";
    for (double share : r.pipeline_idle_share) s += format(" %.1f%%", share * 100.0);
    s += " |";
  }
  return s;
}

std::string json_log_line(const IterationReport& r) {
  nlohmann::json j = {{"iteration", r.iteration},
                      {"train_iters", r.train_iters},
                      {"consumed_samples", r.consumed_samples},
                      {"elapsed_time_per_iteration_ms", r.seconds_per_iteration * 1000.0},
                      {"learning_rate", r.learning_rate},
                      {"global_batch_size", r.global_batch_size},
                      {"loss_scale", r.loss_scale},
                      {"skipped_iterations", r.skipped_iterations},
                      {"nan_iterations", r.nan_iterations},
                      {"tokens_per_second", r.tokens_per_second}};
  if (r.advanced_iterations > 0) {
    j["lm_loss"] = r.lm_loss;
    for (std::size_t d = 0; d < r.mtp_losses.size(); ++d) j["mtp_" + std::to_string(d + 1) + "_loss"] = r.mtp_losses[d];
  }
  for (const auto& [name, value] : r.router_losses)
    if (value > 0) j[name] = value;
  if (r.skipped_samples > 0) j["skipped_samples"] = r.skipped_samples;
  if (r.grad_norm) j["grad_norm"] = *r.grad_norm;
  if (r.num_zeros_in_grad) j["num_zeros"] = std::llround(*r.num_zeros_in_grad);
  if (r.params_norm) j["params_norm"] = *r.params_norm;
  if (r.mfu) j["mfu"] = *r.mfu;
  if (r.throughput_tflops) j["throughput_tflops_per_gpu"] = *r.throughput_tflops;
  if (r.peak_memory_bytes) j["peak_memory_bytes"] = *r.peak_memory_bytes;
  if (!r.pipeline_idle_share.empty()) j["pipeline_idle_share"] = r.pipeline_idle_share;
  return j.dump();
}

Status write_tensorboard_iteration(TensorBoardWriter& writer, const IterationReport& r,
                                   const TensorBoardChoices& choices) {
  const std::int64_t it = r.iteration, samples = r.consumed_samples;
  auto both = [&](const std::string& tag, double value) -> Status {
    TRESTLE_RETURN_IF_ERROR(writer.add_scalar(tag, static_cast<float>(value), it));
    return writer.add_scalar(tag + " vs samples", static_cast<float>(value), samples);
  };
  TRESTLE_RETURN_IF_ERROR(both("learning-rate", r.learning_rate));
  TRESTLE_RETURN_IF_ERROR(both("batch-size", static_cast<double>(r.global_batch_size)));
  TRESTLE_RETURN_IF_ERROR(both("lm loss", r.lm_loss));
  if (choices.loss_scale) TRESTLE_RETURN_IF_ERROR(both("loss-scale", r.loss_scale));
  if (choices.world_size) TRESTLE_RETURN_IF_ERROR(both("world-size", static_cast<double>(r.world_size)));
  if (r.skipped_samples > 0)
    TRESTLE_RETURN_IF_ERROR(writer.add_scalar("skipped-train-samples", static_cast<float>(r.skipped_samples), it));
  if (r.grad_norm) TRESTLE_RETURN_IF_ERROR(both("grad-norm", *r.grad_norm));
  if (r.num_zeros_in_grad) TRESTLE_RETURN_IF_ERROR(both("num-zeros", *r.num_zeros_in_grad));
  if (r.params_norm) TRESTLE_RETURN_IF_ERROR(both("params-norm", *r.params_norm));
  return OkStatus();
}

Status write_tensorboard_mtp(TensorBoardWriter& writer, const IterationReport& r) {
  for (std::size_t d = 0; d < r.mtp_losses.size(); ++d)  // Megatron writes these against the iteration only
    TRESTLE_RETURN_IF_ERROR(
        writer.add_scalar("mtp_" + std::to_string(d + 1) + " loss", static_cast<float>(r.mtp_losses[d]), r.iteration));
  return OkStatus();
}

Status write_tensorboard_router(TensorBoardWriter& writer, const IterationReport& r) {
  for (std::size_t k = 0; k < r.router_losses.size(); ++k) {
    const auto& [name, value] = r.router_losses[k];
    TRESTLE_RETURN_IF_ERROR(writer.add_scalar(name, static_cast<float>(value), r.iteration));
    if (k >= r.router_losses_per_layer.size()) continue;
    const auto& layers = r.router_losses_per_layer[k];
    for (std::size_t i = 0; i < layers.size(); ++i)
      TRESTLE_RETURN_IF_ERROR(
          writer.add_scalar("moe/" + name + "_layer_" + std::to_string(i), static_cast<float>(layers[i]), r.iteration));
  }
  return OkStatus();
}

Status write_tensorboard_timing(TensorBoardWriter& writer, const IterationReport& r,
                                const TensorBoardChoices& choices) {
  if (choices.timers) {
    TRESTLE_RETURN_IF_ERROR(
        writer.add_scalar("iteration-time", static_cast<float>(r.seconds_per_iteration), r.iteration));
    if (r.throughput_tflops)
      TRESTLE_RETURN_IF_ERROR(writer.add_scalar("throughput", static_cast<float>(*r.throughput_tflops), r.iteration));
  }
  return writer.add_scalar("tokens-per-second", static_cast<float>(r.tokens_per_second), r.iteration);
}

Status write_tensorboard(TensorBoardWriter& writer, const IterationReport& r, const TensorBoardChoices& choices) {
  TRESTLE_RETURN_IF_ERROR(write_tensorboard_iteration(writer, r, choices));
  TRESTLE_RETURN_IF_ERROR(write_tensorboard_mtp(writer, r));
  TRESTLE_RETURN_IF_ERROR(write_tensorboard_router(writer, r));
  TRESTLE_RETURN_IF_ERROR(write_tensorboard_timing(writer, r, choices));
  return writer.flush();
}

std::string log_timestamp() {
  const auto clock = std::chrono::system_clock::now();
  const std::time_t now = std::chrono::system_clock::to_time_t(clock);
  const auto micros =
      std::chrono::duration_cast<std::chrono::microseconds>(clock.time_since_epoch()).count() % 1'000'000;
  std::tm local{};
  ::localtime_r(&now, &local);
  char buffer[48];
  const std::size_t n = std::strftime(buffer, sizeof buffer, "%Y-%m-%d %H:%M:%S", &local);
  std::snprintf(buffer + n, sizeof buffer - n, ".%06lld", static_cast<long long>(micros));
  return buffer;
}

}  // namespace trestle
