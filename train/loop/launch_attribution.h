// GPU time named by what launched it. A profile's device events (kernels, copies, memsets) are each matched to the
// runtime call with the same correlation id and named by the outermost and the innermost operator around that call
// on its thread ("aten::reshape > aten::copy_"), so that a copy kernel says which operation made it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/loop/profile_rows.h"

namespace trestle::train {

struct TimedEvent {
  enum class Kind { kOperator, kLaunch, kDevice };
  Kind kind = Kind::kOperator;
  std::string name;
  std::uint64_t thread = 0;  // operators and launches: the thread they ran on
  std::uint64_t start_ns = 0, end_ns = 0;
  std::uint64_t correlation = 0;  // launches and device events: the id that pairs them
  std::string inputs;             // operators: describe_inputs of their inputs where shapes were recorded, else empty
};

// One row per device event, named by its launcher: "outermost > innermost" (one name when they are the same
// operator), the innermost's inputs after it, "(no operator)" for a launch outside any, "(launch not recorded)" when
// its launch is missing.
std::vector<ProfileRow> device_time_by_launcher(const std::vector<TimedEvent>& events);

}  // namespace trestle::train
