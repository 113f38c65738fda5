// Loss scaling for fp16 training, as Megatron-Core's grad scalers do it: the loss is multiplied by the scale before
// backward and the gradients divided by it after; an iteration whose gradients hold an inf or NaN is skipped. The
// dynamic scaler halves the scale after `hysteresis` such iterations (not below min_scale) and doubles it after
// `growth_interval` clean ones in a row; a constant scale (--loss-scale) never changes. Its state is JSON.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

#include "ckpt/status.h"

namespace trestle {

struct LossScalerConfig {
  bool dynamic = true;
  double initial_scale = 4294967296.0;  // --initial-loss-scale (2^32), or the constant --loss-scale
  double min_scale = 1.0;               // --min-loss-scale
  std::int64_t growth_interval = 1000;  // --loss-scale-window
  std::int64_t hysteresis = 2;          // --hysteresis
};

class LossScaler {
 public:
  static Result<LossScaler> create(const LossScalerConfig& config);

  double scale() const { return scale_; }
  // After each iteration: whether its gradients held an inf or NaN (on any rank).
  void update(bool found_inf);

  nlohmann::json state() const;  // {"scale", "growth_tracker", "hysteresis_tracker"}
  Status restore(const nlohmann::json& state);

 private:
  explicit LossScaler(const LossScalerConfig& config)
      : config_(config), scale_(config.initial_scale), hysteresis_tracker_(config.hysteresis) {}
  LossScalerConfig config_;
  double scale_;
  std::int64_t growth_tracker_ = 0;
  std::int64_t hysteresis_tracker_;
};

}  // namespace trestle
