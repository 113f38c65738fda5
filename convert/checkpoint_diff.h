// Comparing two checkpoints in canonical (layout-free) space, tensor by tensor: whatever formats and layouts wrote
// them, each tensor is read back whole-row slice by slice from both and compared bit for bit; where bits differ, the
// values are compared in f64 (NaN equals NaN of any payload, +0 equals -0) and the largest absolute and relative
// differences computed. Memory stays at two slices, whatever the tensor sizes.
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
  std::string detail;               // for kIncompatible: the dtypes or shapes that disagree
  std::int64_t elements = 0;        // compared
  std::int64_t differing = 0;       // elements whose values differ (NaNs of any payload and +0 / -0 count as equal)
  std::int64_t bits_differing = 0;  // elements whose bytes differ: the differing ones and equal values stored apart
  std::int64_t non_finite = 0;  // differing elements with a NaN or an infinity on either side: never within a tolerance
  double max_abs = 0;  // +inf when a differing element is NaN or infinite on a side; NaN for dtypes without arithmetic
  double max_rel = 0;  // |a - b| / max(|a|, |b|) over differing elements, +inf and NaN likewise
  // kEqual with no byte differing; a kEqual tensor may still hold equal values in other bits (+0 / -0, NaN payloads).
  bool bit_equal() const { return kind == Kind::kEqual && bits_differing == 0; }
  // kEqual, or kDifferent with its largest absolute difference at most atol or its largest relative difference at most
  // rtol, and no NaN or infinity against another value.
  bool within(double atol, double rtol) const;
};

struct CheckpointDiff {
  std::vector<TensorDiff> tensors;  // in name order
  bool identical() const;           // every tensor kEqual: equal in value, element by element
  bool bit_identical() const;       // every tensor bit_equal()
  // Every tensor present in both with equal dtype and shape, and each within(atol, rtol).
  bool within(double atol, double rtol) const;
};

class CanonicalSource;
// Any two checkpoints seen as canonical tensors (canonical_source.h): Trestle, torch_dist or legacy, any layouts.
Result<CheckpointDiff> diff_checkpoints(const CanonicalSource& first, const CanonicalSource& second,
                                        bool progress = false);

std::string_view diff_kind_name(TensorDiff::Kind kind);

}  // namespace trestle
