// What `trestle bench save` and `trestle bench load` share: their options, their PyTorch peer, the generated
// Llama-shaped bf16 state dict cut into a tensor-parallel rank's save items, and the one-line progress reports.
#pragma once

#include <cstdint>
#include <cxxopts.hpp>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/save.h"
#include "tools/bench/bench_options.h"
#include "tools/bench/bench_peer.h"
#include "tools/bench/bench_state_dict.h"

namespace trestle::cli {

// Both take the shared options with --threads, and no more.
constexpr BenchOptionSet kCheckpointBenchOptionSet{
    .size = "2GiB",
    .size_help = "state dict size",
    .repeat = 2,
    .peer_help = "the PyTorch peers (DCP, torch.save)",
    .threads = true,
    .threads_help = "Trestle's copy and checksum threads (0: one per CPU, at least 2)"};
using CheckpointBenchOptions = BenchOptions;
Result<CheckpointBenchOptions> parse_checkpoint_bench_options(const cxxopts::ParseResult& args);

// Starts tools/bench/peers/torch_checkpoint_peer.py (found in peers_dir, see peer_script) holding `tensors` (bf16).
Result<std::unique_ptr<PeerClient>> start_torch_checkpoint_peer(const std::string& python, const std::string& peers_dir,
                                                                const std::string& spec_path,
                                                                const std::vector<TensorSpec>& tensors);

// Rank `rank` of `tp`'s piece of a tensor: 2-D tensors split along dim 0 into near-equal row ranges (as
// column-parallel weights are), other tensors whole on every rank.
Piece tp_piece(const Shape& shape, int tp, int rank);
// The state dict's tensors as rank `rank` of `tp` holds them, data pointing into the state dict.
std::vector<SaveItem> tp_save_items(const StateDict& state, int tp, int rank);

// The fields `bench save` and `bench load` reports share: the benchmark's name, sizes, shape, rounds, directory,
// machine, the peer's facts (null when --no-python) and fio's version (unless --no-fio).
nlohmann::json checkpoint_report(const std::string& benchmark, const CheckpointBenchOptions& options,
                                 const StateDict& state, const LlamaShape& shape, const std::string& dir,
                                 const nlohmann::json& peer_facts, const std::string& fio_version);

// "<what>  1.23 GB/s  (1.62 s)"
std::string rate_line(const std::string& what, double seconds, std::uint64_t bytes);

}  // namespace trestle::cli
