// The learning-rate schedule's checks and its state round trip; its values are checked against megatron-core in
// tests/interop/test_lr_schedule_megatron.py.
#include "train/optim/lr_schedule.h"

#include <gtest/gtest.h>

#include <utility>

#include "tests/support/status_matchers.h"

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
  EXPECT_TRUE(fails_with(t->restore(nlohmann::json{{"num_steps", -1}}),
                         "learning-rate schedule state: 'num_steps' must be a non-negative integer"));
  EXPECT_TRUE(fails_with(t->restore(nlohmann::json::array()),
                         "learning-rate schedule state: 'num_steps' must be a non-negative integer"));
}

TEST(LrScheduleTest, ADifferentScheduleIsOverriddenOrTakenFromTheCheckpointAndNamed) {
  auto saved = LrSchedule::create(cosine());
  ASSERT_TRUE(saved.ok());
  saved->step(50);
  LrScheduleConfig longer = cosine();
  longer.decay_steps = 200;  // --train-iters raised
  longer.max_lr = 6e-4;
  auto t = LrSchedule::create(longer);
  ASSERT_TRUE(t.ok());
  auto differences = t->restore(saved->state(), LrSchedule::Saved::kOverride);
  ASSERT_TRUE(differences.ok());
  EXPECT_EQ(
      *differences,
      "learning rate 0.00059999999999999995 here, 0.00029999999999999997 in the checkpoint; decay steps (samples) "
      "200 here, 100 in the checkpoint");
  EXPECT_EQ(t->steps(), 50);
  auto expected = LrSchedule::create(longer);
  expected->step(50);
  EXPECT_EQ(t->lr(), expected->lr());
  auto u = LrSchedule::create(longer);
  ASSERT_TRUE(u->restore(saved->state(), LrSchedule::Saved::kUseCheckpoint).ok());
  EXPECT_EQ(u->lr(), saved->lr());
  EXPECT_EQ(u->state(), saved->state());
  // Megatron's older key names are read too.
  nlohmann::json old = {{"num_iters", 50},   {"start_lr", 3e-4}, {"min_lr", 3e-5},
                        {"warmup_iter", 10}, {"end_iter", 100},  {"decay_style", "cosine"}};
  auto v = LrSchedule::create(cosine());
  auto same = v->restore(old);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, "");
  EXPECT_EQ(v->lr(), saved->lr());
  old["decay_style"] = "linear";
  auto linear = v->restore(old, LrSchedule::Saved::kUseCheckpoint);
  ASSERT_TRUE(linear.ok());
  EXPECT_EQ(*linear, "decay style cosine here, linear in the checkpoint");
  EXPECT_EQ(v->state()["lr_decay_style"], "linear");
  old["decay_style"] = "sideways";
  EXPECT_TRUE(fails_with(v->restore(old), "learning-rate schedule state: lr_decay_style: --lr-decay-style 'sideways'"));
}

TEST(LrScheduleTest, RefusesWhatMegatronRefuses) {
  const std::pair<void (*)(LrScheduleConfig&), const char*> refused[] = {
      {[](LrScheduleConfig& c) { c.min_lr = -1; }, "--min-lr must be at least 0"},
      {[](LrScheduleConfig& c) { c.min_lr = 1; }, "--lr must be at least --min-lr"},
      {[](LrScheduleConfig& c) { c.init_lr = 1; }, "--lr-warmup-init must be at most --lr"},
      {[](LrScheduleConfig& c) { c.warmup_steps = 100; }, "warmup (100 steps) must be shorter than the decay (100)"},
      {[](LrScheduleConfig& c) { c.decay_steps = 0; }, "the decay must last at least one step"},
      {[](LrScheduleConfig& c) { c.end_wd = 0.5; }, "a constant weight decay needs equal start and end values"},
      {[](LrScheduleConfig& c) { c.decay_style = LrDecayStyle::kWsd; }, "WSD needs --lr-wsd-decay-iters"}};
  for (const auto& [edit, says] : refused) {
    LrScheduleConfig c = cosine();
    edit(c);
    EXPECT_TRUE(fails_with(LrSchedule::create(c), says));
  }
  EXPECT_TRUE(fails_with(parse_lr_decay_style("cosinus"), "--lr-decay-style 'cosinus' is not one of"));
  EXPECT_EQ(*parse_lr_decay_style("inverse-square-root"), LrDecayStyle::kInverseSquareRoot);
}

}  // namespace
}  // namespace trestle
