#include "train/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <iomanip>
#include <numbers>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace trestle {
namespace {

template <typename Enum>
using NameTable = std::initializer_list<std::pair<const char*, Enum>>;

// Megatron's spellings (its argument values, and what its scheduler's state_dict records).
const NameTable<LrDecayStyle> kLrDecayStyles = {{"constant", LrDecayStyle::kConstant},
                                                {"linear", LrDecayStyle::kLinear},
                                                {"cosine", LrDecayStyle::kCosine},
                                                {"inverse-square-root", LrDecayStyle::kInverseSquareRoot},
                                                {"WSD", LrDecayStyle::kWsd}};
const NameTable<WsdDecayStyle> kWsdDecayStyles = {{"linear", WsdDecayStyle::kLinear},
                                                  {"cosine", WsdDecayStyle::kCosine},
                                                  {"exponential", WsdDecayStyle::kExponential},
                                                  {"minus_sqrt", WsdDecayStyle::kMinusSqrt}};
const NameTable<WdIncrementStyle> kWdIncrementStyles = {{"constant", WdIncrementStyle::kConstant},
                                                        {"linear", WdIncrementStyle::kLinear},
                                                        {"cosine", WdIncrementStyle::kCosine}};

template <typename Enum>
Result<Enum> parse_name(const std::string& name, NameTable<Enum> names, const char* what) {
  std::string known;
  for (const auto& [text, value] : names) {
    if (name == text) return value;
    known += (known.empty() ? "" : ", ") + std::string(text);
  }
  return Status::Error(std::string(what) + " '" + name + "' is not one of " + known);
}

std::string shown(double value) {
  std::ostringstream out;
  out << std::setprecision(17) << value;
  return out.str();
}

template <typename Enum>
const char* name_of(Enum value, NameTable<Enum> names) {
  for (const auto& [text, v] : names)
    if (v == value) return text;
  return "?";
}

}  // namespace

Result<LrDecayStyle> parse_lr_decay_style(const std::string& name) {
  return parse_name(name, kLrDecayStyles, "--lr-decay-style");
}

Result<WsdDecayStyle> parse_wsd_decay_style(const std::string& name) {
  return parse_name(name, kWsdDecayStyles, "--lr-wsd-decay-style");
}

Result<WdIncrementStyle> parse_wd_increment_style(const std::string& name) {
  return parse_name(name, kWdIncrementStyles, "--weight-decay-incr-style");
}

Result<LrSchedule> LrSchedule::create(const LrScheduleConfig& c) {
  auto fail = [](const std::string& why) { return Status::Error("learning-rate schedule: " + why); };
  if (!(c.min_lr >= 0.0)) return fail("--min-lr must be at least 0");
  if (!(c.max_lr >= c.min_lr))
    return fail("--lr must be at least --min-lr (--lr " + shown(c.max_lr) + ", --min-lr " + shown(c.min_lr) + ")");
  if (!(c.init_lr <= c.max_lr)) return fail("--lr-warmup-init must be at most --lr");
  if (c.decay_steps <= 0) return fail("the decay must last at least one step");
  if (!(c.warmup_steps >= 0))
    return fail("the warmup (" + shown(c.warmup_steps) +
                " steps) must not be negative (--lr-warmup-iters, --lr-warmup-samples, --lr-warmup-fraction)");
  if (!(c.warmup_steps < static_cast<double>(c.decay_steps)))
    return fail("warmup (" + shown(c.warmup_steps) + " steps) must be shorter than the decay (" +
                std::to_string(c.decay_steps) +
                "), both in samples as Megatron counts them (--lr-warmup-iters / --lr-decay-iters x the global batch "
                "size, --lr-warmup-samples / --lr-decay-samples, the training's length when no decay is given)");
  if (c.decoupled_max_lr && !(*c.decoupled_max_lr >= 0.0 && std::isfinite(*c.decoupled_max_lr)))
    return fail("--decoupled-lr must be a number, at least 0");
  if (c.decoupled_min_lr && !(*c.decoupled_min_lr >= 0.0 && std::isfinite(*c.decoupled_min_lr)))
    return fail("--decoupled-min-lr must be a number, at least 0");
  if (c.decay_style == LrDecayStyle::kWsd && (c.wsd_decay_steps <= 0 || c.wsd_decay_steps > c.decay_steps))
    return fail("WSD needs --lr-wsd-decay-iters between 1 and the decay length");
  if (!(c.start_wd >= 0.0) || !(c.end_wd >= c.start_wd)) return fail("weight decay must satisfy 0 <= start <= end");
  if (c.wd_increment_style == WdIncrementStyle::kConstant && c.start_wd != c.end_wd)
    return fail("a constant weight decay needs equal start and end values");
  if (c.wd_increment_style != WdIncrementStyle::kConstant && c.wd_increment_steps <= 0)
    return fail("the weight-decay increment must last at least one step");
  return LrSchedule(c);
}

