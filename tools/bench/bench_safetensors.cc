// trestle bench safetensors: writes and reads a Llama-shaped bf16 state dict as a sharded Hugging Face checkpoint,
// with Trestle and with the safetensors Python package in alternating rounds, beside fio's ceiling on the same disk.
#include <cxxopts.hpp>
#include <iostream>
#include <map>
#include <optional>

#include "ckpt/byte_size.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_files.h"
#include "tools/bench/bench_fio.h"
#include "tools/bench/bench_main.h"
#include "tools/bench/bench_options.h"
#include "tools/bench/bench_peer.h"
#include "tools/bench/bench_report.h"
#include "tools/bench/bench_safetensors_io.h"
#include "tools/bench/bench_state_dict.h"
#include "tools/table.h"

namespace trestle::cli {
namespace {

constexpr BenchOptionSet kOptionSet{.size = "2GiB",
                                    .size_help = "state dict size",
                                    .repeat = 2,
                                    .peer_help = "the Python peer",
                                    .threads = true,
                                    .threads_help = "reader threads (0: one per CPU, at least 2)"};

struct SafetensorsOptions : BenchOptions {
  std::uint64_t max_shard_bytes = 0;
  bool warm = true;
  std::vector<ReadMethod> cold_methods;
  std::vector<ReadMethod> warm_methods;
};

// Every figure of one run; Trestle's reads per read method.
struct Figures {
  Samples trestle_write, python_write, fio_write, fio_read;
  std::map<ReadMethod, Samples> trestle_cold, trestle_warm;
  Samples python_cold, python_warm, python_load_file_returned;
};

class SafetensorsBench {
 public:
  SafetensorsBench(SafetensorsOptions options, ScratchDir scratch)
      : options_(std::move(options)), scratch_(std::move(scratch)) {}
  Status prepare();
  Status run_round(unsigned round);
  void print_table() const;
  nlohmann::json report() const;

 private:
  Status write_trestle();
  Status write_python();
  Status read_trestle(ReadMethod method, bool cold);
  Status read_python(bool cold);
  Status check_python_checkpoint();
  Status measure_fio();

  SafetensorsOptions options_;
  ScratchDir scratch_;
  std::optional<StateDict> state_;
  LlamaShape shape_;
  std::vector<std::vector<TensorSpec>> shards_;
  std::unique_ptr<PeerClient> peer_;
  std::optional<ReadTarget> target_;
  std::map<ReadMethod, bool> verified_;
  std::string trestle_dir_, python_dir_;
  std::string fio_version_;
  Figures figures_;
};

std::string rate_line(const std::string& what, double seconds, std::uint64_t bytes) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%-28s %6.2f GB/s  (%.2f s)", what.c_str(), static_cast<double>(bytes) / seconds / 1e9,
                seconds);
  return buf;
}

Status SafetensorsBench::prepare() {
  if (options_.fio) {
    TRESTLE_ASSIGN_OR_RETURN(fio_version_, fio_version());
  }
  std::string python, script;
  if (options_.python) {
    TRESTLE_ASSIGN_OR_RETURN(python, find_python(options_.python_path));
    TRESTLE_ASSIGN_OR_RETURN(script, peer_script(options_.peers_dir, "safetensors_peer.py"));
  }
  shape_ = llama_shape_for_bytes(options_.size, DType::kBF16);
  auto specs = llama_tensor_specs(shape_, DType::kBF16);
  shards_ = plan_safetensors_shards(specs, options_.max_shard_bytes);
  std::uint64_t bytes = 0;
  for (const auto& s : specs) bytes += s.nbytes();
  const std::uint64_t copies = 1 + (options_.python ? 1 : 0) + (options_.fio ? 1 : 0);
  TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t available, free_bytes(scratch_.path()));
  if (available < copies * bytes + bytes / 10)
    return Status::Error(scratch_.path() + ": " + format_bytes(available) + " free, the benchmark needs about " +
                         format_bytes(copies * bytes + bytes / 10) + " (" + std::to_string(copies) + " copies of " +
                         format_bytes(bytes) + "); use --dir on a larger disk or a smaller --size");
  progress("state dict: " + std::to_string(specs.size()) + " bf16 tensors, " + format_bytes(bytes) + " (hidden " +
           std::to_string(shape_.hidden) + ", " + std::to_string(shape_.layers) + " layers), " +
           std::to_string(shards_.size()) + " shard(s), in " + scratch_.path());
  if (options_.python) {
    progress("starting the Python peer (" + python + ")");
    nlohmann::json spec = {{"dtype", "bf16"}, {"prefix", "model"}, {"shards", nlohmann::json::array()}};
    for (const auto& shard : shards_) {
      TRESTLE_ASSIGN_OR_RETURN(auto list, bf16_tensor_list(shard));
      spec["shards"].push_back(std::move(list));
    }
    TRESTLE_ASSIGN_OR_RETURN(peer_, PeerClient::start(python, script, scratch_.fresh("peer-spec.json"), spec));
  }
  state_.emplace(std::move(specs));
  return OkStatus();
}

