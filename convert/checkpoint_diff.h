// Comparing two checkpoints in canonical (layout-free) space, tensor by tensor: whatever formats and layouts wrote
// them, each tensor is read back whole-row slice by slice from both and compared bit for bit; where bits differ, the
// largest absolute and relative differences are computed in f64. Memory stays at two slices, whatever the tensor sizes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

struct TensorDiff {
  enum class Kind { kEqual, kDifferent, kOnlyInFirst, kOnlyInSecond, kIncompatible };
  std::string name;
  Kind kind = Kind::kEqual;
  std::string detail;          // for kIncompatible: the dtypes or shapes that disagree
  std::int64_t elements = 0;   // compared
  std::int64_t differing = 0;  // elements whose bits differ (NaNs of any payload count as equal)
  double max_abs = 0;          // +inf when only one side is NaN or infinite; NaN for dtypes without arithmetic (fp8)
  double max_rel = 0;          // |a - b| / max(|a|, |b|) over differing elements
};

struct CheckpointDiff {
  std::vector<TensorDiff> tensors;  // in name order
  bool identical() const;
  // Every tensor present in both with equal dtype and shape, and each differing tensor's largest absolute difference
  // at most atol or its largest relative difference at most rtol.
  bool within(double atol, double rtol) const;
};

class CanonicalSource;
// Any two checkpoints seen as canonical tensors (canonical_source.h): Trestle, torch_dist or legacy, any layouts.
Result<CheckpointDiff> diff_checkpoints(const CanonicalSource& first, const CanonicalSource& second,
                                        bool progress = false);

std::string_view diff_kind_name(TensorDiff::Kind kind);

}  // namespace trestle
