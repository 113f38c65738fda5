// trestle bench save: saves a Llama-shaped bf16 state dict as a Trestle checkpoint, synchronously and with AsyncSaver,
// beside fio's write ceiling and PyTorch's torch.distributed.checkpoint.save and torch.save of the same tensors, in
// alternating rounds, every save including fsync. For the asynchronous save it also reports how long the caller is
// blocked against a plain memcpy of the state into memory that is already touched. With the Python peer, the same
// state dict is also saved from Python by trestle.save_async (the bindings) beside dcp.async_save and dcp.save: the
// caller's blocked time and the total of each.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>

#include "ckpt/async_saver.h"
#include "ckpt/byte_size.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_checkpoint.h"
#include "tools/bench/bench_files.h"
#include "tools/bench/bench_fio.h"
#include "tools/bench/bench_main.h"
#include "tools/bench/bench_peer.h"
#include "tools/bench/bench_report.h"
#include "tools/self_exe.h"
#include "tools/table.h"

namespace trestle::cli {
namespace {

struct Figures {
  Samples trestle, trestle_async, dcp, torch_save;
  Samples fio, fio_overwrite;     // a new file, as the ceiling is defined; the same file again, its blocks allocated
  Samples async_blocked, memcpy;  // GB/s of the state: the caller's wait in save_async, and a plain memcpy
  double first_async_blocked_seconds = 0;  // the first save_async, which allocates and touches the pool
  // Saved from Python by the peer: trestle.save_async (to wait()) and dcp.async_save (to result()), each with the
  // caller's blocked time, in GB/s of the state.
  Samples py_trestle_async, py_trestle_blocked, dcp_async, dcp_async_blocked;
  double py_first_trestle_blocked_seconds = 0;
};

// Where the peer imports the trestle package from: $TRESTLE_PYTHON_PATH, else python/ of this build (beside tools/).
void point_peer_at_trestle_package() {
  if (std::getenv("TRESTLE_PYTHON_PATH")) return;
  const auto exe_dir = self_exe_dir();
  if (!exe_dir.ok()) return;
  const std::string build_python = *exe_dir + "/../python";
  if (std::filesystem::exists(build_python + "/trestle/__init__.py"))
    ::setenv("TRESTLE_PYTHON_PATH", build_python.c_str(), 1);
}

class SaveBench {
 public:
  SaveBench(CheckpointBenchOptions options, ScratchDir scratch)
      : options_(std::move(options)), scratch_(std::move(scratch)), saver_(options_.threads) {}
  Status prepare();
  Status run_round(unsigned round);
  void print_table() const;
  void print_python_table(double native_blocked, double memcpy_seconds) const;
  nlohmann::json report() const;

 private:
  Status save_sync();
  Status save_async();
  Status copy_plainly();
  Status save_peer(const char* request, const std::string& path, Samples& samples, const char* what);
  Status save_peer_async(const char* request, const std::string& path, Samples& total, Samples& blocked,
                         const char* what);
  Status measure_fio();
  Status remove_output(const std::string& name);
  SaveOptions save_options() const;
  CheckpointInfo next_info() {
    CheckpointInfo info;
    info.iteration = ++iteration_;
    return info;
  }

  CheckpointBenchOptions options_;
  ScratchDir scratch_;
  std::optional<StateDict> state_;
  LlamaShape shape_;
  std::vector<SaveItem> items_;
  AsyncSaver saver_;
  AlignedBuffer copy_target_;
  std::unique_ptr<PeerClient> peer_;
  std::string fio_version_;
  std::int64_t iteration_ = 0;
  Figures figures_;
};

SaveOptions SaveBench::save_options() const {
  SaveOptions o;
  o.threads = options_.threads;
  return o;
}

Status SaveBench::prepare() {
  if (options_.fio) {
    TRESTLE_ASSIGN_OR_RETURN(fio_version_, fio_version());
  }
  std::string python;
  if (options_.python) {
    TRESTLE_ASSIGN_OR_RETURN(python, find_python(options_.python_path));
  }
  shape_ = llama_shape_for_bytes(options_.size, DType::kBF16);
  auto specs = llama_tensor_specs(shape_, DType::kBF16);
  std::uint64_t bytes = 0;
  for (const auto& s : specs) bytes += s.nbytes();
  TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t available, free_bytes(scratch_.path()));
  if (available < bytes + bytes / 5)  // each save is removed before the next one starts
    return Status::Error(scratch_.path() + ": " + format_bytes(available) + " free, the benchmark needs about " +
                         format_bytes(bytes + bytes / 5) + "; use --dir on a larger disk or a smaller --size");
  progress("state dict: " + std::to_string(specs.size()) + " bf16 tensors, " + format_bytes(bytes) + " (hidden " +
           std::to_string(shape_.hidden) + ", " + std::to_string(shape_.layers) + " layers), in " + scratch_.path());
  if (options_.python) {
    point_peer_at_trestle_package();
    progress("starting the PyTorch peer (" + python + ")");
    TRESTLE_ASSIGN_OR_RETURN(
        peer_, start_torch_checkpoint_peer(python, options_.peers_dir, scratch_.fresh("peer-spec.json"), specs));
  }
  state_.emplace(std::move(specs));
  items_ = tp_save_items(*state_, 1, 0);
  copy_target_ = AlignedBuffer(state_->total_bytes());  // touched once, as the saver's pool is

