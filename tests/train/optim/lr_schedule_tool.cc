// Test entry point: prints the learning rate and weight decay of a schedule after each of `steps` increments of
// `increment` samples, as JSON lines [lr, wd, decoupled lr], then the schedule's state() on a line of its own, for the
// interop test against megatron-core's OptimizerParamScheduler. WARMUP may be fractional; DECOUPLED_MAX and
// DECOUPLED_MIN (optional, "-" for none) are --decoupled-lr and --decoupled-min-lr.
// usage: lr_schedule_tool STYLE INIT MAX MIN WARMUP DECAY WSD_STEPS WSD_STYLE START_WD END_WD WD_STEPS WD_STYLE
// INCREMENT STEPS [DECOUPLED_MAX DECOUPLED_MIN]
#include <cstdio>
#include <cstdlib>
#include <string>

#include "train/optim/lr_schedule.h"

int main(int argc, char** argv) {
  if (argc != 15 && argc != 17) {
    std::fprintf(stderr,
                 "usage: %s STYLE INIT MAX MIN WARMUP DECAY WSD_STEPS WSD_STYLE START_WD END_WD WD_STEPS "
                 "WD_STYLE INCREMENT STEPS [DECOUPLED_MAX DECOUPLED_MIN]\n",
                 argv[0]);
    return 2;
  }
  trestle::LrScheduleConfig c;
  auto style = trestle::parse_lr_decay_style(argv[1]);
  auto wsd = trestle::parse_wsd_decay_style(argv[8]);
  auto wd = trestle::parse_wd_increment_style(argv[12]);
  if (!style.ok() || !wsd.ok() || !wd.ok()) return 2;
  c.decay_style = *style;
  c.init_lr = std::atof(argv[2]);
  c.max_lr = std::atof(argv[3]);
  c.min_lr = std::atof(argv[4]);
  c.warmup_steps = std::atof(argv[5]);
  c.decay_steps = std::atoll(argv[6]);
  c.wsd_decay_steps = std::atoll(argv[7]);
  c.wsd_decay_style = *wsd;
  c.start_wd = std::atof(argv[9]);
  c.end_wd = std::atof(argv[10]);
  c.wd_increment_steps = std::atoll(argv[11]);
  c.wd_increment_style = *wd;
  if (argc == 17) {
    if (std::string(argv[15]) != "-") c.decoupled_max_lr = std::atof(argv[15]);
    if (std::string(argv[16]) != "-") c.decoupled_min_lr = std::atof(argv[16]);
  }
  auto schedule = trestle::LrSchedule::create(c);
  if (!schedule.ok()) {
    std::fprintf(stderr, "%s\n", schedule.status().message().c_str());
    return 1;
  }
  const long long increment = std::atoll(argv[13]), steps = std::atoll(argv[14]);
  for (long long i = 0; i <= steps; ++i) {
    std::printf("[%.17g, %.17g, %.17g]\n", schedule->lr(), schedule->weight_decay(), schedule->decoupled_lr());
    schedule->step(increment);
  }
  std::printf("%s\n", schedule->state().dump().c_str());
  return 0;
}
