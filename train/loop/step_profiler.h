// Megatron's --profile --use-pytorch-profiler: PyTorch's profiler (Kineto) records the iterations after
// --profile-step-start up to --profile-step-end on the ranks of --profile-ranks; at the end each such rank writes a
// Chrome trace (open it in Perfetto or chrome://tracing) and prints its GPU kernels (CPU operators on the CPU) by
// total time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::train {

struct ProfileOptions {
  bool enabled = false;
  std::int64_t step_start = 10;  // recording starts once this many iterations are done
  std::int64_t step_end = 12;    // and stops once this many are
  std::vector<int> ranks{0};
  bool record_shapes = false;  // --pytorch-profiler-collect-shapes: inputs' shapes and dtypes in the trace and table
  std::string dir = ".";  // where trace_rank<r>_iterations_<a>-<b>.json goes
};

class StepProfiler {
 public:
  StepProfiler(ProfileOptions options, int rank, bool cuda);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Before the iteration that follows `done` iterations: starts recording when `done` is --profile-step-start.
  void before_iteration(std::int64_t done);
  // After it: with `done` at --profile-step-end, stops, writes the trace and returns the table to print.
  Result<std::string> after_iteration(std::int64_t done);

 private:
  ProfileOptions options_;
  int rank_;
  bool cuda_;
  bool recording_ = false;
  double started_ms_ = 0;
};

}  // namespace trestle::train
