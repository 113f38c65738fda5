// trestle bench load: a Llama-shaped bf16 state dict saved by two tensor-parallel ranks (2-D tensors split by rows) and
// loaded cold as four ranks hold it: Trestle's load planner, and torch.distributed.checkpoint (saved by 2 processes as
// DTensors, loaded by 4, and by one process into whole tensors), beside fio's read ceiling and torch.load of the same
// tensors, in alternating rounds; every file is evicted from the page cache before it is read.
#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>

#include "ckpt/byte_size.h"
#include "ckpt/load.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_checkpoint.h"
#include "tools/bench/bench_files.h"
#include "tools/bench/bench_fio.h"
#include "tools/bench/bench_main.h"
#include "tools/bench/bench_peer.h"
#include "tools/bench/bench_report.h"
#include "tools/table.h"

namespace trestle::cli {
namespace {

constexpr int kSavedTp = 2;
constexpr int kLoadedTp = 4;

struct Figures {
  Samples trestle, fio, dcp, dcp_whole, torch_load;  // dcp: 2 -> 4 processes; dcp_whole: 2 -> 1 process
};

class LoadBench {
 public:
  LoadBench(CheckpointBenchOptions options, ScratchDir scratch)
      : options_(std::move(options)), scratch_(std::move(scratch)) {}
  Status prepare();
  Status run_round(unsigned round);
  void print_table() const;
  nlohmann::json report() const;

 private:
  Status save_trestle();
  Status load_trestle(bool check);
  Status check_loaded() const;
  Status load_peer(const char* request, const std::string& path, const std::string& extra, Samples& samples,
                   const char* what);
  Status measure_fio();

  CheckpointBenchOptions options_;
  ScratchDir scratch_;
  std::optional<StateDict> state_;
  LlamaShape shape_;
  std::vector<LoadRequest> requests_;  // every piece of every tp4 rank
  std::vector<std::span<const std::byte>> expected_;
  AlignedBuffer destinations_;
  std::unique_ptr<PeerClient> peer_;
  std::string trestle_dir_, dcp_dir_, torch_file_, fio_file_, fio_version_;
  std::uint64_t loaded_bytes_ = 0;
  Figures figures_;
};

// Two thread ranks save their tp2 pieces, as two processes of a tp2 job would.
Status LoadBench::save_trestle() {
  trestle_dir_ = scratch_.fresh("trestle-tp2");
  ThreadGroup group(kSavedTp);
  std::vector<Status> results(kSavedTp);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kSavedTp; ++r)
    ranks.emplace_back([&, r] {
      const auto member = group.member(r);
      const auto items = tp_save_items(*state_, kSavedTp, r);
      CheckpointInfo info;
      info.iteration = 1;
      info.layout = {{"tp", kSavedTp}};
      SaveOptions options;
      options.threads = options_.threads;
      results[static_cast<std::size_t>(r)] = save_checkpoint(*member, trestle_dir_, info, items, options);
    });
  for (auto& t : ranks) t.join();
  for (const Status& s : results) TRESTLE_RETURN_IF_ERROR(s);
  return OkStatus();
}

Status LoadBench::prepare() {
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
  const std::uint64_t copies = 1 + (options_.python ? 2 : 0) + (options_.fio ? 1 : 0);
  TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t available, free_bytes(scratch_.path()));
  if (available < copies * bytes + bytes / 5)
    return Status::Error(scratch_.path() + ": " + format_bytes(available) + " free, the benchmark needs about " +
                         format_bytes(copies * bytes + bytes / 5) + "; use --dir on a larger disk or a smaller --size");
  progress("state dict: " + std::to_string(specs.size()) + " bf16 tensors, " + format_bytes(bytes) + " (hidden " +
           std::to_string(shape_.hidden) + ", " + std::to_string(shape_.layers) + " layers), in " + scratch_.path());
  if (options_.python) {
    progress("starting the PyTorch peer (" + python + ")");
    TRESTLE_ASSIGN_OR_RETURN(
        peer_, start_torch_checkpoint_peer(python, options_.peers_dir, scratch_.fresh("peer-spec.json"), specs));
  }
  state_.emplace(std::move(specs));

