// Benchmark fixtures shared by the conversion and reshard benchmarks: a generated Llama-shaped bf16 Hugging Face model
// on disk, and a child process run for its own wall time and peak RSS.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "tools/bench_state_dict.h"

namespace trestle::cli {

// A Llama shape near `bytes` whose layers split over pp and KV heads and ffn over tp.
Result<LlamaShape> llama_shape_for_layout(std::uint64_t bytes, int tp, int pp);
// Writes config.json and sharded safetensors (1 GB shards) of random bf16 weights into dir.
Status write_llama_hf_model(const std::string& dir, const LlamaShape& shape);

struct ChildRun {
  double seconds = 0;
  std::uint64_t peak_rss = 0;
  std::string out;
};
// Runs argv to completion with stdout captured; wall time and the child's own peak RSS (wait4).
Result<ChildRun> run_child(const std::vector<std::string>& argv);
// This executable (to run the CLI's own commands as children).
std::string self_exe();

}  // namespace trestle::cli
