// The contract of the cast-and-pack kernels (the staging copy of a checkpoint save): one call takes a list of sources,
// each any strided view of up to kPackMaxDims dims, and writes each source's elements in row-major (logical) order,
// cast to its destination type, packed at its destination. Casts between float, bfloat16 and half round to nearest
// even as ATen's Tensor::to does (NaN stays NaN, its payload aside; infinities and subnormals as ATen converts them);
// a source whose type is its destination's moves its bytes unchanged, whatever the dtype. Plain C++17: the CUDA build
// (nvcc) includes it too.
#pragma once

#include <cstdint>

namespace trestle::kernels::cpu {

constexpr int kPackMaxDims = 8;

// The float types are cast between one another; any other dtype travels as elements of its size (then to == from).
enum class PackType : std::uint8_t { kFloat, kBFloat16, kHalf, kBytes1, kBytes2, kBytes4, kBytes8, kBytes16 };

constexpr int pack_type_bytes(PackType t) {
  switch (t) {
    case PackType::kBytes1:
      return 1;
    case PackType::kBFloat16:
    case PackType::kHalf:
    case PackType::kBytes2:
      return 2;
    case PackType::kFloat:
    case PackType::kBytes4:
      return 4;
    case PackType::kBytes8:
      return 8;
    case PackType::kBytes16:
      return 16;
  }
  return 0;
}
constexpr bool is_float_type(PackType t) {
  return t == PackType::kFloat || t == PackType::kBFloat16 || t == PackType::kHalf;
}

struct PackSource {
  const void* data = nullptr;   // the element at index (0, ..., 0); aligned to its type's size
  void* destination = nullptr;  // numel elements of `to`, packed; aligned to its size; overlaps no source
  std::int32_t dims = 0;        // 0 (a single element) to kPackMaxDims
  std::int64_t sizes[kPackMaxDims] = {};
  std::int64_t strides[kPackMaxDims] = {};  // in elements of `from`: any, 0 for a broadcast (expanded) dim
  PackType from = PackType::kFloat;
  PackType to = PackType::kFloat;  // differs from `from` only when both are float types
};

constexpr std::int64_t pack_numel(const PackSource& s) {
  std::int64_t n = 1;
  for (std::int32_t d = 0; d < s.dims; ++d) n *= s.sizes[d];
  return n;
}

// The same source with fewer dims where memory allows, for the fast paths: size-1 dims dropped, and each dim merged
// into the one before it when stepping the outer dim is stepping the inner one size times (a contiguous source becomes
// one dim of stride 1; an empty one keeps a dim of size 0). The elements and their order are unchanged.
constexpr PackSource coalesced(const PackSource& s) {
  PackSource out = s;
  out.dims = 0;
  if (pack_numel(s) == 0) {
    out.dims = 1;
    out.sizes[0] = 0;
    out.strides[0] = 1;
    return out;
  }
  for (std::int32_t d = 0; d < s.dims; ++d) {
    if (s.sizes[d] == 1) continue;
    if (out.dims > 0 && out.strides[out.dims - 1] == s.sizes[d] * s.strides[d]) {
      out.sizes[out.dims - 1] *= s.sizes[d];
      out.strides[out.dims - 1] = s.strides[d];
    } else {
      out.sizes[out.dims] = s.sizes[d];
      out.strides[out.dims] = s.strides[d];
      ++out.dims;
    }
  }
  return out;
}

// Its elements lie one after another in memory, in order (after coalesced(): at most one dim, of stride 1).
constexpr bool is_packed(const PackSource& coalesced_source) {
  return coalesced_source.dims == 0 || (coalesced_source.dims == 1 && coalesced_source.strides[0] == 1);
}

}  // namespace trestle::kernels::cpu
