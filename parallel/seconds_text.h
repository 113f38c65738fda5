// A duration as messages say it: "600 s", "0.2 s".
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace trestle::parallel {

inline std::string seconds_text(std::chrono::milliseconds duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", static_cast<double>(duration.count()) / 1000.0);
  return text;
}

}  // namespace trestle::parallel