  progress("saving the Trestle checkpoint at tp" + std::to_string(kSavedTp));
  TRESTLE_RETURN_IF_ERROR(save_trestle());
  if (options_.python) {
    progress("saving the DCP checkpoint with 2 processes and the torch.save file with the peer");
    dcp_dir_ = scratch_.fresh("dcp-tp2");
    torch_file_ = scratch_.fresh("torch.pt");
    TRESTLE_RETURN_IF_ERROR(peer_->seconds("save_dcp_tp " + dcp_dir_ + " " + std::to_string(kSavedTp)).status());
    TRESTLE_RETURN_IF_ERROR(peer_->seconds("save_torch " + torch_file_).status());
  }
  if (options_.fio) {
    fio_file_ = scratch_.fresh("fio.dat");
    TRESTLE_RETURN_IF_ERROR(run_fio({fio_file_, state_->total_bytes(), "write"}).status());
  }

  // Destinations for every piece of every tp4 rank, allocated and touched once.
  std::vector<std::uint64_t> offsets;
  for (int r = 0; r < kLoadedTp; ++r)
    for (const SaveItem& item : tp_save_items(*state_, kLoadedTp, r)) {
      offsets.push_back(loaded_bytes_);
      requests_.push_back({item.name, item.piece, nullptr});
      expected_.push_back({item.data, item.nbytes()});
      loaded_bytes_ = align_up(loaded_bytes_ + item.nbytes(), kIoAlignment);
    }
  destinations_ = AlignedBuffer(loaded_bytes_);
  loaded_bytes_ = 0;
  for (std::size_t i = 0; i < requests_.size(); ++i) {
    requests_[i].destination = destinations_.data() + offsets[i];
    loaded_bytes_ += expected_[i].size();
  }
  return OkStatus();
}

Status LoadBench::check_loaded() const {
  for (std::size_t i = 0; i < requests_.size(); ++i)
    if (std::memcmp(requests_[i].destination, expected_[i].data(), expected_[i].size()) != 0)
      return Status::Error(trestle_dir_ + ": tensor '" + requests_[i].name + "' piece " +
                           to_string(requests_[i].piece) + " loaded other bytes than were saved");
  return OkStatus();
}

Status LoadBench::load_trestle(bool check) {
  TRESTLE_RETURN_IF_ERROR(evict_from_page_cache(trestle_dir_));
  if (check) std::memset(destinations_.data(), 0, destinations_.size());
  Stopwatch clock;
  TRESTLE_ASSIGN_OR_RETURN(const CheckpointReader reader, CheckpointReader::open(trestle_dir_));
  TRESTLE_RETURN_IF_ERROR(reader.load(requests_));
  const double seconds = clock.seconds();
  figures_.trestle.add(seconds, state_->total_bytes());
  progress(rate_line("trestle load tp2 -> tp4 (cold)", seconds, state_->total_bytes()));
  return check ? check_loaded() : OkStatus();
}

Status LoadBench::load_peer(const char* request, const std::string& path, const std::string& extra, Samples& samples,
                            const char* what) {
  TRESTLE_RETURN_IF_ERROR(evict_from_page_cache(path));
  TRESTLE_ASSIGN_OR_RETURN(const double seconds, peer_->seconds(std::string(request) + " " + path + extra));
  samples.add(seconds, state_->total_bytes());
  progress(rate_line(what, seconds, state_->total_bytes()));
  return OkStatus();
}

Status LoadBench::measure_fio() {
  TRESTLE_ASSIGN_OR_RETURN(const double bw, run_fio({fio_file_, state_->total_bytes(), "read"}));
  figures_.fio.add_rate(bw);
  progress(rate_line("fio read (O_DIRECT, 1 MiB, QD32)", static_cast<double>(state_->total_bytes()) / bw,
                     state_->total_bytes()));
  return OkStatus();
}

