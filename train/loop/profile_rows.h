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

// An operator's inputs as the profiler records them with --pytorch-profiler-collect-shapes (a shape and a C++ type
// name each: "float", "c10::BFloat16"), for a row's name with ATen's dtype names: " (8192x2048 BFloat16, 2048 Float,
// () Float)", "()" a 0-dim tensor; the inputs that are no tensor (a type that is empty, "Scalar" or a list's) are left
// out, and so is the whole when none is left.
std::string describe_inputs(const std::vector<std::vector<std::int64_t>>& shapes,
                            const std::vector<std::string>& dtypes);

}  // namespace trestle::train
