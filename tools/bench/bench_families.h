// The Hugging Face config.json of a model of each family `bench train --arch` trains: the sizes given, the family's
// own options as its released models set them (Gemma's soft-caps and window pattern, GPT-OSS's YaRN and alternating
// windows, the MoE families' experts), the corpus tokenizer's vocabulary. Both trainers build the model from it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::cli {

struct BenchModelSizes {
  int hidden = 768, layers = 12, ffn = 2048, heads = 12, kv_heads = 12, vocab = 4096;
  int experts = 8, topk = 2;  // MoE families: experts per layer and per token; ffn is each expert's
};

// The families --arch takes, in the order --help lists them.
const std::vector<std::string>& bench_families();
// config.json for `family`; an error names the families for an unknown one.
Result<nlohmann::json> family_config(const std::string& family, const BenchModelSizes& sizes);

}  // namespace trestle::cli
