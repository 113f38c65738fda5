// Shared-run planning between pieces, checked against brute-force enumeration of global element indices.
#include "ckpt/box.h"

#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <random>
#include <set>

#include "tests/support/status_matchers.h"

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

// Every pair the sweep reports shares an element, and it misses none: against all pairs tried, on random boxes.
TEST(Boxes, IntersectingPairsAreAllFound) {
  std::mt19937 random(7);
  for (int rank = 0; rank <= 3; ++rank)
    for (int round = 0; round < 30; ++round) {
      std::vector<Box> boxes(1 + random() % 40);
      for (Box& box : boxes)
        for (int d = 0; d < rank; ++d) {
          box.offset.push_back(static_cast<std::int64_t>(random() % 12));
          box.shape.push_back(static_cast<std::int64_t>(random() % 5));  // some empty
        }
      std::set<std::pair<std::size_t, std::size_t>> expected, found;
      for (std::size_t i = 0; i < boxes.size(); ++i)
        for (std::size_t j = i + 1; j < boxes.size(); ++j)
          if (shared_elements(Piece{boxes[i], std::nullopt}, Piece{boxes[j], std::nullopt}) > 0)
            expected.insert({i, j});
      for_each_intersecting_pair(boxes, [&](std::size_t i, std::size_t j) {
        EXPECT_LT(i, j);
        EXPECT_TRUE(found.insert({i, j}).second) << "reported twice";
        return true;
      });
      EXPECT_EQ(found, expected) << "rank " << rank << ", round " << round;
    }
}

TEST(Boxes, CoverIsExact) {
  EXPECT_TRUE(check_boxes_cover({4, 4}, {Box{{0, 0}, {4, 2}}, Box{{0, 2}, {4, 2}}}, "t").ok());
  EXPECT_TRUE(check_boxes_cover({}, {Box{{}, {}}}, "t").ok());
  // A chunk moved onto its neighbour keeps the element count (the audit's torch_dist case): rows 2-3 stored twice,
  // rows 6-7 never.
  EXPECT_TRUE(fails_with(check_boxes_cover({8, 2}, {Box{{0, 0}, {4, 2}}, Box{{2, 0}, {4, 2}}}, "tensor 'w'"),
                         "tensor 'w': chunks [0:4, 0:2] and [2:6, 0:2] overlap"));
  EXPECT_TRUE(fails_with(check_boxes_cover({8, 2}, {Box{{0, 0}, {4, 2}}}, "t"), "chunks hold 8 of its 16 elements"));
  EXPECT_TRUE(fails_with(check_boxes_cover({8, 2}, {Box{{0, 0}, {8, 2}}, Box{{4, 0}, {8, 2}}}, "t"),
                         "box [4:12, 0:2] is not within the tensor's shape [0:8, 0:2]"));
  EXPECT_TRUE(fails_with(check_boxes_cover({}, {Box{{}, {}}, Box{{}, {}}}, "t"), "overlap")) << "a scalar twice";
  EXPECT_FALSE(check_boxes_cover({-1, 2}, {}, "t").ok());
}

// Many pieces (a tensor cut into 200,000 single elements, or a 400 x 400 grid of tiles) are checked in n log n: a
// pairwise check would take 2·10^10 and 1.3·10^10 comparisons, far past the test's time limit.
TEST(Boxes, ManyPiecesAreCheckedWithoutComparingEveryPair) {
  std::vector<Box> singles;
  for (std::int64_t i = 0; i < 200000; ++i) singles.push_back(Box{{i}, {1}});
  std::reverse(singles.begin(), singles.end());
  EXPECT_TRUE(check_boxes_cover({200000}, singles, "t").ok());
  std::vector<Box> tiles;
  for (std::int64_t r = 0; r < 400; ++r)
    for (std::int64_t c = 0; c < 400; ++c) tiles.push_back(Box{{2 * r, 3 * c}, {2, 3}});
  EXPECT_TRUE(check_boxes_cover({800, 1200}, tiles, "t").ok());
  tiles.back() = Box{{0, 0}, {2, 3}};
  EXPECT_TRUE(fails_with(check_boxes_cover({800, 1200}, tiles, "t"), "overlap"));
}

}  // namespace
}  // namespace trestle