double LrSchedule::lr() const { return lr_between(config_.max_lr, config_.min_lr); }

double LrSchedule::decoupled_lr() const {
  if (!config_.decoupled_max_lr) return lr();
  return lr_between(*config_.decoupled_max_lr, config_.decoupled_min_lr.value_or(config_.min_lr));
}

// OptimizerParamScheduler.get_lr for a parameter group of these bounds (the warmup starts at init_lr for every group).
double LrSchedule::lr_between(double max_lr, double min_lr) const {
  const auto& c = config_;
  const double steps = static_cast<double>(steps_);
  if (c.warmup_steps > 0 && steps <= c.warmup_steps) return c.init_lr + (max_lr - c.init_lr) * steps / c.warmup_steps;
  if (c.decay_style == LrDecayStyle::kConstant) return max_lr;
  if (steps_ > c.decay_steps) return min_lr;
  if (c.decay_style == LrDecayStyle::kInverseSquareRoot) {
    const double warmup = std::max(c.warmup_steps, 1.0);
    return std::max(min_lr, max_lr * std::sqrt(warmup) / std::sqrt(std::max(steps, 1.0)));
  }
  const double ratio = (steps - c.warmup_steps) / (static_cast<double>(c.decay_steps) - c.warmup_steps);
  double coeff = 1.0;
  switch (c.decay_style) {
    case LrDecayStyle::kLinear:
      coeff = 1.0 - ratio;
      break;
    case LrDecayStyle::kCosine:
      coeff = 0.5 * (std::cos(std::numbers::pi * ratio) + 1.0);
      break;
    case LrDecayStyle::kWsd: {
      const std::int64_t anneal_start = c.decay_steps - c.wsd_decay_steps;
      if (steps_ <= anneal_start) break;
      const double r = static_cast<double>(steps_ - anneal_start) / static_cast<double>(c.wsd_decay_steps);
      switch (c.wsd_decay_style) {
        case WsdDecayStyle::kLinear:
          coeff = 1.0 - r;
          break;
        case WsdDecayStyle::kCosine:
          coeff = 0.5 * (std::cos(std::numbers::pi * r) + 1.0);
          break;
        case WsdDecayStyle::kExponential:
          coeff = 2.0 * std::pow(0.5, r) - 1.0;
          break;
        case WsdDecayStyle::kMinusSqrt:
          coeff = 1.0 - std::sqrt(r);
          break;
      }
      break;
    }
    case LrDecayStyle::kConstant:
    case LrDecayStyle::kInverseSquareRoot:
      break;
  }
  return min_lr + coeff * (max_lr - min_lr);
}

double LrSchedule::weight_decay() const {
  const auto& c = config_;
  if (steps_ > c.wd_increment_steps || c.wd_increment_style == WdIncrementStyle::kConstant) return c.end_wd;
  const double ratio = static_cast<double>(steps_) / static_cast<double>(c.wd_increment_steps);
  const double coeff = c.wd_increment_style == WdIncrementStyle::kLinear
                           ? ratio
                           : 0.5 * (std::cos(std::numbers::pi * (1 - ratio)) + 1.0);
  return c.start_wd + coeff * (c.end_wd - c.start_wd);
}

nlohmann::json LrSchedule::state() const {
  // Whole, as Megatron's own (an int) unless a warmup fraction made it a float.
  nlohmann::json warmup_steps = config_.warmup_steps;
  if (config_.warmup_steps == std::floor(config_.warmup_steps) && config_.warmup_steps < 9e15)
    warmup_steps = static_cast<std::int64_t>(config_.warmup_steps);
  return {{"num_steps", steps_},
          {"max_lr", config_.max_lr},
          {"min_lr", config_.min_lr},
          {"lr_warmup_steps", warmup_steps},
          {"lr_decay_steps", config_.decay_steps},
          {"lr_decay_style", name_of(config_.decay_style, kLrDecayStyles)},
          {"start_wd", config_.start_wd},
          {"end_wd", config_.end_wd},
          {"wd_incr_steps", config_.wd_increment_steps},
          {"wd_incr_style", name_of(config_.wd_increment_style, kWdIncrementStyles)}};
}

