#include "ckpt/box.h"

#include <algorithm>
#include <limits>

namespace trestle {

Box whole_box(const Shape& global_shape) { return Box{Shape(global_shape.size(), 0), global_shape}; }

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.offset.size() != b.offset.size()) return std::nullopt;
  Box out{Shape(a.offset.size()), Shape(a.offset.size())};
  for (std::size_t d = 0; d < a.offset.size(); ++d) {
    const auto lo = std::max(a.offset[d], b.offset[d]);
    const auto hi = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    if (hi <= lo) return std::nullopt;
    out.offset[d] = lo;
    out.shape[d] = hi - lo;
  }
  return out;
}

bool box_within(const Box& inner, const Shape& global_shape) {
  if (inner.offset.size() != global_shape.size() || inner.shape.size() != global_shape.size()) return false;
  for (std::size_t d = 0; d < global_shape.size(); ++d)
    // offset + shape could overflow for hostile values: compare against what is left instead.
    if (inner.offset[d] < 0 || inner.shape[d] < 0 || inner.offset[d] > global_shape[d] ||
        inner.shape[d] > global_shape[d] - inner.offset[d])
      return false;
  return true;
}

std::string to_string(const Box& box) {
  std::string out = "[";
  for (std::size_t d = 0; d < box.offset.size(); ++d) {
    if (d) out += ", ";
    const std::int64_t offset = box.offset[d], extent = d < box.shape.size() ? box.shape[d] : 0;
    const bool wraps = extent > 0 && offset > std::numeric_limits<std::int64_t>::max() - extent;
    out += std::to_string(offset) + ":" + (wraps ? "+" + std::to_string(extent) : std::to_string(offset + extent));
  }
  return out + "]";
}

std::string to_string(const Piece& piece) {
  std::string out = to_string(piece.box);
  if (piece.flat) out += " flat [" + std::to_string(piece.flat->start) + ", " + std::to_string(piece.flat->stop) + ")";
  return out;
}

