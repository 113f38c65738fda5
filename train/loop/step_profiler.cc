#include "train/loop/step_profiler.h"

#include <c10/core/DeviceType.h>
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <set>
#include <utility>

#include "train/loop/launch_attribution.h"
#include "train/loop/profile_rows.h"

#ifdef TRESTLE_HAVE_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace trestle::train {
namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void synchronize(bool cuda) {
#ifdef TRESTLE_HAVE_TORCH_CUDA
  if (cuda) c10::cuda::device_synchronize();
#else
  (void)cuda;
#endif
}

// An operator's inputs for its row's name, where the profile recorded them.
std::string inputs_of(const profiler::KinetoEvent& e) {
  if (!e.hasShapes() || !e.hasTypes()) return "";
  const auto shapes = e.shapes();
  const auto dtypes = e.dtypes();
  return describe_inputs({shapes.begin(), shapes.end()}, {dtypes.begin(), dtypes.end()});
}

// The operators, runtime calls and device events of a GPU profile, for device_time_by_launcher.
std::vector<TimedEvent> timed_events(const std::vector<profiler::KinetoEvent>& events) {
  using libkineto::ActivityType;
  std::vector<TimedEvent> out;
  for (const auto& e : events) {
    TimedEvent t;
    const auto type = static_cast<ActivityType>(e.activityType());
    if (e.deviceType() == c10::DeviceType::CUDA) t.kind = TimedEvent::Kind::kDevice;
    else if (type == ActivityType::CUDA_RUNTIME || type == ActivityType::CUDA_DRIVER)
      t.kind = TimedEvent::Kind::kLaunch;
    else if (type == ActivityType::CPU_OP) t.kind = TimedEvent::Kind::kOperator;
    else continue;
    t.name = e.name();
    if (t.kind == TimedEvent::Kind::kOperator) t.inputs = inputs_of(e);
    t.thread = e.startThreadId();
    t.start_ns = e.startNs();
    t.end_ns = e.endNs();
    t.correlation = e.correlationId();
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

StepProfiler::StepProfiler(ProfileOptions options, int rank, bool cuda)
    : options_(std::move(options)), rank_(rank), cuda_(cuda) {
  if (std::find(options_.ranks.begin(), options_.ranks.end(), rank_) == options_.ranks.end()) options_.enabled = false;
}

StepProfiler::~StepProfiler() {
  if (recording_) profiler::disableProfiler();  // a run that ended inside the window: nothing written
}

void StepProfiler::before_iteration(std::int64_t done) {
  if (!options_.enabled || recording_ || done != options_.step_start) return;
  const ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/options_.record_shapes);
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda_) activities.insert(ActivityType::CUDA);
  synchronize(cuda_);
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  recording_ = true;
  started_ms_ = now_ms();
}

Result<std::string> StepProfiler::after_iteration(std::int64_t done) {
  if (!recording_ || done != options_.step_end) return std::string();
  synchronize(cuda_);
  const double wall_ms = now_ms() - started_ms_;
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  recording_ = false;
  const std::string name = "trace_rank" + std::to_string(rank_) + "_iterations_" +
                           std::to_string(options_.step_start + 1) + "-" + std::to_string(options_.step_end) + ".json";
  const std::filesystem::path path = std::filesystem::path(options_.dir) / name;
  std::error_code error;
  std::filesystem::create_directories(options_.dir, error);
  if (error) return Status::Error("--profile: cannot create " + options_.dir + ": " + error.message());
  try {
    result->save(path.string());
  } catch (const std::exception& e) {
    return Status::Error("--profile: cannot write " + path.string() + ": " + e.what());
  }
  // GPU activities (kernels, copies) on a GPU; CPU operators (inclusive of those they call) otherwise.
  const c10::DeviceType wanted = cuda_ ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  std::vector<ProfileRow> rows;
  double busy_ms = 0;
  for (const auto& event : result->events()) {
    if (event.deviceType() != wanted) continue;
    const double ms = static_cast<double>(event.durationNs()) / 1e6;
    rows.push_back({event.name() + inputs_of(event), 1, ms});
    busy_ms += ms;
  }
  const std::int64_t iterations = options_.step_end - options_.step_start;
  char line[512];
  std::string table;
  std::snprintf(line, sizeof line,
                " profile of rank %d, iterations %lld-%lld: %.1f ms of wall time, %.1f ms of %s (%.0f%%); trace %s\n",
                rank_, static_cast<long long>(options_.step_start + 1), static_cast<long long>(options_.step_end),
                wall_ms, busy_ms, cuda_ ? "GPU activity" : "CPU operators (inclusive)",
                wall_ms > 0 ? 100.0 * busy_ms / wall_ms : 0.0, path.string().c_str());
  table += line;
  // A table's heading and its 25 largest rows, the events summed by name (and inputs, where recorded: wider rows).
  const int width = options_.record_shapes ? 160 : 90;
  auto append_table = [&](const char* heading, const std::vector<ProfileRow>& events) {
    std::snprintf(line, sizeof line, " %-*s %8s %12s %7s\n", width, heading, "calls", "ms/iteration", "share");
    table += line;
    for (const ProfileRow& r : rank_by_total(events, 25)) {
      const auto limit = static_cast<std::size_t>(width);
      std::string shown = r.name.size() > limit ? r.name.substr(0, limit - 3) + "..." : r.name;
      std::snprintf(line, sizeof line, " %-*s %8lld %12.3f %6.1f%%\n", width, shown.c_str(),
                    static_cast<long long>(r.calls), r.total_ms / static_cast<double>(iterations),
                    busy_ms > 0 ? 100.0 * r.total_ms / busy_ms : 0.0);
      table += line;
    }
  };
  append_table(cuda_ ? "GPU kernel / copy" : "operator", rows);
  // Which operations launched that time: a copy kernel's row alone does not say.
  if (cuda_)
    append_table("GPU time by the operation that launched it (outer > inner)",
                 device_time_by_launcher(timed_events(result->events())));
  return table;
}

}  // namespace trestle::train
