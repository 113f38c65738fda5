// device_time_by_launcher: kernels named by the operators around their launches, on the thread that launched them.
#include "train/loop/launch_attribution.h"

#include <gtest/gtest.h>

#include <vector>

namespace trestle::train {
namespace {

using Kind = TimedEvent::Kind;

TimedEvent op(const char* name, std::uint64_t thread, std::uint64_t start, std::uint64_t end) {
  return {Kind::kOperator, name, thread, start, end, 0, ""};
}
TimedEvent launch(std::uint64_t thread, std::uint64_t at, std::uint64_t correlation) {
  return {Kind::kLaunch, "cudaLaunchKernel", thread, at, at + 1, correlation, ""};
}
TimedEvent kernel(const char* name, std::uint64_t start_ns, std::uint64_t end_ns, std::uint64_t correlation) {
  return {Kind::kDevice, name, 0, start_ns, end_ns, correlation, ""};
}

TEST(LaunchAttribution, NamesTheOutermostAndInnermostOperatorAroundEachLaunch) {
  // Thread 1: the forward's reshape copies; thread 2: the backward's node, with a linear inside.
  const std::vector<TimedEvent> events = {op("aten::reshape", 1, 100, 200),
                                          op("aten::clone", 1, 110, 190),
                                          op("aten::copy_", 1, 120, 180),
                                          launch(1, 150, 7),
                                          op("aten::add", 1, 300, 320),
                                          launch(1, 310, 8),
                                          launch(1, 400, 9),  // between operators
                                          op("autograd::engine::evaluate_function: MmBackward0", 2, 100, 500),
                                          op("aten::mm", 2, 150, 250),
                                          launch(2, 200, 7000),
                                          op("aten::mm", 2, 260, 400),
                                          launch(2, 300, 7001),
                                          launch(2, 450, 7002),  // inside the node, after its two mm
                                          kernel("copy_kernel", 1000, 4000000, 7),
                                          kernel("add_kernel", 1000, 2000000, 8),
                                          kernel("gemm", 0, 5000000, 7000),
                                          kernel("gemm", 0, 5000000, 7001),
                                          kernel("fill", 0, 1000000, 7002),
                                          kernel("memset", 0, 500000, 9),
                                          kernel("orphan", 0, 250000, 12345)};
  const auto rows = rank_by_total(device_time_by_launcher(events), 10);
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(rows[0].name, "autograd::engine::evaluate_function: MmBackward0 > aten::mm");
  EXPECT_EQ(rows[0].calls, 2);
  EXPECT_DOUBLE_EQ(rows[0].total_ms, 10.0);
  EXPECT_EQ(rows[1].name, "aten::reshape > aten::copy_");
  EXPECT_NEAR(rows[1].total_ms, 3.999, 1e-9);
  EXPECT_EQ(rows[2].name, "aten::add");  // one operator: its name once
  EXPECT_EQ(rows[3].name, "autograd::engine::evaluate_function: MmBackward0");
  EXPECT_EQ(rows[4].name, "(no operator)");
  EXPECT_EQ(rows[5].name, "(launch not recorded)");
  EXPECT_EQ(device_time_by_launcher(events).size(), 7u);  // one row per device event
}

// Operators that start together nest by length; a launch on another thread is not named by this one's operators.
TEST(LaunchAttribution, SameStartNestsTheLongerOutsideAndThreadsStayApart) {
  const std::vector<TimedEvent> events = {op("inner", 1, 100, 150), op("outer", 1, 100, 300), launch(1, 120, 1),
                                          launch(2, 120, 2),        kernel("k", 0, 1000, 1),  kernel("k", 0, 1000, 2)};
  const auto rows = rank_by_total(device_time_by_launcher(events), 10);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].name, "(no operator)");
  EXPECT_EQ(rows[1].name, "outer > inner");
}

// With the inputs recorded (--pytorch-profiler-collect-shapes), a row names the innermost operator's inputs too, so
// the same copy of two sizes makes two rows.
TEST(LaunchAttribution, NamesTheInnermostOperatorsInputsWhereRecorded) {
  TimedEvent outer = op("aten::to", 1, 100, 400), big = op("aten::copy_", 1, 110, 200),
             small = op("aten::copy_", 1, 210, 300), alone = op("aten::add", 1, 500, 600);
  big.inputs = " (8192x2048 BFloat16, 8192x2048 Float)";
  small.inputs = " (2048 BFloat16, 2048 Float)";
  alone.inputs = " (4 Float, () Float)";
  const std::vector<TimedEvent> events = {outer,
                                          big,
                                          small,
                                          alone,
                                          launch(1, 150, 1),
                                          launch(1, 250, 2),
                                          launch(1, 550, 3),
                                          kernel("copy", 0, 3000000, 1),
                                          kernel("copy", 0, 2000000, 2),
                                          kernel("add", 0, 1000000, 3)};
  const auto rows = rank_by_total(device_time_by_launcher(events), 10);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].name, "aten::to > aten::copy_ (8192x2048 BFloat16, 8192x2048 Float)");
  EXPECT_EQ(rows[1].name, "aten::to > aten::copy_ (2048 BFloat16, 2048 Float)");
  EXPECT_EQ(rows[2].name, "aten::add (4 Float, () Float)");
}

TEST(DescribeInputs, ShapesAndDtypesOfTheTensorInputsOnly) {
  EXPECT_EQ(describe_inputs({{8192, 2048}, {2048}, {}, {}, {}, {3}, {7}},
                            {"c10::BFloat16", "float", "float", "Scalar", "", "TensorList", "long int"}),
            " (8192x2048 BFloat16, 2048 Float, () Float, 7 Long)");
  EXPECT_EQ(describe_inputs({{}, {}}, {"Scalar", ""}), "");
  EXPECT_EQ(describe_inputs({}, {}), "");
  EXPECT_EQ(describe_inputs({{0, 5}, {2}}, {"bool", "c10::Half"}), " (0x5 Bool, 2 Half)");
}

}  // namespace
}  // namespace trestle::train
