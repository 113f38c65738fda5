// What `trestle bench save` and `trestle bench load` share: their common options, the generated Llama-shaped bf16
// state dict cut into a tensor-parallel rank's save items, and the one-line progress reports.
#pragma once

#include <cstdint>
#include <cxxopts.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/save.h"
#include "tools/bench_state_dict.h"

namespace trestle::cli {

struct CheckpointBenchOptions {
  std::uint64_t size = 0;
  std::string dir;
  unsigned repeat = 2;
  std::string json_out;
  bool fio = true;
  bool python = true;
  std::string python_path;
  std::string peers_dir;
  unsigned threads = 0;
};

// Adds --size, --dir, --repeat, --json-out, --no-fio, --no-python, --python, --peers-dir, --threads and --help.
void add_checkpoint_bench_options(cxxopts::Options& spec);
Result<CheckpointBenchOptions> parse_checkpoint_bench_options(const cxxopts::ParseResult& args);

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
