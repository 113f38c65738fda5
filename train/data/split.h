// Megatron's train/valid/test split: "969,30,1" normalized to fractions, turned into book-ends, and each split's
// range of documents (sequences, for GPT) rounded as Python's round() does.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>

#include "ckpt/status.h"

namespace trestle::data {

enum class Split { kTrain = 0, kValid = 1, kTest = 2 };
constexpr std::array<Split, 3> kSplits = {Split::kTrain, Split::kValid, Split::kTest};
const char* split_name(Split split);  // "train", "valid", "test"

// Per split, its [begin, end) fraction of the dataset, or nullopt when the split is empty.
using SplitMatrix = std::array<std::optional<std::pair<double, double>>, 3>;

// "969,30,1" (also "99,1", missing parts 0) -> the normalized split matrix.
Result<SplitMatrix> parse_split(const std::string& split);

// The [begin, end) documents of one split of num_documents.
std::pair<std::size_t, std::size_t> split_range(const std::pair<double, double>& bookends, std::size_t num_documents);

}  // namespace trestle::data
