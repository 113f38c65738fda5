// The learning-rate schedule's checks and its state round trip; its values are checked against megatron-core in
// tests/interop/test_lr_schedule_megatron.py.
#include "train/optim/lr_schedule.h"

#include <gtest/gtest.h>

namespace trestle {
namespace {

LrScheduleConfig cosine() {
  LrScheduleConfig c;
  c.max_lr = 3e-4;
  c.min_lr = 3e-5;
  c.warmup_steps = 10;
  c.decay_steps = 100;
  c.decay_style = LrDecayStyle::kCosine;
  return c;
}

TEST(LrScheduleTest, WarmupStartsAtInitAndDecayEndsAtMin) {
  auto s = LrSchedule::create(cosine());
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->lr(), 0.0);  // Megatron trains its first iteration at lr 0 under warmup from 0
  s->step(5);
  EXPECT_DOUBLE_EQ(s->lr(), 1.5e-4);
  s->step(5);
  EXPECT_DOUBLE_EQ(s->lr(), 3e-4);
  s->step(90);
  EXPECT_NEAR(s->lr(), 3e-5, 1e-18);
  s->step(1);
  EXPECT_EQ(s->lr(), 3e-5);
}

TEST(LrScheduleTest, StateRoundTrip) {
  auto s = LrSchedule::create(cosine());
  ASSERT_TRUE(s.ok());
  s->step(42);
  auto t = LrSchedule::create(cosine());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(t->restore(s->state()).ok());
  EXPECT_EQ(t->steps(), 42);
  EXPECT_EQ(t->lr(), s->lr());
  EXPECT_FALSE(t->restore(nlohmann::json{{"num_steps", -1}}).ok());
  EXPECT_FALSE(t->restore(nlohmann::json::array()).ok());
}

TEST(LrScheduleTest, RefusesWhatMegatronRefuses) {
  for (auto edit : std::initializer_list<void (*)(LrScheduleConfig&)>{
           [](LrScheduleConfig& c) { c.min_lr = -1; }, [](LrScheduleConfig& c) { c.min_lr = 1; },
           [](LrScheduleConfig& c) { c.init_lr = 1; }, [](LrScheduleConfig& c) { c.warmup_steps = 100; },
           [](LrScheduleConfig& c) { c.decay_steps = 0; }, [](LrScheduleConfig& c) { c.end_wd = 0.5; },
           [](LrScheduleConfig& c) { c.decay_style = LrDecayStyle::kWsd; }}) {
    LrScheduleConfig c = cosine();
    edit(c);
    EXPECT_FALSE(LrSchedule::create(c).ok());
  }
  EXPECT_FALSE(parse_lr_decay_style("cosinus").ok());
  EXPECT_EQ(*parse_lr_decay_style("inverse-square-root"), LrDecayStyle::kInverseSquareRoot);
}

}  // namespace
}  // namespace trestle
