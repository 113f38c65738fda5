#include "train/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace trestle {

Result<LossScaler> LossScaler::create(const LossScalerConfig& config) {
  if (!(config.initial_scale > 0) || !std::isfinite(config.initial_scale))
    return Status::Error("the loss scale must be positive and finite (got " + std::to_string(config.initial_scale) +
                         ")");
  if (!config.dynamic) return LossScaler(config);
  if (!(config.min_scale > 0) || !std::isfinite(config.min_scale))
    return Status::Error("--min-loss-scale must be positive and finite (got " + std::to_string(config.min_scale) + ")");
  if (config.growth_interval < 1)
    return Status::Error("--loss-scale-window must be at least 1 (got " + std::to_string(config.growth_interval) + ")");
  if (config.hysteresis < 1)
    return Status::Error("--hysteresis must be at least 1 (got " + std::to_string(config.hysteresis) + ")");
  return LossScaler(config);
}

void LossScaler::update(bool found_inf) {
  if (!config_.dynamic) return;
  if (found_inf) {
    growth_tracker_ = 0;
    if (--hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * 0.5, config_.min_scale);
    return;
  }
  if (++growth_tracker_ == config_.growth_interval) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = config_.hysteresis;
    scale_ *= 2.0;
  }
}

nlohmann::json LossScaler::state() const {
  return {{"scale", scale_}, {"growth_tracker", growth_tracker_}, {"hysteresis_tracker", hysteresis_tracker_}};
}

Status LossScaler::restore(const nlohmann::json& state) {
  try {
    scale_ = state.at("scale").get<double>();
    growth_tracker_ = state.at("growth_tracker").get<std::int64_t>();
    hysteresis_tracker_ = state.at("hysteresis_tracker").get<std::int64_t>();
  } catch (const nlohmann::json::exception& e) {
    return Status::Error(std::string("loss scaler state: ") + e.what());
  }
  if (!config_.dynamic) scale_ = config_.initial_scale;
  return OkStatus();
}

}  // namespace trestle
