// Megatron's fused QKV order: for each KV group g (num_groups of them, num_heads / num_groups query heads each), the
// rows of its query heads, then key head g, then value head g; every head head_dim rows (one element per "row" for
// biases). TP splits whole groups contiguously, so a TP rank's part of the fused tensor is a dim-0 slice.
// qkv_blocks() is the one statement of that order; fusing, unfusing and the converter's copy plans all use it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

struct QkvLayout {
  std::int64_t num_heads = 0;   // query heads
  std::int64_t num_groups = 0;  // KV heads
  std::int64_t head_dim = 0;
  std::int64_t heads_per_group() const { return num_heads / num_groups; }
  std::int64_t query_rows() const { return num_heads * head_dim; }
  std::int64_t kv_rows() const { return num_groups * head_dim; }
  std::int64_t fused_rows() const { return query_rows() + 2 * kv_rows(); }
};
Status check_qkv_layout(const QkvLayout& layout);

enum class QkvPart { kQuery, kKey, kValue };

// `rows` consecutive rows starting at part_row of the separate q/k/v tensor sit at fused_row of the fused tensor.
struct QkvBlock {
  QkvPart part;
  std::int64_t part_row;
  std::int64_t fused_row;
  std::int64_t rows;
};

// The fused tensor's blocks in order, three per group, covering it exactly once.
std::vector<QkvBlock> qkv_blocks(const QkvLayout& layout);

// Whole-tensor reference versions (tests and small tensors); row_bytes = bytes of one row (columns × element size).
void fuse_qkv(const QkvLayout& layout, std::size_t row_bytes, std::span<const std::byte> q,
              std::span<const std::byte> k, std::span<const std::byte> v, std::span<std::byte> fused);
void unfuse_qkv(const QkvLayout& layout, std::size_t row_bytes, std::span<const std::byte> fused,
                std::span<std::byte> q, std::span<std::byte> k, std::span<std::byte> v);

}  // namespace trestle
