// manifest.json carries its own XXH3-64 as its last member: the text Trestle writes reads back, a changed byte before
// the checksum is refused naming the file, and a manifest without the member (older, or edited by hand) still reads.
#include <gtest/gtest.h>

#include <string>

#include "ckpt/manifest.h"

namespace trestle {
namespace {

Manifest sample() {
  Manifest m;
  m.iteration = 3;
  m.world_size = 2;
  m.training = {{"consumed_train_samples", 96}};
  TensorEntry t;
  t.global_shape = {2, 3};
  StoredChunk c;
  c.piece = Piece{Box{{0, 0}, {2, 3}}, std::nullopt};
  c.file = "rank_00000.bin";
  c.stored_bytes = 24;
  c.block_checksums = {0x0123456789abcdefULL};
  t.chunks.push_back(c);
  m.tensors.emplace("w", t);
  return m;
}

TEST(ManifestChecksumTest, WrittenTextReadsBack) {
  const std::string text = manifest_file_text(sample());
  EXPECT_NE(text.find("\"manifest_xxh3_64\""), std::string::npos);
  auto read = manifest_from_text(text, "iter/manifest.json");
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->iteration, 3);
  EXPECT_EQ(read->training["consumed_train_samples"], 96);
  EXPECT_EQ(read->tensors.at("w").chunks.at(0).block_checksums.at(0), 0x0123456789abcdefULL);
}

TEST(ManifestChecksumTest, AChangedByteIsRefusedNamingTheFile) {
  std::string text = manifest_file_text(sample());
  const std::size_t at = text.find("96");
  ASSERT_NE(at, std::string::npos);
  text[at] = '8';  // still valid JSON, a different manifest: only the checksum can tell
  auto read = manifest_from_text(text, "iter/manifest.json");
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("iter/manifest.json: the manifest's bytes do not match its checksum"),
            std::string::npos)
      << read.status().message();
}

TEST(ManifestChecksumTest, AManifestWithoutItIsReadUnchecked) {
  const std::string full = manifest_file_text(sample());
  const std::string bare = full.substr(0, full.rfind(",\n \"manifest_xxh3_64\"")) + "\n}\n";
  auto read = manifest_from_text(bare, "iter/manifest.json");
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->world_size, 2);
}

}  // namespace
}  // namespace trestle