namespace {

// The first of `keys` the state holds (Megatron renamed several over time), or null.
const nlohmann::json* saved_value(const nlohmann::json& state, std::initializer_list<const char*> keys) {
  for (const char* key : keys)
    if (state.contains(key)) return &state[key];
  return nullptr;
}

}  // namespace

Result<std::string> LrSchedule::restore(const nlohmann::json& state, Saved choice) {
  const nlohmann::json* steps = state.is_object() ? saved_value(state, {"num_steps", "num_iters"}) : nullptr;
  if (!steps || !steps->is_number_integer() || steps->get<std::int64_t>() < 0)
    return Status::Error("learning-rate schedule state: 'num_steps' must be a non-negative integer");
  LrScheduleConfig adopted = config_;
  std::string mismatches;
  // Megatron's _check_and_set for each value: a difference is noted, and this run's value or the checkpoint's kept.
  auto check = [&](std::initializer_list<const char*> keys, const char* what, auto& ours, auto parse) -> Status {
    const nlohmann::json* saved = saved_value(state, keys);
    if (!saved) return OkStatus();
    auto theirs = parse(*saved);
    if (!theirs.ok())
      return Status::Error("learning-rate schedule state: " + std::string(*keys.begin()) + ": " +
                           theirs.status().message());
    if (*theirs == ours) return OkStatus();
    auto text = [](const auto& v) {
      if constexpr (std::is_same_v<std::decay_t<decltype(v)>, double>) return shown(v);
      else if constexpr (std::is_integral_v<std::decay_t<decltype(v)>>) return std::to_string(v);
      else return std::string(v);
    };
    mismatches += std::string(mismatches.empty() ? "" : "; ") + what + " " + text(ours) + " here, " + text(*theirs) +
                  " in the checkpoint";
    if (choice == Saved::kUseCheckpoint) ours = *theirs;
    return OkStatus();
  };
  auto number = [](const nlohmann::json& j) -> Result<double> {
    if (!j.is_number()) return Status::Error("not a number");
    return j.get<double>();
  };
  auto count = [](const nlohmann::json& j) -> Result<std::int64_t> {
    if (!j.is_number_integer()) return Status::Error("not an integer");
    return j.get<std::int64_t>();
  };
  // A style's name, one `parse_style` knows.
  auto style = [](auto parse_style) {
    return [parse_style](const nlohmann::json& j) -> Result<std::string> {
      if (!j.is_string()) return Status::Error("not a string");
      TRESTLE_RETURN_IF_ERROR(parse_style(j.get<std::string>()).status());
      return j.get<std::string>();
    };
  };
  const auto lr_style = style(parse_lr_decay_style);
  const auto wd_style = style(parse_wd_increment_style);
  std::string decay_style = name_of(adopted.decay_style, kLrDecayStyles);
  std::string wd_incr_style = name_of(adopted.wd_increment_style, kWdIncrementStyles);
  TRESTLE_RETURN_IF_ERROR(check({"max_lr", "start_lr"}, "learning rate", adopted.max_lr, number));
  TRESTLE_RETURN_IF_ERROR(check({"min_lr"}, "minimum learning rate", adopted.min_lr, number));
  TRESTLE_RETURN_IF_ERROR(check({"lr_warmup_steps", "warmup_steps", "warmup_iter"}, "warmup steps (samples)",
                                adopted.warmup_steps, number));
  TRESTLE_RETURN_IF_ERROR(
      check({"lr_decay_steps", "decay_steps", "end_iter"}, "decay steps (samples)", adopted.decay_steps, count));
  TRESTLE_RETURN_IF_ERROR(check({"lr_decay_style", "decay_style"}, "decay style", decay_style, lr_style));
  TRESTLE_RETURN_IF_ERROR(check({"start_wd"}, "start weight decay", adopted.start_wd, number));
  TRESTLE_RETURN_IF_ERROR(check({"end_wd"}, "end weight decay", adopted.end_wd, number));
  TRESTLE_RETURN_IF_ERROR(check({"wd_incr_steps"}, "weight-decay increment steps", adopted.wd_increment_steps, count));
  TRESTLE_RETURN_IF_ERROR(check({"wd_incr_style"}, "weight-decay increment style", wd_incr_style, wd_style));
  adopted.decay_style = *parse_lr_decay_style(decay_style);
  adopted.wd_increment_style = *parse_wd_increment_style(wd_incr_style);
  TRESTLE_RETURN_IF_ERROR(create(adopted).status());  // the checkpoint's values must make sense
  config_ = adopted;
  steps_ = steps->get<std::int64_t>();
  return mismatches;
}

}  // namespace trestle
