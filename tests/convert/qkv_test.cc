// Megatron's per-group QKV order: fusing and unfusing for several group counts (including a single KV head), weights
// and biases, against an order written out by hand.
#include "convert/bridge/qkv.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

std::span<std::byte> bytes(std::vector<float>& v) { return std::as_writable_bytes(std::span(v)); }

// q rows are tagged 1000 + row, k rows 2000 + row, v rows 3000 + row (one element per row, as a bias).
struct Parts {
  std::vector<float> q, k, v;
};
Parts tagged(const QkvLayout& l) {
  Parts p{std::vector<float>(l.query_rows()), std::vector<float>(l.kv_rows()), std::vector<float>(l.kv_rows())};
  for (std::size_t i = 0; i < p.q.size(); ++i) p.q[i] = 1000.0f + static_cast<float>(i);
  for (std::size_t i = 0; i < p.k.size(); ++i) p.k[i] = 2000.0f + static_cast<float>(i);
  for (std::size_t i = 0; i < p.v.size(); ++i) p.v[i] = 3000.0f + static_cast<float>(i);
  return p;
}

TEST(QkvTest, GroupOrderByHand) {
  const QkvLayout l{4, 2, 2};  // 2 groups of 2 query heads, head dim 2
  auto p = tagged(l);
  std::vector<float> fused(l.fused_rows());
  fuse_qkv(l, sizeof(float), bytes(p.q), bytes(p.k), bytes(p.v), bytes(fused));
  const std::vector<float> expected = {
      1000, 1001, 1002, 1003, 2000, 2001, 3000, 3001,   // group 0: q heads 0-1, k 0, v 0
      1004, 1005, 1006, 1007, 2002, 2003, 3002, 3003};  // group 1
  EXPECT_EQ(fused, expected);
}

TEST(QkvTest, RoundTripForEveryGroupCount) {
  for (std::int64_t groups : {1, 2, 4, 8}) {
    const QkvLayout l{8, groups, 3};
    ASSERT_TRUE(check_qkv_layout(l).ok());
    const std::size_t cols = 5;
    std::vector<float> q(l.query_rows() * cols), k(l.kv_rows() * cols), v(l.kv_rows() * cols);
    std::iota(q.begin(), q.end(), 0.0f);
    std::iota(k.begin(), k.end(), 10000.0f);
    std::iota(v.begin(), v.end(), 20000.0f);
    std::vector<float> fused(l.fused_rows() * cols);
    fuse_qkv(l, cols * sizeof(float), bytes(q), bytes(k), bytes(v), bytes(fused));
    // Group g's rows start at g × (heads per group + 2) × head_dim: its query heads, then its key and value head.
    const std::int64_t group_rows = (l.heads_per_group() + 2) * l.head_dim;
    for (std::int64_t g = 0; g < groups; ++g) {
      const auto k_row = static_cast<std::size_t>(g * group_rows + l.heads_per_group() * l.head_dim);
      EXPECT_EQ(fused[k_row * cols], k[static_cast<std::size_t>(g * l.head_dim) * cols])
          << groups << " groups, group " << g;
      EXPECT_EQ(fused[(k_row + static_cast<std::size_t>(l.head_dim)) * cols],
                v[static_cast<std::size_t>(g * l.head_dim) * cols]);
    }
    std::vector<float> q2(q.size()), k2(k.size()), v2(v.size());
    unfuse_qkv(l, cols * sizeof(float), bytes(fused), bytes(q2), bytes(k2), bytes(v2));
    EXPECT_EQ(q2, q);
    EXPECT_EQ(k2, k);
    EXPECT_EQ(v2, v);
  }
}

TEST(QkvTest, BlocksCoverTheFusedTensorOnce) {
  const QkvLayout l{12, 3, 4};
  std::int64_t next = 0;
  for (const auto& b : qkv_blocks(l)) {
    EXPECT_EQ(b.fused_row, next);
    next += b.rows;
  }
  EXPECT_EQ(next, l.fused_rows());
  EXPECT_TRUE(fails_with(check_qkv_layout({6, 4, 2}), "heads must be a positive multiple of groups"));
}

}  // namespace
}  // namespace trestle
