// Test support: a global tensor of seeded random bytes and the elements of any piece of it, gathered element by
// element (independent of the planner under test).
#pragma once

#include <random>
#include <string>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/dtype.h"

namespace trestle::testing {

// The global (row-major) flat index of each element of `piece` of a tensor of `shape`, in the piece's order.
inline std::vector<std::int64_t> global_indices(const Shape& shape, const Piece& piece) {
  std::vector<std::int64_t> out;
  for (std::int64_t local = piece.first_element(); local < piece.first_element() + piece.numel(); ++local) {
    std::int64_t rem = local, global = 0, stride = 1;
    Shape coord(shape.size());
    for (std::size_t d = shape.size(); d-- > 0;) {
      coord[d] = rem % piece.box.shape[d] + piece.box.offset[d];
      rem /= piece.box.shape[d];
    }
    for (std::size_t d = shape.size(); d-- > 0;) {
      global += coord[d] * stride;
      stride *= shape[d];
    }
    out.push_back(global);
  }
  return out;
}

struct GlobalTensor {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::byte> bytes;

  GlobalTensor(std::string n, DType d, Shape s, unsigned seed) : name(std::move(n)), dtype(d), shape(std::move(s)) {
    bytes.resize(static_cast<std::size_t>(numel(shape)) * dtype_size(dtype));
    std::mt19937 rng(seed);
    for (auto& b : bytes) b = static_cast<std::byte>(rng());
  }

  std::vector<std::byte> extract(const Piece& p) const;
};

inline std::vector<std::byte> GlobalTensor::extract(const Piece& p) const {
  const auto es = static_cast<std::int64_t>(dtype_size(dtype));
  std::vector<std::byte> out;
  for (std::int64_t g : global_indices(shape, p))
    out.insert(out.end(), bytes.begin() + g * es, bytes.begin() + (g + 1) * es);
  return out;
}

// Part i of `parts` near-equal parts of dimension `dim`.
inline Piece split_part(const Shape& shape, std::size_t dim, int parts, int i) {
  Piece p{whole_box(shape), std::nullopt};
  const std::int64_t lo = shape[dim] * i / parts, hi = shape[dim] * (i + 1) / parts;
  p.box.offset[dim] = lo;
  p.box.shape[dim] = hi - lo;
  return p;
}

// Part i of `parts` near-equal flat ranges of a piece (the distributed optimizer's shard of a parameter).
inline Piece flat_part(Piece p, int parts, int i) {
  const std::int64_t n = p.box.numel();
  p.flat = FlatRange{n * i / parts, n * (i + 1) / parts};
  return p;
}

}  // namespace trestle::testing