Status SafetensorsBench::write_trestle() {
  trestle_dir_ = scratch_.fresh("trestle");
  Stopwatch clock;
  TRESTLE_RETURN_IF_ERROR(write_with_trestle(*state_, trestle_dir_, options_.max_shard_bytes));
  const double seconds = clock.seconds();
  figures_.trestle_write.add(seconds, state_->total_bytes());
  progress(rate_line("trestle write", seconds, state_->total_bytes()));
  if (!target_) {
    TRESTLE_ASSIGN_OR_RETURN(target_, ReadTarget::for_checkpoint(trestle_dir_));
  }
  return OkStatus();
}

Status SafetensorsBench::write_python() {
  const bool first = python_dir_.empty();
  python_dir_ = scratch_.fresh("python");
  TRESTLE_ASSIGN_OR_RETURN(const double seconds, peer_->seconds("write " + python_dir_));
  figures_.python_write.add(seconds, state_->total_bytes());
  progress(rate_line("python save_file write", seconds, state_->total_bytes()));
  return first ? check_python_checkpoint() : OkStatus();
}

// The peer must have written what Trestle wrote: the same tensors, shapes and dtypes, hence the same bytes to read.
Status SafetensorsBench::check_python_checkpoint() {
  TRESTLE_ASSIGN_OR_RETURN(const auto ckpt, SafetensorsCheckpoint::open(python_dir_));
  std::uint64_t bytes = 0;
  for (const auto& spec : state_->specs()) {
    auto view = ckpt.view(spec.name);
    if (!view.ok() || view->dtype != spec.dtype || view->shape != spec.shape)
      return Status::Error(python_dir_ + ": the Python peer wrote tensor '" + spec.name + "' differently");
    bytes += view->nbytes();
  }
  if (ckpt.size() != state_->size() || bytes != state_->total_bytes())
    return Status::Error(python_dir_ + ": the Python peer wrote other tensors than Trestle");
  return OkStatus();
}

Status SafetensorsBench::read_trestle(ReadMethod method, bool cold) {
  if (cold) TRESTLE_RETURN_IF_ERROR(evict_from_page_cache(trestle_dir_));
  Stopwatch clock;
  TRESTLE_RETURN_IF_ERROR(read_with_trestle(trestle_dir_, *target_, method, options_.threads));
  const double seconds = clock.seconds();
  (cold ? figures_.trestle_cold : figures_.trestle_warm)[method].add(seconds, state_->total_bytes());
  progress(rate_line(std::string("trestle read (") + (cold ? "cold, " : "warm, ") + read_method_name(method) + ")",
                     seconds, state_->total_bytes()));
  if (verified_[method] || method == ReadMethod::kView) return OkStatus();  // a view copies nothing to check
  verified_[method] = true;
  return target_->check_equal(*state_).with_context(trestle_dir_ + " (read with " + read_method_name(method) + ")");
}

Status SafetensorsBench::read_python(bool cold) {
  if (cold) TRESTLE_RETURN_IF_ERROR(evict_from_page_cache(python_dir_));
  // seconds: load_file of every shard, then one touch per page; load_file_seconds: until load_file returned (lazy).
  TRESTLE_ASSIGN_OR_RETURN(const nlohmann::json timing, peer_->ask("read " + python_dir_));
  const double seconds = timing.value("seconds", 0.0);
  (cold ? figures_.python_cold : figures_.python_warm).add(seconds, state_->total_bytes());
  if (cold) figures_.python_load_file_returned.add(timing.value("load_file_seconds", 0.0), state_->total_bytes());
  progress(rate_line(std::string("python load_file (") + (cold ? "cold)" : "warm)"), seconds, state_->total_bytes()));
  return OkStatus();
}

Status SafetensorsBench::measure_fio() {
  TRESTLE_ASSIGN_OR_RETURN(const FioCeiling ceiling,
                           measure_fio_ceiling(scratch_.fresh("fio.dat"), state_->total_bytes()));
  figures_.fio_write.add_rate(ceiling.write_bytes_per_s);
  figures_.fio_read.add_rate(ceiling.read_bytes_per_s);
  char buf[96];
  std::snprintf(buf, sizeof buf, "fio ceiling: write %.2f GB/s, read %.2f GB/s", ceiling.write_bytes_per_s / 1e9,
                ceiling.read_bytes_per_s / 1e9);
  progress(buf);
  return OkStatus();
}

