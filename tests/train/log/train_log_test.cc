// The trainer's reports: CRC-32C against its check value, Megatron's console line, the JSON line; the event files are
// read back by TensorBoard itself in tests/interop/test_tensorboard_events.py.
#include "train/log/train_log.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace trestle {
namespace {

TEST(TensorBoardTest, Crc32cCheckValue) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32c(text.data(), text.size()), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
}

IterationReport report() {
  IterationReport r;
  r.iteration = 10;
  r.train_iters = 100;
  r.consumed_samples = 320;
  r.seconds_per_iteration = 0.12345;
  r.learning_rate = 3e-4;
  r.global_batch_size = 32;
  r.lm_loss = 10.5;
  r.grad_norm = 1.25;
  r.tokens_per_second = 65536;
  return r;
}

TEST(TrainLogTest, MegatronLine) {
  EXPECT_EQ(megatron_log_line(report(), "2026-11-23 21:00:00"),
            " [2026-11-23 21:00:00] iteration       10/     100 | consumed samples:          320 | elapsed time per "
            "iteration (ms): 123.5 | learning rate: 3.000000E-04 | global batch size:    32 | lm loss: 1.050000E+01 | "
            "loss scale: 1.0 | grad norm: 1.250 | number of skipped iterations:   0 | number of nan iterations:   0 | "
            "tokens per second: 65536.0 |");
  // --log-throughput: after the elapsed time, as Megatron's.
  IterationReport measured = report();
  measured.throughput_tflops = 123.456;
  EXPECT_NE(megatron_log_line(measured, "t")
                .find("(ms): 123.5 | throughput per GPU (TFLOP/s/GPU): 123.5 | learning "
                      "rate:"),
            std::string::npos);
  // --log-num-zeros-in-grad and --log-params-norm: after the gradient norm, in Megatron's order and format.
  IterationReport with_norms = report();
  with_norms.num_zeros_in_grad = 12;
  with_norms.params_norm = 3.14159;
  // (the count as the integer Megatron-LM prints)
  EXPECT_NE(megatron_log_line(with_norms, "t").find(" grad norm: 1.250 | num zeros: 12 | params norm: 3.142 |"),
            std::string::npos);
  const auto j = nlohmann::json::parse(json_log_line(with_norms));
  EXPECT_EQ(j["num_zeros"], 12);
  EXPECT_DOUBLE_EQ(j["params_norm"].get<double>(), 3.14159);
}

// MoE: the router losses after the lm loss and before the MTP losses, in the report's order, as Megatron's
// total_loss_dict holds them; one that averages 0 (a type whose coefficient is 0) is not printed, and the losses
// are printed even in an interval of skipped steps only (Megatron adds them whether the step was skipped or not).
TEST(TrainLogTest, RouterLossesAfterTheLmLoss) {
  IterationReport r = report();
  r.router_losses = {{"z_loss", 2.5}, {"load_balancing_loss", 1.0625}, {"seq_load_balancing_loss", 0.0}};
  r.mtp_losses = {9.0};
  EXPECT_NE(megatron_log_line(r, "t").find(" lm loss: 1.050000E+01 | z_loss: 2.500000E+00 | load_balancing_loss: "
                                           "1.062500E+00 | mtp_1 loss: 9.000000E+00 | loss scale:"),
            std::string::npos)
      << megatron_log_line(r, "t");
  const auto j = nlohmann::json::parse(json_log_line(r));
  EXPECT_DOUBLE_EQ(j["load_balancing_loss"].get<double>(), 1.0625);
  EXPECT_FALSE(j.contains("seq_load_balancing_loss"));
  r.advanced_iterations = 0;
  EXPECT_NE(megatron_log_line(r, "t").find("global batch size:    32 | z_loss: 2.500000E+00 | load_balancing_loss:"),
            std::string::npos)
      << megatron_log_line(r, "t");
}

// An interval whose steps were all skipped (fp16 overflow) prints no loss before the run's first stepped iteration and
// 0 after it, as Megatron's total_loss_dict does (the key kept, its sum reset to 0 at each line).
TEST(TrainLogTest, AnIntervalOfSkippedStepsPrintsZeroOnceALossWasLogged) {
  IterationReport r = report();
  r.mtp_losses = {9.0};
  r.advanced_iterations = 0;
  EXPECT_EQ(megatron_log_line(r, "t").find("lm loss"), std::string::npos) << megatron_log_line(r, "t");
  r.loss_tracked = true;
  EXPECT_NE(megatron_log_line(r, "t").find(" lm loss: 0.000000E+00 | mtp_1 loss: 0.000000E+00 | loss scale:"),
            std::string::npos)
      << megatron_log_line(r, "t");
  EXPECT_FALSE(nlohmann::json::parse(json_log_line(r)).contains("lm_loss"));
}

TEST(TrainLogTest, JsonLine) {
  const auto j = nlohmann::json::parse(json_log_line(report()));
  EXPECT_EQ(j["iteration"], 10);
  EXPECT_EQ(j["consumed_samples"], 320);
  EXPECT_DOUBLE_EQ(j["lm_loss"].get<double>(), 10.5);
  EXPECT_DOUBLE_EQ(j["grad_norm"].get<double>(), 1.25);
  EXPECT_FALSE(j.contains("mfu"));
}

}  // namespace
}  // namespace trestle
