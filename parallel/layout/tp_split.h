// How a canonical tensor is split over the tensor-parallel ranks, as boxes of its canonical (layout-independent) global
// tensor: vocab unpadded, QKV in Megatron's per-group order (so TP's contiguous split of groups is a dim-0 split),
// gated fc1 as [all gate; all up] (so a rank's piece is two boxes).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/status.h"

namespace trestle {

enum class TpSplit {
  kReplicated,   // every TP rank holds all of it (norms, router)
  kColumn,       // dim 0 in tp equal parts (linear_qkv weight and bias, column-parallel linears)
  kRow,          // dim 1 in tp equal parts (linear_proj, linear_fc2: row-parallel linears)
  kVocab,        // dim 0 of the padded vocab in tp equal parts; the padding rows are not part of the tensor
  kGatedColumn,  // [gate; up] along dim 0: rank r holds gate rows r and up rows r (two boxes)
};
std::string_view tp_split_name(TpSplit split);

// An error naming `what` unless `count` splits into `parts` equal parts; `parts_name` says what `parts` is (the
// parallel size it comes from, e.g. "the tensor-parallel size").
Status check_divides(std::int64_t count, std::int64_t parts, const std::string& what,
                     const std::string& parts_name = "");

// The boxes of a tensor with canonical global shape `shape` that TP rank tp_rank holds (empty when a vocab split
// leaves this rank only padding). padded_rows is the padded vocab for kVocab and unused otherwise.
Result<std::vector<Box>> tp_boxes(TpSplit split, const Shape& shape, int tp, int tp_rank, std::int64_t padded_rows = 0);

}  // namespace trestle
