// Rows of a profile table: events summed by name (kernel, operator or launcher), the largest totals first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trestle::train {

struct ProfileRow {
  std::string name;
  std::int64_t calls = 0;
  double total_ms = 0;
};

// The rows summed by name, the `top` largest totals first (ties by name).
std::vector<ProfileRow> rank_by_total(const std::vector<ProfileRow>& rows, std::size_t top);

}  // namespace trestle::train
