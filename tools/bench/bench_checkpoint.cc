#include "tools/bench/bench_checkpoint.h"

#include <algorithm>
#include <cstdio>

#include "ckpt/byte_size.h"
#include "tools/bench/bench_report.h"

namespace trestle::cli {

Result<CheckpointBenchOptions> parse_checkpoint_bench_options(const cxxopts::ParseResult& args) {
  return parse_bench_options(args, kCheckpointBenchOptionSet);
}

Result<std::unique_ptr<PeerClient>> start_torch_checkpoint_peer(const std::string& python, const std::string& peers_dir,
                                                                const std::string& spec_path,
                                                                const std::vector<TensorSpec>& tensors) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string script, peer_script(peers_dir, "torch_checkpoint_peer.py"));
  TRESTLE_ASSIGN_OR_RETURN(auto list, bf16_tensor_list(tensors));
  return PeerClient::start(python, script, spec_path, {{"dtype", "bf16"}, {"tensors", std::move(list)}});
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
