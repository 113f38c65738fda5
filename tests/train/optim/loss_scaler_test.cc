// The fp16 loss scaler's rules (Megatron-Core's DynamicGradScaler and ConstantGradScaler): halving after `hysteresis`
// overflowing iterations in a row (not below the floor), doubling after `growth_interval` clean ones, the state's
// JSON round trip, and the constant scale.
#include "train/optim/loss_scaler.h"

#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

TEST(LossScalerTest, DynamicScaleFollowsMegatronsRules) {
  LossScalerConfig config;
  config.initial_scale = 1024;
  config.min_scale = 256;
  config.growth_interval = 3;
  config.hysteresis = 2;
  auto scaler = LossScaler::create(config);
  ASSERT_TRUE(scaler.ok());
  scaler->update(true);  // hysteresis 2 -> 1: unchanged
  EXPECT_EQ(scaler->scale(), 1024);
  scaler->update(true);  // -> 0: halved
  EXPECT_EQ(scaler->scale(), 512);
  scaler->update(true);  // still out of hysteresis: halved again
  EXPECT_EQ(scaler->scale(), 256);
  scaler->update(true);  // the floor
  EXPECT_EQ(scaler->scale(), 256);
  scaler->update(false);
  scaler->update(false);
  EXPECT_EQ(scaler->scale(), 256);
  scaler->update(false);  // three clean: doubled, hysteresis reset
  EXPECT_EQ(scaler->scale(), 512);
  scaler->update(true);
  EXPECT_EQ(scaler->scale(), 512);

  auto copy = LossScaler::create(config);
  ASSERT_TRUE(copy.ok());
  ASSERT_TRUE(copy->restore(scaler->state()).ok());
  EXPECT_EQ(copy->state(), scaler->state());
  copy->update(true);  // the restored hysteresis tracker (1) runs out now
  EXPECT_EQ(copy->scale(), 256);
}

TEST(LossScalerTest, ConstantScaleNeverChanges) {
  LossScalerConfig config;
  config.dynamic = false;
  config.initial_scale = 128;
  auto scaler = LossScaler::create(config);
  ASSERT_TRUE(scaler.ok());
  for (int i = 0; i < 5; ++i) scaler->update(i % 2 == 0);
  EXPECT_EQ(scaler->scale(), 128);
}

TEST(LossScalerTest, RefusesBadSettings) {
  LossScalerConfig config;
  config.initial_scale = 0;
  EXPECT_TRUE(fails_with(LossScaler::create(config), "the loss scale must be positive and finite"));
  config.initial_scale = 8;
  config.hysteresis = 0;
  EXPECT_TRUE(fails_with(LossScaler::create(config), "--hysteresis must be at least 1 (got 0)"));
  config.hysteresis = 2;
  config.growth_interval = 0;
  EXPECT_TRUE(fails_with(LossScaler::create(config), "--loss-scale-window must be at least 1 (got 0)"));
  config.growth_interval = 1000;
  config.min_scale = 0;
  EXPECT_TRUE(fails_with(LossScaler::create(config), "--min-loss-scale must be positive and finite"));
  config.dynamic = false;  // a constant scale needs none of them
  EXPECT_TRUE(LossScaler::create(config).ok());
  LossScalerConfig ok;
  auto scaler = LossScaler::create(ok);
  ASSERT_TRUE(scaler.ok());
  EXPECT_TRUE(fails_with(scaler->restore(nlohmann::json{{"scale", 2.0}}), "key 'growth_tracker' not found"));
}

}  // namespace
}  // namespace trestle
