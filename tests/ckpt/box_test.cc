// Shared-run planning between pieces, checked against brute-force enumeration of global element indices.
#include "ckpt/box.h"

#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <random>

namespace trestle {
namespace {

// Global flat index -> index within the piece's stored data, for every element the piece holds.
std::map<std::int64_t, std::int64_t> elements_of(const Piece& p, const Shape& global) {
  std::map<std::int64_t, std::int64_t> out;
  const std::int64_t n = p.box.numel();
  for (std::int64_t local = 0; local < n; ++local) {
    if (p.flat && (local < p.flat->start || local >= p.flat->stop)) continue;
    std::int64_t rem = local, g = 0, stride = 1;
    Shape coord(p.box.shape.size());
    for (std::size_t d = p.box.shape.size(); d-- > 0;) {
      coord[d] = rem % p.box.shape[d] + p.box.offset[d];
      rem /= p.box.shape[d];
    }
    for (std::size_t d = global.size(); d-- > 0;) {
      g += coord[d] * stride;
      stride *= global[d];
    }
    out[g] = local - p.first_element();
  }
  return out;
}

Piece random_piece(std::mt19937& rng, const Shape& global, bool flat) {
  Piece p;
  for (auto extent : global) {
    const std::int64_t lo = std::uniform_int_distribution<std::int64_t>(0, extent - 1)(rng);
    const std::int64_t hi = std::uniform_int_distribution<std::int64_t>(lo + 1, extent)(rng);
    p.box.offset.push_back(lo);
    p.box.shape.push_back(hi - lo);
  }
  if (flat) {
    const std::int64_t n = p.box.numel();
    const std::int64_t s = std::uniform_int_distribution<std::int64_t>(0, n)(rng);
    const std::int64_t e = std::uniform_int_distribution<std::int64_t>(s, n)(rng);
    p.flat = FlatRange{s, e};
  }
  return p;
}

TEST(SharedRuns, MatchBruteForceOnRandomPieces) {
  std::mt19937 rng(42);
  const std::vector<Shape> shapes = {{17}, {6, 10}, {4, 3, 5}, {2, 3, 2, 4}};
  for (int trial = 0; trial < 2000; ++trial) {
    const Shape& global = shapes[trial % shapes.size()];
    const Piece a = random_piece(rng, global, trial % 3 == 1), b = random_piece(rng, global, trial % 4 == 2);
    const auto ea = elements_of(a, global), eb = elements_of(b, global);
    std::map<std::int64_t, std::int64_t> expected;  // a index -> b index
    for (const auto& [g, ia] : ea)
      if (auto it = eb.find(g); it != eb.end()) expected[ia] = it->second;

    std::map<std::int64_t, std::int64_t> got;
    std::int64_t last_end = -1;
    for_each_shared_run(a, b, [&](const SharedRun& r) {
      ASSERT_GT(r.count, 0);
      ASSERT_GE(r.a_index, last_end) << "runs must come in increasing a order without overlap";
      last_end = r.a_index + r.count;
      for (std::int64_t k = 0; k < r.count; ++k) ASSERT_TRUE(got.emplace(r.a_index + k, r.b_index + k).second);
    });
    ASSERT_EQ(got, expected) << "a " << to_string(a) << " b " << to_string(b);
    ASSERT_EQ(shared_elements(a, b), static_cast<std::int64_t>(expected.size()));
  }
}

TEST(SharedRuns, WholeRowsMergeIntoOneRun) {
  const Piece a{Box{{0, 0}, {8, 16}}, std::nullopt};
  const Piece b{Box{{2, 0}, {4, 16}}, std::nullopt};
  int runs = 0;
  for_each_shared_run(a, b, [&](const SharedRun& r) {
    ++runs;
    EXPECT_EQ(r.a_index, 32);
    EXPECT_EQ(r.b_index, 0);
    EXPECT_EQ(r.count, 64);
  });
  EXPECT_EQ(runs, 1);
}

TEST(SharedRuns, ColumnSplitGivesOneRunPerRow) {
  const Piece a{Box{{0, 0}, {4, 8}}, std::nullopt};
  const Piece b{Box{{0, 4}, {4, 4}}, std::nullopt};
  std::vector<SharedRun> runs;
  for_each_shared_run(a, b, [&](const SharedRun& r) { runs.push_back(r); });
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[1].a_index, 12);
  EXPECT_EQ(runs[1].b_index, 4);
  EXPECT_EQ(runs[1].count, 4);
}

TEST(SharedRuns, ZeroDimensionalAndEmpty) {
  const Piece scalar{Box{{}, {}}, std::nullopt};
  EXPECT_EQ(shared_elements(scalar, scalar), 1);
  const Piece empty{Box{{0, 0}, {0, 3}}, std::nullopt};
  EXPECT_EQ(shared_elements(empty, empty), 0);
}

TEST(Boxes, IntersectAndContain) {
  EXPECT_FALSE(intersect(Box{{0}, {4}}, Box{{4}, {4}}).has_value());
  EXPECT_EQ(*intersect(Box{{0, 2}, {4, 4}}, Box{{2, 0}, {4, 4}}), (Box{{2, 2}, {2, 2}}));
  EXPECT_TRUE(box_within(Box{{2, 0}, {2, 8}}, {4, 8}));
  EXPECT_FALSE(box_within(Box{{2, 0}, {3, 8}}, {4, 8}));
  // offset + shape would wrap around 64 bits: still outside
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  EXPECT_FALSE(box_within(Box{{kMax}, {64}}, {64}));
  EXPECT_FALSE(box_within(Box{{1}, {kMax}}, {64}));
  EXPECT_EQ(to_string(Piece{Box{{0, 4}, {2, 4}}, FlatRange{1, 5}}), "[0:2, 4:8] flat [1, 5)");
}

}  // namespace
}  // namespace trestle
