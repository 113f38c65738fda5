// Benchmark fixtures shared by the conversion and reshard benchmarks: a generated Llama-shaped bf16 Hugging Face model
// on disk, and the CLI that converts it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "tools/bench/bench_state_dict.h"

namespace trestle::cli {

// A Llama shape near `bytes` whose layers split over pp and KV heads and ffn over tp.
Result<LlamaShape> llama_shape_for_layout(std::uint64_t bytes, int tp, int pp);
// Writes config.json and sharded safetensors (1 GB shards) of random bf16 weights into dir.
Status write_llama_hf_model(const std::string& dir, const LlamaShape& shape);
// The `trestle` CLI beside this executable, whose commands the benchmarks run as children.
Result<std::string> trestle_exe();

}  // namespace trestle::cli