namespace {

// Row-major strides (in elements) of a box.
Shape strides_of(const Shape& shape) {
  Shape strides(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

}  // namespace

void for_each_shared_run(const Piece& a, const Piece& b, const std::function<void(const SharedRun&)>& visit) {
  const auto common = intersect(a.box, b.box);
  if (!common) {
    // Zero-dimensional tensors intersect as one element; empty boxes share nothing.
    if (!a.box.shape.empty() || !b.box.shape.empty()) return;
  }
  const Box box = common ? *common : Box{};
  const std::size_t rank = box.shape.size();
  const Shape a_strides = strides_of(a.box.shape), b_strides = strides_of(b.box.shape);

  // Merge trailing dimensions held whole by both boxes into the run, so a run is as long as possible.
  std::size_t split = rank;  // dimensions [split, rank) form the run
  std::int64_t run = 1;
  while (split > 0) {
    const std::size_t d = split - 1;
    run *= box.shape[d];
    --split;
    if (box.shape[d] != a.box.shape[d] || box.shape[d] != b.box.shape[d]) break;
  }
  const std::int64_t a_lo = a.flat ? a.flat->start : 0, a_hi = a.flat ? a.flat->stop : a.box.numel();
  const std::int64_t b_lo = b.flat ? b.flat->start : 0, b_hi = b.flat ? b.flat->stop : b.box.numel();

  Shape index(split, 0);  // position over the outer dimensions [0, split)
  while (true) {
    std::int64_t fa = 0, fb = 0;  // flat index of the run's first element within each box
    for (std::size_t d = 0; d < rank; ++d) {
      const std::int64_t g = box.offset[d] + (d < split ? index[d] : 0);
      fa += (g - a.box.offset[d]) * a_strides[d];
      fb += (g - b.box.offset[d]) * b_strides[d];
    }
    const std::int64_t k0 = std::max({std::int64_t{0}, a_lo - fa, b_lo - fb});
    const std::int64_t k1 = std::min({run, a_hi - fa, b_hi - fb});
    if (k1 > k0) visit(SharedRun{fa + k0 - a_lo, fb + k0 - b_lo, k1 - k0});
    std::size_t d = split;
    while (d > 0) {
      --d;
      if (++index[d] < box.shape[d]) break;
      index[d] = 0;
      if (d == 0) return;
    }
    if (split == 0) return;
  }
}

std::int64_t shared_elements(const Piece& a, const Piece& b) {
  std::int64_t total = 0;
  for_each_shared_run(a, b, [&](const SharedRun& r) { total += r.count; });
  return total;
}

}  // namespace trestle

namespace trestle {

void for_each_intersecting_pair(const std::vector<Box>& boxes,
                                const std::function<bool(std::size_t, std::size_t)>& visit) {
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < boxes.size(); ++i)
    if (boxes[i].shape.empty() || boxes[i].numel() > 0) order.push_back(i);
  if (order.empty()) return;
  const std::size_t rank = boxes[order.front()].offset.size();
  // The sweep's dimension: the one with the most distinct offsets (rank 0: every box meets every other).
  std::size_t sweep = 0, most = 0;
  for (std::size_t d = 0; d < rank; ++d) {
    std::vector<std::int64_t> offsets;
    offsets.reserve(order.size());
    for (std::size_t i : order) offsets.push_back(boxes[i].offset[d]);
    std::sort(offsets.begin(), offsets.end());
    const auto distinct = static_cast<std::size_t>(std::unique(offsets.begin(), offsets.end()) - offsets.begin());
    if (distinct > most) sweep = d, most = distinct;
  }
  auto start = [&](std::size_t i) { return rank ? boxes[i].offset[sweep] : 0; };
  // The end along the sweep, saturated (offsets and extents may come from a hostile file).
  auto end = [&](std::size_t i) {
    if (!rank) return std::int64_t{1};
    const std::int64_t o = boxes[i].offset[sweep], e = boxes[i].shape[sweep];
    return o > std::numeric_limits<std::int64_t>::max() - e ? std::numeric_limits<std::int64_t>::max() : o + e;
  };
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return start(a) < start(b); });
  auto meet = [](const Box& a, const Box& b) {  // intersect() without building the box, nor overflowing
    if (a.offset.size() != b.offset.size()) return false;
    for (std::size_t d = 0; d < a.offset.size(); ++d)
      if (a.offset[d] <= b.offset[d] ? b.offset[d] - a.offset[d] >= a.shape[d]
                                     : a.offset[d] - b.offset[d] >= b.shape[d])
        return false;
    return true;
  };
  std::vector<std::size_t> active;  // boxes that reach past the current start along the sweep
  for (std::size_t i : order) {
    std::erase_if(active, [&](std::size_t a) { return end(a) <= start(i); });
    for (std::size_t a : active)
      if (meet(boxes[a], boxes[i]) && !visit(std::min(a, i), std::max(a, i))) return;
    active.push_back(i);
  }
}

Status check_boxes_cover(const Shape& global_shape, const std::vector<Box>& boxes, const std::string& where) {
  return check_boxes(global_shape, boxes, where, /*whole=*/true);
}

Status check_boxes(const Shape& global_shape, const std::vector<Box>& boxes, const std::string& where, bool whole) {
  if (!checked_nbytes(global_shape, 1))
    return Status::Error(where + ": shape " + to_string(whole_box(global_shape)) +
                         " has a negative extent or too many elements");
  const std::int64_t total = numel(global_shape);
  std::int64_t held = 0;
  for (const Box& box : boxes) {
    if (!box_within(box, global_shape))
      return Status::Error(where + ": box " + to_string(box) + " is not within the tensor's shape " +
                           to_string(whole_box(global_shape)));
    held += box.numel();  // each at most `total`, so this stays in range until it passes it
    if (held > total) break;
  }
  std::optional<std::pair<std::size_t, std::size_t>> shared;
  for_each_intersecting_pair(boxes, [&](std::size_t a, std::size_t b) {
    shared = {a, b};
    return false;
  });
  if (shared)
    return Status::Error(where + ": chunks " + to_string(boxes[shared->first]) + " and " +
                         to_string(boxes[shared->second]) + " overlap (every element must be stored exactly once)");
  if (whole && held != total)
    return Status::Error(where + ": chunks hold " + std::to_string(held) + " of its " + std::to_string(total) +
                         " elements (part of it is stored nowhere)");
  return OkStatus();
}

}  // namespace trestle