// Trestle and Python take turns going first, so neither always meets the disk right after the other's writes.
Status SafetensorsBench::run_round(unsigned round) {
  progress("round " + std::to_string(round + 1) + " of " + std::to_string(options_.repeat));
  const bool python_first = options_.python && round % 2 == 1;
  auto both = [&](auto trestle_step, auto python_step) -> Status {
    if (python_first) TRESTLE_RETURN_IF_ERROR(python_step());
    TRESTLE_RETURN_IF_ERROR(trestle_step());
    if (options_.python && !python_first) TRESTLE_RETURN_IF_ERROR(python_step());
    return OkStatus();
  };
  TRESTLE_RETURN_IF_ERROR(both([&] { return write_trestle(); }, [&] { return write_python(); }));
  auto trestle_reads = [&](bool cold) -> Status {
    for (ReadMethod m : cold ? options_.cold_methods : options_.warm_methods) {
      if (!cold) TRESTLE_RETURN_IF_ERROR(read_with_trestle(trestle_dir_, *target_, m, options_.threads));  // warm up
      TRESTLE_RETURN_IF_ERROR(read_trestle(m, cold));
    }
    return OkStatus();
  };
  auto python_read = [&](bool cold) -> Status {
    if (!cold) TRESTLE_RETURN_IF_ERROR(peer_->ask("read " + python_dir_).status());  // warm up
    return read_python(cold);
  };
  TRESTLE_RETURN_IF_ERROR(both([&] { return trestle_reads(true); }, [&] { return python_read(true); }));
  if (options_.warm)
    TRESTLE_RETURN_IF_ERROR(both([&] { return trestle_reads(false); }, [&] { return python_read(false); }));
  return options_.fio ? measure_fio() : OkStatus();
}

struct Row {
  std::string name;
  const Samples* trestle;
  const Samples* python;
  const Samples* fio;
};

std::string ratio_cell(const Samples* a, const Samples* b, bool with_median) {
  if (a == nullptr || b == nullptr || a->empty() || b->empty()) return "-";
  std::string cell = format_ratio(a->best(), b->best());
  return with_median ? cell + " / " + format_ratio(a->median(), b->median()) : cell;
}

void SafetensorsBench::print_table() const {
  const bool median = options_.repeat >= 3;
  std::vector<Row> rows = {{"write", &figures_.trestle_write, &figures_.python_write, &figures_.fio_write}};
  for (const auto& [method, samples] : figures_.trestle_cold)
    rows.push_back({std::string("read, cold (") + read_method_name(method) + ")", &samples, &figures_.python_cold,
                    &figures_.fio_read});
  for (const auto& [method, samples] : figures_.trestle_warm)
    rows.push_back(
        {std::string("read, warm (") + read_method_name(method) + ")", &samples, &figures_.python_warm, nullptr});
  std::vector<std::string> header = {"GB/s" + std::string(median ? " (best / median)" : " (best)"), "Trestle"};
  if (options_.python) header.push_back("Python");
  if (options_.fio) header.push_back("fio");
  if (options_.python) header.push_back("Trestle/Python");
  if (options_.fio) header.push_back("Trestle/fio");
  Table table(header);
  for (const Row& r : rows) {
    std::vector<std::string> cells = {r.name, format_rate(*r.trestle, median)};
    if (options_.python) cells.push_back(format_rate(*r.python, median));
    if (options_.fio) cells.push_back(r.fio ? format_rate(*r.fio, median) : "-");
    if (options_.python) cells.push_back(ratio_cell(r.trestle, r.python, median));
    if (options_.fio) cells.push_back(ratio_cell(r.trestle, r.fio, median));
    table.add(std::move(cells));
  }
  std::printf("trestle bench safetensors: %s bf16 in %zu shard(s), %u round(s), %s\n",
              format_bytes(state_->total_bytes()).c_str(), shards_.size(), options_.repeat, scratch_.path().c_str());
  table.print(stdout, {false, true, true, true, true, true});
  if (!options_.python) std::printf("Python peer skipped (--no-python)\n");
  if (!options_.fio) std::printf("fio ceiling skipped (--no-fio)\n");
}