  // The first asynchronous save allocates and touches the pool; later ones reuse it. Timed apart, not in the rounds.
  SoloCollective solo;
  const std::string root = scratch_.fresh("trestle-async");
  Stopwatch clock;
  TRESTLE_RETURN_IF_ERROR(saver_.save_async(solo, root, next_info(), items_, save_options()));
  figures_.first_async_blocked_seconds = clock.seconds();
  TRESTLE_RETURN_IF_ERROR(saver_.finalize());
  progress("first save_async (allocates the " + format_bytes(saver_.pool().capacity()) + " pool" +
           (saver_.pool().locked() ? ", locked" : "") + ") blocked for " +
           std::to_string(figures_.first_async_blocked_seconds).substr(0, 5) + " s");
  TRESTLE_RETURN_IF_ERROR(remove_output("trestle-async"));
  if (options_.python) {  // likewise the Python package's pool, in the peer
    TRESTLE_ASSIGN_OR_RETURN(const auto answer, peer_->ask("save_trestle_async " + scratch_.fresh("py-trestle")));
    figures_.py_first_trestle_blocked_seconds = answer.value("blocked", 0.0);
    progress("first trestle.save_async from Python blocked for " +
             std::to_string(figures_.py_first_trestle_blocked_seconds).substr(0, 5) + " s");
    TRESTLE_RETURN_IF_ERROR(remove_output("py-trestle"));
  }
  return OkStatus();
}

// Each save is removed once timed, so the disk holds one copy at a time; the removal is committed before the next
// contender starts (sync_file_system), so none pays for another's deleted blocks.
Status SaveBench::remove_output(const std::string& name) {
  scratch_.fresh(name);
  return sync_file_system(scratch_.path());
}

Status SaveBench::save_sync() {
  const std::string root = scratch_.fresh("trestle");
  SoloCollective solo;
  Stopwatch clock;
  TRESTLE_RETURN_IF_ERROR(save_checkpoint(solo, root, next_info(), items_, save_options()));
  const double seconds = clock.seconds();
  figures_.trestle.add(seconds, state_->total_bytes());
  progress(rate_line("trestle save", seconds, state_->total_bytes()));
  return remove_output("trestle");
}

Status SaveBench::save_async() {
  const std::string root = scratch_.fresh("trestle-async");
  SoloCollective solo;
  Stopwatch clock;
  TRESTLE_RETURN_IF_ERROR(saver_.save_async(solo, root, next_info(), items_, save_options()));
  const double blocked = clock.seconds();
  TRESTLE_RETURN_IF_ERROR(saver_.finalize());
  const double seconds = clock.seconds();
  figures_.async_blocked.add(blocked, state_->total_bytes());
  figures_.trestle_async.add(seconds, state_->total_bytes());
  progress(rate_line("trestle async save (to finalize)", seconds, state_->total_bytes()) + ", caller blocked " +
           std::to_string(blocked).substr(0, 5) + " s");
  return remove_output("trestle-async");
}

// What the caller would wait for without Trestle: one memcpy of every tensor into memory already touched.
Status SaveBench::copy_plainly() {
  Stopwatch clock;
  std::byte* out = copy_target_.data();
  for (std::size_t i = 0; i < state_->size(); ++i) {
    const auto bytes = state_->bytes(i);
    std::memcpy(out, bytes.data(), bytes.size());
    out += bytes.size();
  }
  const double seconds = clock.seconds();
  figures_.memcpy.add(seconds, state_->total_bytes());
  progress(rate_line("memcpy of the state", seconds, state_->total_bytes()));
  return OkStatus();
}

Status SaveBench::save_peer(const char* request, const std::string& path, Samples& samples, const char* what) {
  TRESTLE_ASSIGN_OR_RETURN(const double seconds, peer_->seconds(std::string(request) + " " + path));
  samples.add(seconds, state_->total_bytes());
  progress(rate_line(what, seconds, state_->total_bytes()));
  return remove_output(path.substr(path.rfind('/') + 1));
}

Status SaveBench::save_peer_async(const char* request, const std::string& path, Samples& total, Samples& blocked,
                                  const char* what) {
  TRESTLE_ASSIGN_OR_RETURN(const auto answer, peer_->ask(std::string(request) + " " + path));
  const double seconds = answer.value("seconds", 0.0), waited = answer.value("blocked", 0.0);
  total.add(seconds, state_->total_bytes());
  blocked.add(waited, state_->total_bytes());
  progress(rate_line(what, seconds, state_->total_bytes()) + ", caller blocked " + std::to_string(waited).substr(0, 5) +
           " s");
  return remove_output(path.substr(path.rfind('/') + 1));
}

// fio's ceiling writes a new file, whose O_DIRECT writes extend it; Trestle preallocates its files, so the rate of
// overwriting the same file (blocks already allocated) is shown beside it as the stricter ceiling.
Status SaveBench::measure_fio() {
  const std::string file = scratch_.fresh("fio.dat");
  TRESTLE_ASSIGN_OR_RETURN(const double bw, run_fio({file, state_->total_bytes(), "write"}));
  TRESTLE_ASSIGN_OR_RETURN(const double overwrite, run_fio({file, state_->total_bytes(), "write"}));
  TRESTLE_RETURN_IF_ERROR(remove_output("fio.dat"));
  figures_.fio.add_rate(bw);
  figures_.fio_overwrite.add_rate(overwrite);
  const double bytes = static_cast<double>(state_->total_bytes());
  progress(rate_line("fio write (O_DIRECT, 1 MiB, QD32)", bytes / bw, state_->total_bytes()));
  progress(rate_line("fio overwrite of the same file", bytes / overwrite, state_->total_bytes()));
  return OkStatus();
}

// Every contender once per round; odd rounds run them in reverse, so none always follows the same neighbour.
Status SaveBench::run_round(unsigned round) {
  progress("round " + std::to_string(round + 1) + " of " + std::to_string(options_.repeat));
  std::vector<std::function<Status()>> steps = {[&] { return copy_plainly(); }, [&] { return save_async(); },
                                                [&] { return save_sync(); }};
  if (options_.fio) steps.push_back([&] { return measure_fio(); });
  if (options_.python) {
    steps.push_back([&] { return save_peer("save_dcp", scratch_.fresh("dcp"), figures_.dcp, "torch dcp.save"); });
    steps.push_back(
        [&] { return save_peer("save_torch", scratch_.fresh("torch.pt"), figures_.torch_save, "torch.save"); });
    steps.push_back([&] {
      return save_peer_async("save_trestle_async", scratch_.fresh("py-trestle"), figures_.py_trestle_async,
                             figures_.py_trestle_blocked, "trestle.save_async from Python (to wait)");
    });
    steps.push_back([&] {
      return save_peer_async("save_dcp_async", scratch_.fresh("dcp-async"), figures_.dcp_async,
                             figures_.dcp_async_blocked, "torch dcp.async_save (to result)");
    });
  }
  if (round % 2 == 1) std::reverse(steps.begin(), steps.end());
  for (const auto& step : steps) TRESTLE_RETURN_IF_ERROR(step());
  return OkStatus();
}

void SaveBench::print_table() const {
  const bool median = options_.repeat >= 3;
  std::printf("trestle bench save: %s bf16 state dict (%zu tensors), %u round(s), %s, every save including fsync\n",
              format_bytes(state_->total_bytes()).c_str(), state_->size(), options_.repeat, scratch_.path().c_str());
  Table table({"GB/s" + std::string(median ? " (best / median)" : " (best)"), "Trestle", "fio write", "fio overwrite",
               "DCP save", "torch.save", "Trestle/fio", "Trestle/fio overwrite", "Trestle/DCP"});
  auto row = [&](const std::string& name, const Samples& s) {
    table.add({name, format_rate(s, median), format_rate(figures_.fio, median),
               format_rate(figures_.fio_overwrite, median), format_rate(figures_.dcp, median),
               format_rate(figures_.torch_save, median), format_ratio(s.best(), figures_.fio.best()),
               format_ratio(s.best(), figures_.fio_overwrite.best()), format_ratio(s.best(), figures_.dcp.best())});
  };
  row("save", figures_.trestle);
  row("async save, to finalize", figures_.trestle_async);
  table.print(stdout, {false, true, true, true, true, true, true, true, true});
  if (options_.fio)
    std::printf(
        "fio write: a new file, as the ceiling is defined; fio overwrite: the same file again (its blocks\n"
        "allocated, as Trestle's preallocated files are)\n");

  const double bytes = static_cast<double>(state_->total_bytes());
  const double blocked = bytes / 1e9 / figures_.async_blocked.best(), copy = bytes / 1e9 / figures_.memcpy.best();
  std::printf("\ncaller blocked by save_async: %.3f s (best); plain memcpy of the state: %.3f s (best); ratio %.2fx\n",
              blocked, copy, blocked / copy);
  std::printf("first save_async, which allocated and touched the %s staging pool: %.3f s\n",
              format_bytes(saver_.pool().capacity()).c_str(), figures_.first_async_blocked_seconds);
  if (options_.python) print_python_table(blocked, copy);
  else std::printf("PyTorch peers skipped (--no-python)\n");
  if (!options_.fio) std::printf("fio ceiling skipped (--no-fio)\n");
}

// The same state dict saved from Python: Trestle's bindings beside DCP's two entry points (best of the rounds).
void SaveBench::print_python_table(double native_blocked, double memcpy_seconds) const {
  const double bytes = static_cast<double>(state_->total_bytes());
  auto seconds = [&](const Samples& s) { return s.best() > 0 ? bytes / 1e9 / s.best() : 0.0; };
  auto fixed = [](double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3f", v);
    return std::string(text);
  };
  std::printf("\nfrom Python, the same state dict (best of the rounds):\n");
  Table table({"", "caller blocked s", "blocked / memcpy", "total s", "GB/s", "trestle GB/s / this"});
  auto row = [&](const std::string& name, const Samples& total, const Samples* blocked) {
    const double b = blocked ? seconds(*blocked) : seconds(total);
    table.add({name, fixed(b), format_ratio(b, memcpy_seconds), fixed(seconds(total)),
               format_rate(total, false), format_ratio(figures_.py_trestle_async.best(), total.best())});
  };
  row("trestle.save_async", figures_.py_trestle_async, &figures_.py_trestle_blocked);
  row("dcp.async_save", figures_.dcp_async, &figures_.dcp_async_blocked);
  row("dcp.save", figures_.dcp, nullptr);
  table.print(stdout, {false, true, true, true, true, true});
  std::printf("(C++ save_async blocked %.3f s; the first trestle.save_async, which allocated its pool, %.3f s)\n",
              native_blocked, figures_.py_first_trestle_blocked_seconds);
}

nlohmann::json SaveBench::report() const {
  nlohmann::json results = {{"trestle_save", figures_.trestle.to_json()},
                            {"trestle_async_save_to_finalize", figures_.trestle_async.to_json()},
                            {"trestle_async_caller_blocked", figures_.async_blocked.to_json()},
                            {"memcpy_of_state", figures_.memcpy.to_json()},
                            {"first_async_blocked_seconds", figures_.first_async_blocked_seconds}};
  if (options_.fio) {
    results["fio_write"] = figures_.fio.to_json();
    results["fio_overwrite"] = figures_.fio_overwrite.to_json();
  }
  if (options_.python) {
    results["dcp_save"] = figures_.dcp.to_json();
    results["torch_save"] = figures_.torch_save.to_json();
    results["python_trestle_save_async_to_wait"] = figures_.py_trestle_async.to_json();
    results["python_trestle_save_async_caller_blocked"] = figures_.py_trestle_blocked.to_json();
    results["python_first_trestle_blocked_seconds"] = figures_.py_first_trestle_blocked_seconds;
    results["dcp_async_save_to_result"] = figures_.dcp_async.to_json();
    results["dcp_async_save_caller_blocked"] = figures_.dcp_async_blocked.to_json();
  }
  nlohmann::json report = checkpoint_report("save", options_, *state_, shape_, scratch_.path(),
                                            options_.python ? peer_->facts() : nlohmann::json(), fio_version_);
  report["threads"] = options_.threads;
  report["staging_pool"] = {{"bytes", saver_.pool().capacity()}, {"locked", saver_.pool().locked()}};
  report["results"] = results;
  return report;
}

}  // namespace

int bench_save_main(int argc, char** argv) {
  cxxopts::Options spec(
      "trestle bench save",
      "Save a Llama-shaped bf16 state dict as a Trestle checkpoint (save_checkpoint, and AsyncSaver: save_async then\n"
      "finalize) beside fio's write ceiling (O_DIRECT, 1 MiB, io_uring, depth 32, same size) and PyTorch's\n"
      "torch.distributed.checkpoint.save and torch.save, in alternating rounds, every save including fsync. Also\n"
      "reports how long save_async blocks the caller against a plain memcpy of the state into touched memory, and,\n"
      "from Python, trestle.save_async (the bindings) beside dcp.async_save and dcp.save: blocked and total time.");
  add_bench_options(spec, kCheckpointBenchOptionSet);
  return run_bench_main<CheckpointBenchOptions>("trestle bench save", spec, parse_checkpoint_bench_options,
                                                run_bench_rounds<SaveBench, CheckpointBenchOptions>, argc, argv);
}

}  // namespace trestle::cli
