#include "tools/bench_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "ckpt/byte_size.h"
#include "tools/bench_report.h"

namespace trestle::cli {

void add_checkpoint_bench_options(cxxopts::Options& spec) {
  spec.add_options()("size", "state dict size", cxxopts::value<std::string>()->default_value("2GiB"))(
      "dir", "where to write (default: a fresh directory under $TMPDIR or /tmp); cleaned up afterwards",
      cxxopts::value<std::string>()->default_value(""))("repeat", "rounds", cxxopts::value<int>()->default_value("2"))(
      "json-out", "also write every figure as JSON to this file", cxxopts::value<std::string>()->default_value(""))(
      "threads", "Trestle's copy and checksum threads (0: one per CPU, at least 2)",
      cxxopts::value<int>()->default_value("0"))("no-fio", "skip the fio ceiling")(
      "no-python", "skip the PyTorch peers (DCP, torch.save)")(
      "python",
      "Python with torch (default: $TRESTLE_PYTHON, $TRESTLE_VENV/bin/python, ~/.cache/trestle/venv/bin/python)",
      cxxopts::value<std::string>()->default_value(""))(
      "peers-dir", "folder holding torch_checkpoint_peer.py (default: tools/peers of the sources)",
      cxxopts::value<std::string>()->default_value(""))("h,help", "show this help");
}

Result<CheckpointBenchOptions> parse_checkpoint_bench_options(const cxxopts::ParseResult& args) {
  CheckpointBenchOptions o;
  auto size = parse_byte_size(args["size"].as<std::string>());
  if (!size.ok()) return size.status().with_context("--size");
  if (*size == 0) return Status::Error("--size must be more than 0 bytes");
  o.size = *size;
  const int repeat = args["repeat"].as<int>(), threads = args["threads"].as<int>();
  if (repeat < 1) return Status::Error("--repeat must be at least 1");
  if (threads < 0) return Status::Error("--threads must be 0 (one per CPU) or more");
  o.repeat = static_cast<unsigned>(repeat);
  o.threads = threads > 0 ? static_cast<unsigned>(threads) : std::max(2u, std::thread::hardware_concurrency());
  o.dir = args["dir"].as<std::string>();
  o.json_out = args["json-out"].as<std::string>();
  o.fio = !args.count("no-fio");
  o.python = !args.count("no-python");
  o.python_path = args["python"].as<std::string>();
  o.peers_dir = args["peers-dir"].as<std::string>();
  return o;
}

Piece tp_piece(const Shape& shape, int tp, int rank) {
  Piece piece{whole_box(shape), std::nullopt};
  if (shape.size() != 2) return piece;
  const std::int64_t lo = shape[0] * rank / tp, hi = shape[0] * (rank + 1) / tp;
  piece.box.offset[0] = lo;
  piece.box.shape[0] = hi - lo;
  return piece;
}

std::vector<SaveItem> tp_save_items(const StateDict& state, int tp, int rank) {
  std::vector<SaveItem> items;
  for (std::size_t i = 0; i < state.size(); ++i) {
    const TensorSpec& spec = state.specs()[i];
    const Piece piece = tp_piece(spec.shape, tp, rank);
    const std::uint64_t row_bytes =
        spec.shape.size() == 2 ? spec.nbytes() / static_cast<std::uint64_t>(spec.shape[0]) : 0;
    const std::uint64_t start =
        static_cast<std::uint64_t>(piece.box.offset.empty() ? 0 : piece.box.offset[0]) * row_bytes;
    items.push_back({spec.name, spec.dtype, spec.shape, piece, state.bytes(i).data() + start});
  }
  return items;
}

nlohmann::json checkpoint_report(const std::string& benchmark, const CheckpointBenchOptions& options,
                                 const StateDict& state, const LlamaShape& shape, const std::string& dir,
                                 const nlohmann::json& peer_facts, const std::string& fio_version) {
  return {{"benchmark", benchmark},
          {"unit", "GB/s = 1e9 bytes per second"},
          {"requested_bytes", options.size},
          {"state_dict_bytes", state.total_bytes()},
          {"tensors", state.size()},
          {"dtype", "bf16"},
          {"shape", {{"hidden", shape.hidden}, {"layers", shape.layers}, {"vocab", shape.vocab}}},
          {"repeat", options.repeat},
          {"dir", dir},
          {"machine", machine_facts()},
          {"python_peer", options.python ? peer_facts : nlohmann::json("skipped (--no-python)")},
          {"fio", options.fio ? nlohmann::json(fio_version) : nlohmann::json("skipped (--no-fio)")}};
}

std::string rate_line(const std::string& what, double seconds, std::uint64_t bytes) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%-34s %6.2f GB/s  (%.2f s)", what.c_str(), static_cast<double>(bytes) / seconds / 1e9,
                seconds);
  return buf;
}

}  // namespace trestle::cli