nlohmann::json SafetensorsBench::report() const {
  nlohmann::ordered_json shape = {{"hidden", shape_.hidden},     {"intermediate", shape_.intermediate},
                                  {"layers", shape_.layers},     {"heads", shape_.heads},
                                  {"kv_heads", shape_.kv_heads}, {"vocab", shape_.vocab}};
  nlohmann::json results;
  results["write"] = {{"trestle", figures_.trestle_write.to_json()}};
  for (const auto& [method, s] : figures_.trestle_cold)
    results["read_cold"]["trestle_" + std::string(read_method_name(method))] = s.to_json();
  for (const auto& [method, s] : figures_.trestle_warm)
    results["read_warm"]["trestle_" + std::string(read_method_name(method))] = s.to_json();
  if (options_.python) {
    results["write"]["python"] = figures_.python_write.to_json();
    results["read_cold"]["python"] = figures_.python_cold.to_json();
    results["read_cold"]["python_load_file_returned"] = figures_.python_load_file_returned.to_json();
    if (options_.warm) results["read_warm"]["python"] = figures_.python_warm.to_json();
  }
  if (options_.fio) {
    results["write"]["fio"] = figures_.fio_write.to_json();
    results["read_cold"]["fio"] = figures_.fio_read.to_json();
  }
  return {{"benchmark", "safetensors"},
          {"unit", "GB/s = 1e9 bytes per second"},
          {"requested_bytes", options_.size},
          {"state_dict_bytes", state_->total_bytes()},
          {"tensors", state_->size()},
          {"dtype", "bf16"},
          {"shape", shape},
          {"max_shard_bytes", options_.max_shard_bytes},
          {"shards", shards_.size()},
          {"repeat", options_.repeat},
          {"threads", options_.threads},
          {"dir", scratch_.path()},
          {"machine", machine_facts()},
          {"python_peer", options_.python ? peer_->facts() : nlohmann::json("skipped (--no-python)")},
          {"fio", options_.fio ? nlohmann::json(fio_version_) : nlohmann::json("skipped (--no-fio)")},
          {"results", results}};
}

}  // namespace

namespace {

Result<std::uint64_t> parse_size_option(const cxxopts::ParseResult& args, const std::string& name) {
  auto bytes = parse_byte_size(args[name].as<std::string>());
  if (!bytes.ok()) return bytes.status().with_context("--" + name);
  if (*bytes == 0) return Status::Error("--" + name + " must be more than 0 bytes");
  return bytes;
}

// "direct", "mmap,view" or "all".
Result<std::vector<ReadMethod>> parse_read_methods(const cxxopts::ParseResult& args, const std::string& name) {
  const std::string text = args[name].as<std::string>();
  if (text == "all") return std::vector<ReadMethod>(std::begin(kAllReadMethods), std::end(kAllReadMethods));
  std::vector<ReadMethod> methods;
  for (std::size_t start = 0; start <= text.size();) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    const auto method = parse_read_method(text.substr(start, end - start));
    if (!method)
      return Status::Error("--" + name + " '" + text + "': expected mmap, pread, direct, view, a list of them, or all");
    methods.push_back(*method);
    start = end + 1;
  }
  return methods;
}

Result<SafetensorsOptions> parse_options(const cxxopts::ParseResult& args) {
  SafetensorsOptions o;
  TRESTLE_ASSIGN_OR_RETURN(static_cast<BenchOptions&>(o), parse_bench_options(args, kOptionSet));
  TRESTLE_ASSIGN_OR_RETURN(o.max_shard_bytes, parse_size_option(args, "max-shard-size"));
  TRESTLE_ASSIGN_OR_RETURN(o.cold_methods, parse_read_methods(args, "read-method"));
  TRESTLE_ASSIGN_OR_RETURN(o.warm_methods, parse_read_methods(args, "warm-read-method"));
  o.warm = !args.count("no-warm");
  return o;
}

cxxopts::Options option_spec() {
  cxxopts::Options spec(
      "trestle bench safetensors",
      "Write and read a Llama-shaped bf16 state dict as a sharded Hugging Face checkpoint, with Trestle\n"
      "(ShardedSafetensorsWriter; reads into memory allocated beforehand) and with safetensors' Python\n"
      "save_file / load_file, in alternating rounds, beside fio's ceiling (O_DIRECT, 1 MiB, io_uring, depth 32)\n"
      "on the same disk. Writes include fsync; reads are cold (files evicted from the page cache) and, unless\n"
      "--no-warm, warm. Prints the best GB/s (10^9 bytes/s) of each, and the median from 3 rounds on.");
  spec.add_options()("max-shard-size", "largest shard, cut as save_pretrained does",
                     cxxopts::value<std::string>()->default_value("1GB"))(
      "read-method",
      "how Trestle reads cold files: direct (io_uring + O_DIRECT), mmap or pread (copies into memory allocated "
      "beforehand), view (zero-copy mapped views, every page touched), a comma-separated list, or all",
      cxxopts::value<std::string>()->default_value("direct"))(
      "warm-read-method",
      "the same for warm reads (default view: the work Python's load_file does, mapping and touching every page)",
      cxxopts::value<std::string>()->default_value("view"))("no-warm", "skip the warm-cache reads");
  add_bench_options(spec, kOptionSet);
  return spec;
}

}  // namespace

int bench_safetensors_main(int argc, char** argv) {
  auto spec = option_spec();
  return run_bench_main<SafetensorsOptions>("trestle bench safetensors", spec, parse_options,
                                            run_bench_rounds<SafetensorsBench, SafetensorsOptions>, argc, argv);
}

}  // namespace trestle::cli
