// Test-only: pipeline schedules for the comparison with megatron-core
// (tests/interop/test_pipeline_schedule_megatron.py).
// Reads lines "PP CHUNKS MICROBATCHES GROUP FORWARD_ONLY" on stdin and prints, per line, one JSON object: the schedule
// table, and per stage the counts and the steps ("F3c1", ...), or {"error": ...} for a configuration refused.
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "parallel/pipeline_schedule.h"

int main() {
  using namespace trestle::parallel;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    PipelineScheduleConfig c;
    int forward_only = 0;
    in >> c.pp >> c.chunks >> c.microbatches >> c.microbatch_group >> forward_only;
    c.forward_only = forward_only != 0;
    nlohmann::json out;
    if (const auto checked = check_pipeline_schedule_config(c); !checked.ok()) {
      out["error"] = checked.message();
    } else {
      out["table"] = pipeline_schedule_table(c);
      out["deadlock_free"] = check_pipeline_schedules(c).ok();
      for (int rank = 0; rank < c.pp; ++rank) {
        const auto n = pipeline_counts(c, rank);
        nlohmann::json steps = nlohmann::json::array();
        for (const auto& s : pipeline_schedule(c, rank)) steps.push_back(to_string(s));
        out["stages"].push_back({{"total", n.total}, {"warmup", n.warmup}, {"remaining", n.remaining},
                                 {"all_in_warmup", n.all_in_warmup}, {"steps", steps}});
      }
    }
    std::cout << out.dump() << "\n";
  }
  return 0;
}
