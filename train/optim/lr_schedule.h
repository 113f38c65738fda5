// Learning rate and weight decay over training, as Megatron-Core's OptimizerParamScheduler computes them: linear
// warmup from init_lr to max_lr, then constant, linear, cosine, inverse-square-root or WSD decay to min_lr by
// decay_steps; weight decay constant or increased linearly / by cosine from start_wd to end_wd. Steps count samples
// (Megatron steps the scheduler by the global batch size each iteration). Its state is the step count, saved as JSON.
// Megatron's decoupled learning rate (--decoupled-lr, --decoupled-min-lr) follows the same warmup and decay between
// its own bounds; the optimizer gives it to the word embeddings and the output layer.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "ckpt/status.h"

namespace trestle {

enum class LrDecayStyle { kConstant, kLinear, kCosine, kInverseSquareRoot, kWsd };
enum class WsdDecayStyle { kLinear, kCosine, kExponential, kMinusSqrt };
enum class WdIncrementStyle { kConstant, kLinear, kCosine };

Result<LrDecayStyle> parse_lr_decay_style(const std::string& name);    // Megatron's names: constant, linear, cosine,
                                                                       // inverse-square-root, WSD
Result<WsdDecayStyle> parse_wsd_decay_style(const std::string& name);  // linear, cosine, exponential, minus_sqrt
Result<WdIncrementStyle> parse_wd_increment_style(const std::string& name);  // constant, linear, cosine

struct LrScheduleConfig {
  double init_lr = 0.0;  // --lr-warmup-init
  double max_lr = 0.0;   // --lr
  double min_lr = 0.0;   // --min-lr
  double warmup_steps = 0;  // a fraction of the decay (--lr-warmup-fraction) need not be whole, as in Megatron
  std::int64_t decay_steps = 1;
  LrDecayStyle decay_style = LrDecayStyle::kLinear;
  std::int64_t wsd_decay_steps = 0;
  WsdDecayStyle wsd_decay_style = WsdDecayStyle::kExponential;
  double start_wd = 0.01;  // --start-weight-decay (default: --weight-decay)
  double end_wd = 0.01;
  std::int64_t wd_increment_steps = 1;
  WdIncrementStyle wd_increment_style = WdIncrementStyle::kConstant;
  std::optional<double> decoupled_max_lr;  // --decoupled-lr
  std::optional<double> decoupled_min_lr;  // --decoupled-min-lr (default: --min-lr)
};

class LrSchedule {
 public:
  // Checks the config as Megatron does (0 <= min_lr <= max_lr, init_lr <= max_lr, warmup < decay steps, ...).
  static Result<LrSchedule> create(const LrScheduleConfig& config);

  void step(std::int64_t increment) { steps_ += increment; }
  std::int64_t steps() const { return steps_; }
  double lr() const;            // at the current step
  // The decoupled learning rate at the current step (lr() when there is none).
  double decoupled_lr() const;
  bool has_decoupled_lr() const { return config_.decoupled_max_lr.has_value(); }
  double weight_decay() const;  // at the current step

  // {"num_steps": ..., and the config}: the keys and values of Megatron's OptimizerParamScheduler.state_dict().
  nlohmann::json state() const;
  // Takes num_steps, and compares the checkpoint's schedule with this one as Megatron's OptimizerParamScheduler does
  // (learning rates, warmup and decay steps, decay style, weight-decay increments; each a key of state() or of
  // Megatron's older names). Where they differ, `choice` keeps this run's values or takes the checkpoint's; returns
  // the differences ("" when none), for the caller to report.
  enum class Saved { kOverride, kUseCheckpoint };
  Result<std::string> restore(const nlohmann::json& state, Saved choice = Saved::kOverride);

 private:
  explicit LrSchedule(const LrScheduleConfig& config) : config_(config) {}
  double lr_between(double max_lr, double min_lr) const;
  LrScheduleConfig config_;
  std::int64_t steps_ = 0;
};

}  // namespace trestle
