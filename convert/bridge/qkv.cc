#include "convert/bridge/qkv.h"

#include <cstring>
#include <string>

namespace trestle {

Status check_qkv_layout(const QkvLayout& l) {
  if (l.num_heads <= 0 || l.num_groups <= 0 || l.head_dim <= 0 || l.num_heads % l.num_groups != 0)
    return Status::Error("QKV layout: " + std::to_string(l.num_heads) + " query heads, " +
                         std::to_string(l.num_groups) + " KV groups, head dim " + std::to_string(l.head_dim) +
                         ": heads must be a positive multiple of groups");
  return OkStatus();
}

std::vector<QkvBlock> qkv_blocks(const QkvLayout& l) {
  std::vector<QkvBlock> blocks;
  const std::int64_t q_rows = l.heads_per_group() * l.head_dim;
  std::int64_t fused = 0;
  for (std::int64_t g = 0; g < l.num_groups; ++g) {
    blocks.push_back({QkvPart::kQuery, g * q_rows, fused, q_rows});
    fused += q_rows;
    blocks.push_back({QkvPart::kKey, g * l.head_dim, fused, l.head_dim});
    fused += l.head_dim;
    blocks.push_back({QkvPart::kValue, g * l.head_dim, fused, l.head_dim});
    fused += l.head_dim;
  }
  return blocks;
}

namespace {

template <class Part>
Part& part_of(QkvPart which, Part& q, Part& k, Part& v) {
  return which == QkvPart::kQuery ? q : which == QkvPart::kKey ? k : v;
}

}  // namespace

void fuse_qkv(const QkvLayout& layout, std::size_t row_bytes, std::span<const std::byte> q,
              std::span<const std::byte> k, std::span<const std::byte> v, std::span<std::byte> fused) {
  for (const auto& b : qkv_blocks(layout)) {
    const auto& part = part_of(b.part, q, k, v);
    std::memcpy(fused.data() + static_cast<std::size_t>(b.fused_row) * row_bytes,
                part.data() + static_cast<std::size_t>(b.part_row) * row_bytes,
                static_cast<std::size_t>(b.rows) * row_bytes);
  }
}

void unfuse_qkv(const QkvLayout& layout, std::size_t row_bytes, std::span<const std::byte> fused,
                std::span<std::byte> q, std::span<std::byte> k, std::span<std::byte> v) {
  for (const auto& b : qkv_blocks(layout)) {
    auto& part = part_of(b.part, q, k, v);
    std::memcpy(part.data() + static_cast<std::size_t>(b.part_row) * row_bytes,
                fused.data() + static_cast<std::size_t>(b.fused_row) * row_bytes,
                static_cast<std::size_t>(b.rows) * row_bytes);
  }
}

}  // namespace trestle
