#include "parallel/pipeline_schedule.h"

#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace trestle::parallel {
namespace {

PipelineScheduleConfig config(int pp, int chunks, int microbatches, int group = 0) {
  PipelineScheduleConfig c;
  c.pp = pp;
  c.chunks = chunks;
  c.microbatches = microbatches;
  c.microbatch_group = group;
  return c;
}

TEST(PipelineSchedule, OneFOneBWarmupIsStagesAfterThisOne) {
  const auto c = config(4, 1, 8);
  for (int rank = 0; rank < 4; ++rank) {
    const auto n = pipeline_counts(c, rank);
    EXPECT_EQ(n.total, 8);
    EXPECT_EQ(n.warmup, 4 - rank - 1);
    EXPECT_EQ(n.remaining, 8 - (4 - rank - 1));
  }
  // the last stage alternates from the start; the first runs three forwards first
  const auto last = pipeline_schedule(c, 3);
  EXPECT_EQ(to_string(last[0]), "F0c0");
  EXPECT_EQ(to_string(last[1]), "B0c0");
  const auto first = pipeline_schedule(c, 0);
  std::string head;
  for (int i = 0; i < 6; ++i) head += to_string(first[i]) + " ";
  EXPECT_EQ(head, "F0c0 F1c0 F2c0 F3c0 B0c0 F4c0 ");
  EXPECT_EQ(to_string(first.back()), "B7c0");
}

TEST(PipelineSchedule, FewerMicrobatchesThanStagesAreAllWarmup) {
  const auto n = pipeline_counts(config(4, 1, 2), 0);
  EXPECT_TRUE(n.all_in_warmup);
  EXPECT_EQ(n.warmup, 2);
  EXPECT_EQ(n.remaining, 0);
  EXPECT_TRUE(check_pipeline_schedules(config(4, 1, 2)).ok());
}

TEST(PipelineSchedule, InterleavedTableGroupsMicrobatches) {
  // Megatron's example: PP2, 5 microbatches in groups of 3, 2 chunks
  const auto table = pipeline_schedule_table(config(2, 2, 5, 3));
  std::string mbs, chunks;
  for (const auto& [mb, chunk] : table) {
    mbs += std::to_string(mb);
    chunks += std::to_string(chunk);
  }
  EXPECT_EQ(mbs, "0120123434");
  EXPECT_EQ(chunks, "0001110011");
  // warmup: (pp - rank - 1) * 2 + (chunks - 1) * group
  EXPECT_EQ(pipeline_counts(config(2, 2, 5, 3), 0).warmup, 2 + 3);
  EXPECT_EQ(pipeline_counts(config(2, 2, 5, 3), 1).warmup, 0 + 3);
}

TEST(PipelineSchedule, InterleavedBackwardsRunChunksInReverse) {
  const auto steps = pipeline_schedule(config(2, 2, 4), 1);
  // first backward on the last stage is micro-batch 0 of the last chunk
  for (const auto& s : steps)
    if (!s.forward) {
      EXPECT_EQ(to_string(s), "B0c1");
      break;
    }
}

TEST(PipelineSchedule, NoConfigurationOfTheGridDeadlocks) {
  int checked = 0;
  for (int pp = 1; pp <= 8; ++pp)
    for (int chunks = 1; chunks <= 4; ++chunks)
      for (int mbs = 1; mbs <= 24; ++mbs)
        for (int group = 0; group <= mbs; ++group) {
          auto c = config(pp, chunks, mbs, group);
          if (!check_pipeline_schedule_config(c).ok()) continue;
          for (bool forward_only : {false, true}) {
            c.forward_only = forward_only;
            const Status s = check_pipeline_schedules(c);
            ASSERT_TRUE(s.ok()) << s.message();
            ++checked;
          }
        }
  EXPECT_GT(checked, 1000);
}

TEST(PipelineSchedule, ADeadlockingOrderIsFound) {
  // the checker itself: stage 1 waits for micro-batch 1's forward before micro-batch 0's backward, which stage 0
  // needs before it sends micro-batch 1
  const auto c = config(2, 1, 2);
  using S = PipelineStep;
  const std::vector<std::vector<S>> orders = {{S{true, 0, 0}, S{false, 0, 0}, S{true, 1, 0}, S{false, 1, 0}},
                                              {S{true, 0, 0}, S{true, 1, 0}, S{false, 0, 0}, S{false, 1, 0}}};
  EXPECT_TRUE(fails_with(check_pipeline_orders(c, orders), "deadlocks: stage 0 at B0c0, stage 1 at F1c0"));
  // a repeated step is caught too
  EXPECT_TRUE(
      fails_with(check_pipeline_orders(c, {{S{true, 0, 0}, S{true, 0, 0}}, orders[1]}), "stage 0 runs F0c0 twice"));
  // invalid configurations are refused before any schedule is made
  EXPECT_TRUE(fails_with(check_pipeline_schedules(config(2, 2, 3)),
                         "3 microbatches in groups of 2 leave a last group of 1, fewer than pp (2)"));
  EXPECT_TRUE(fails_with(check_pipeline_schedules(config(1, 2, 4)), "virtual pipeline chunks need pp > 1"));
  EXPECT_TRUE(fails_with(check_pipeline_schedules(config(4, 2, 8, 2)),
                         "the microbatch group per virtual stage (2) must be between pp (4) and the microbatches (8)"));
}

}  // namespace
}  // namespace trestle::parallel