// Every contender once per round; odd rounds run them in reverse order.
Status LoadBench::run_round(unsigned round) {
  progress("round " + std::to_string(round + 1) + " of " + std::to_string(options_.repeat));
  std::vector<std::function<Status()>> steps = {[&] { return load_trestle(round == 0); }};
  if (options_.fio) steps.push_back([&] { return measure_fio(); });
  if (options_.python) {
    steps.push_back([&] {
      return load_peer("load_dcp_tp", dcp_dir_, " " + std::to_string(kLoadedTp), figures_.dcp,
                       "torch dcp.load tp2 -> tp4 (cold)");
    });
    steps.push_back(
        [&] { return load_peer("load_dcp", dcp_dir_, "", figures_.dcp_whole, "torch dcp.load tp2 -> 1 (cold)"); });
    steps.push_back([&] { return load_peer("load_torch", torch_file_, "", figures_.torch_load, "torch.load (cold)"); });
  }
  if (round % 2 == 1) std::reverse(steps.begin(), steps.end());
  for (const auto& step : steps) TRESTLE_RETURN_IF_ERROR(step());
  return OkStatus();
}

void LoadBench::print_table() const {
  const bool median = options_.repeat >= 3;
  std::printf("trestle bench load: %s bf16 state dict (%zu tensors), %u round(s), %s, every read cold\n",
              format_bytes(state_->total_bytes()).c_str(), state_->size(), options_.repeat, scratch_.path().c_str());
  Table table({"GB/s" + std::string(median ? " (best / median)" : " (best)"), "Trestle", "fio read", "DCP",
               "DCP to 1 process", "torch.load", "Trestle/fio", "Trestle/DCP"});
  table.add({"load, saved tp2 -> loaded tp4", format_rate(figures_.trestle, median), format_rate(figures_.fio, median),
             format_rate(figures_.dcp, median), format_rate(figures_.dcp_whole, median),
             format_rate(figures_.torch_load, median), format_ratio(figures_.trestle.best(), figures_.fio.best()),
             format_ratio(figures_.trestle.best(), figures_.dcp.best())});
  table.print(stdout, {false, true, true, true, true, true, true, true});
  std::printf(
      "Trestle: saved by 2 TP ranks, every piece of 4 TP ranks loaded by the load planner in one process (%s placed,\n"
      "checksums verified; bytes checked in round 1). DCP: saved by 2 processes as DTensors, loaded by 4 processes\n"
      "into their preallocated DTensor pieces (barrier to barrier); 'to 1 process': dcp.load of the same checkpoint\n"
      "into whole preallocated tensors. torch.load: one file (torch.save of the whole state) into new tensors.\n",
      format_bytes(loaded_bytes_).c_str());
  if (!options_.python) std::printf("PyTorch peers skipped (--no-python)\n");
  if (!options_.fio) std::printf("fio ceiling skipped (--no-fio)\n");
}

nlohmann::json LoadBench::report() const {
  nlohmann::json results = {{"trestle_load_tp2_to_tp4", figures_.trestle.to_json()}};
  if (options_.fio) results["fio_read"] = figures_.fio.to_json();
  if (options_.python) {
    results["dcp_load_tp2_to_tp4"] = figures_.dcp.to_json();
    results["dcp_load_tp2_to_one_process"] = figures_.dcp_whole.to_json();
    results["torch_load"] = figures_.torch_load.to_json();
  }
  nlohmann::json report = checkpoint_report("load", options_, *state_, shape_, scratch_.path(),
                                            options_.python ? peer_->facts() : nlohmann::json(), fio_version_);
  report["loaded_bytes"] = loaded_bytes_;
  report["saved_tp"] = kSavedTp;
  report["loaded_tp"] = kLoadedTp;
  report["results"] = results;
  return report;
}

}  // namespace

int bench_load_main(int argc, char** argv) {
  cxxopts::Options spec(
      "trestle bench load",
      "Load a Llama-shaped bf16 state dict saved by 2 TP ranks into the pieces of 4 TP ranks (2-D tensors split by\n"
      "rows): a Trestle checkpoint with the load planner, and torch.distributed.checkpoint (DTensors, 2 processes\n"
      "saving, 4 loading; and dcp.load into whole tensors in one process), beside fio's read ceiling (O_DIRECT,\n"
      "1 MiB, io_uring, depth 32, same size) and torch.load, in alternating rounds, every file evicted from the page\n"
      "cache first.");
  add_bench_options(spec, kCheckpointBenchOptionSet);
  return run_bench_main<CheckpointBenchOptions>("trestle bench load", spec, parse_checkpoint_bench_options,
                                                run_bench_rounds<LoadBench, CheckpointBenchOptions>, argc, argv);
}

}  // namespace trestle::cli
