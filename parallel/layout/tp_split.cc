#include "parallel/layout/tp_split.h"

#include <algorithm>
#include <string>

namespace trestle {
namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

}  // namespace

Status check_divides(std::int64_t count, std::int64_t parts, const std::string& what, const std::string& parts_name) {
  if (parts <= 0 || count % parts != 0)
    return Status::Error(what + " (" + str(count) + ") is not divisible by " +
                         (parts_name.empty() ? str(parts) : parts_name + " (" + str(parts) + ")"));
  return OkStatus();
}

std::string_view tp_split_name(TpSplit split) {
  switch (split) {
    case TpSplit::kReplicated:
      return "replicated";
    case TpSplit::kColumn:
      return "column";
    case TpSplit::kRow:
      return "row";
    case TpSplit::kVocab:
      return "vocab";
    case TpSplit::kGatedColumn:
      return "gated-column";
  }
  return "?";
}

Result<std::vector<Box>> tp_boxes(TpSplit split, const Shape& shape, int tp, int tp_rank, std::int64_t padded_rows) {
  const auto where = [&] {
    return std::string(tp_split_name(split)) + " split of " + to_string(shape) + " over tp " + str(tp);
  };
  Box whole = whole_box(shape);
  switch (split) {
    case TpSplit::kReplicated:
      return std::vector<Box>{whole};
    case TpSplit::kColumn:
    case TpSplit::kRow: {
      const std::size_t dim = split == TpSplit::kColumn ? 0 : 1;
      if (shape.size() <= dim) return Status::Error(where() + ": tensor has too few dimensions");
      TRESTLE_RETURN_IF_ERROR(
          check_divides(shape[dim], tp, where() + ": dimension " + str(static_cast<std::int64_t>(dim))));
      const std::int64_t part = shape[dim] / tp;
      whole.offset[dim] = part * tp_rank;
      whole.shape[dim] = part;
      return std::vector<Box>{whole};
    }
    case TpSplit::kVocab: {
      if (shape.empty() || padded_rows < shape[0] || padded_rows % tp != 0)
        return Status::Error(where() + ": padded vocab " + str(padded_rows) +
                             " is not a multiple of tp covering the vocab");
      const std::int64_t part = padded_rows / tp;
      const std::int64_t begin = std::min(part * tp_rank, shape[0]);
      const std::int64_t end = std::min(part * (tp_rank + 1), shape[0]);
      if (begin == end) return std::vector<Box>{};
      whole.offset[0] = begin;
      whole.shape[0] = end - begin;
      return std::vector<Box>{whole};
    }
    case TpSplit::kGatedColumn: {
      if (shape.empty() || shape[0] % 2 != 0) return Status::Error(where() + ": dim 0 is not [gate; up]");
      const std::int64_t half = shape[0] / 2;
      TRESTLE_RETURN_IF_ERROR(check_divides(half, tp, where() + ": gate rows"));
      const std::int64_t part = half / tp;
      Box gate = whole, up = whole;
      gate.offset[0] = part * tp_rank;
      gate.shape[0] = part;
      up.offset[0] = half + part * tp_rank;
      up.shape[0] = part;
      return std::vector<Box>{gate, up};
    }
  }
  return Status::Error("unknown split");
}

}  // namespace trestle
