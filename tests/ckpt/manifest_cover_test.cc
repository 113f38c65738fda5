// Every tensor of a manifest holds each element exactly once: an overlapping chunk, a gap, or an overlap hidden by an
// equal-sized gap is refused when the manifest is read and when a save commits, naming the tensor.
#include <gtest/gtest.h>

#include "ckpt/manifest.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

StoredChunk chunk(Box box, std::optional<FlatRange> flat = std::nullopt) {
  StoredChunk c;
  c.piece = Piece{std::move(box), flat};
  return c;
}

TensorEntry tensor_of(std::vector<StoredChunk> chunks) {
  TensorEntry t;
  t.global_shape = {4, 4};
  t.chunks = std::move(chunks);
  return t;
}

TEST(ManifestCoverTest, ExactCoversPass) {
  EXPECT_TRUE(check_exact_cover(tensor_of({chunk({{0, 0}, {2, 4}}), chunk({{2, 0}, {2, 4}})}), "t").ok());
  EXPECT_TRUE(check_exact_cover(tensor_of({chunk({{0, 0}, {4, 2}}), chunk({{0, 2}, {4, 2}})}), "t").ok());
  // Distributed-optimizer shards: flat ranges of one box.
  EXPECT_TRUE(check_exact_cover(
                  tensor_of({chunk({{0, 0}, {4, 4}}, FlatRange{0, 5}), chunk({{0, 0}, {4, 4}}, FlatRange{5, 16})}), "t")
                  .ok());
  // Flat shards of two different boxes.
  EXPECT_TRUE(check_exact_cover(tensor_of({chunk({{0, 0}, {2, 4}}, FlatRange{0, 3}),
                                           chunk({{0, 0}, {2, 4}}, FlatRange{3, 8}), chunk({{2, 0}, {2, 4}})}),
                                "t")
                  .ok());
}

TEST(ManifestCoverTest, OverlapsAndGapsAreRefused) {
  const auto duplicate = check_exact_cover(tensor_of({chunk({{0, 0}, {2, 4}}), chunk({{0, 0}, {2, 4}})}), "tensor 'w'");
  ASSERT_FALSE(duplicate.ok());
  EXPECT_NE(duplicate.message().find("tensor 'w'"), std::string::npos) << duplicate.message();
  // Rows 0-1 and 1-2 overlap on row 1 while row 3 is missing: the element count adds up to the tensor's.
  const auto hidden = check_exact_cover(
      tensor_of({chunk({{0, 0}, {2, 4}}), chunk({{1, 0}, {2, 4}}), chunk({{3, 0}, {1, 4}}, FlatRange{0, 0})}), "t");
  EXPECT_TRUE(fails_with(hidden, "chunks [0:2, 0:4] and [1:3, 0:4] overlap"));
  const auto equal_count = check_exact_cover(tensor_of({chunk({{0, 0}, {3, 4}}), chunk({{1, 0}, {1, 4}})}), "t");
  EXPECT_TRUE(fails_with(equal_count, "chunks [0:3, 0:4] and [1:2, 0:4] overlap"))
      << "16 elements stored, but row 1 twice and row 3 never";
  EXPECT_TRUE(
      fails_with(check_exact_cover(tensor_of({chunk({{0, 0}, {2, 4}})}), "t"), "chunks hold 8 of its 16 elements"))
      << "half the tensor";
  EXPECT_FALSE(
      check_exact_cover(
          tensor_of({chunk({{0, 0}, {4, 4}}, FlatRange{0, 9}), chunk({{0, 0}, {4, 4}}, FlatRange{8, 16})}), "t")
          .ok())
      << "flat ranges overlapping by one element";
  EXPECT_FALSE(
      check_exact_cover(tensor_of({chunk({{0, 0}, {2, 4}}, FlatRange{0, 5}), chunk({{1, 0}, {3, 4}})}), "t").ok())
      << "a flat shard overlapping another box, with the total right";
}

}  // namespace
}  // namespace trestle
