// Compares a checkpoint of any format (canonical_source.h) with a Hugging Face model tensor by tensor, after undoing
// the Megatron layout: each canonical tensor is loaded from the checkpoint and rebuilt from the Hugging Face tensors by
// the same plan the converter uses, and their largest absolute difference is reported (0 for a lossless conversion).
#pragma once

#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

struct TensorDifference {
  std::string name;
  double max_abs_diff = 0;  // +inf when NaNs disagree
};

struct BridgeComparison {
  std::vector<TensorDifference> tensors;
  double max_abs_diff = 0;
};

// Fails (as an error, not a difference) when the two do not hold the same set of tensors with the same shapes.
class CanonicalSource;
Result<BridgeComparison> compare_with_hf(const CanonicalSource& checkpoint, const std::string& hf_dir);

}  // namespace trestle
