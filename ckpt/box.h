// N-d boxes of a global tensor and the element runs two pieces share. A piece is a box, optionally restricted to a
// flat range [start, stop) of the box's row-major elements (distributed-optimizer shards). for_each_shared_run
// walks what two pieces have in common as runs contiguous in both, which is how every reshard copy is planned.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/shape.h"
#include "ckpt/status.h"

namespace trestle {

struct Box {
  Shape offset;
  Shape shape;
  std::int64_t numel() const { return trestle::numel(shape); }
  bool operator==(const Box&) const = default;
};

struct FlatRange {
  std::int64_t start = 0;
  std::int64_t stop = 0;
  bool operator==(const FlatRange&) const = default;
};

struct Piece {
  Box box;
  std::optional<FlatRange> flat;  // absent: the whole box
  std::int64_t numel() const { return flat ? flat->stop - flat->start : box.numel(); }
  std::int64_t first_element() const { return flat ? flat->start : 0; }  // flat index of the piece's first element
  bool operator==(const Piece&) const = default;
};

Box whole_box(const Shape& global_shape);
std::optional<Box> intersect(const Box& a, const Box& b);
bool box_within(const Box& inner, const Shape& global_shape);
std::string to_string(const Box& box);      // "[0:128, 64:128]"
std::string to_string(const Piece& piece);  // adds " flat [s, e)"

// A run of elements present in both pieces: `count` elements starting at element index `a_index` of piece a's data
// and `b_index` of piece b's data (indices count from the piece's first stored element).
struct SharedRun {
  std::int64_t a_index;
  std::int64_t b_index;
  std::int64_t count;
};

// Calls visit for every maximal run shared by a and b (same rank, same global tensor), in increasing order of
// a_index. Trailing dimensions that both boxes hold whole are merged into one run.
void for_each_shared_run(const Piece& a, const Piece& b, const std::function<void(const SharedRun&)>& visit);

// Number of elements a and b share.
std::int64_t shared_elements(const Piece& a, const Piece& b);

// Calls visit(i, j), i < j, for the pairs of boxes (indices into `boxes`: one rank, offsets and extents non-negative,
// as box_within makes them) that share an element, until visit returns false. A sweep along the dimension where the
// boxes' offsets are most varied, comparing each box only with those it meets along it: n pieces cut along one
// dimension take n log n, an r x c grid of tiles about r·c² comparisons, rather than all n² pairs. Empty boxes share
// nothing; rank-0 boxes share their one element.
void for_each_intersecting_pair(const std::vector<Box>& boxes,
                                const std::function<bool(std::size_t, std::size_t)>& visit);

// That `boxes` hold every element of a tensor of `global_shape` exactly once (each box within it, none sharing an
// element with another, their sizes adding up to the tensor's); else an error that names `where` and the boxes.
Status check_boxes_cover(const Shape& global_shape, const std::vector<Box>& boxes, const std::string& where);
// The same, or with `whole` false only within the shape and disjoint (a part of the tensor: one rank's pieces).
Status check_boxes(const Shape& global_shape, const std::vector<Box>& boxes, const std::string& where, bool whole);

}  // namespace trestle
