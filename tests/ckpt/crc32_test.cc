// crc32 (zip's CRC-32) against a bit-at-a-time reference: every length up to 300 and some large ones, at every
// alignment up to 16, continued from a previous crc, and the standard check value. Lengths of 64 and more take the
// carry-less-multiply path where the CPU has it, shorter ones (and tails) the tables.
#include "ckpt/crc32.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace trestle {
namespace {

std::uint32_t crc32_bitwise(std::span<const std::byte> data, std::uint32_t crc = 0) {
  std::uint32_t c = ~crc;
  for (const std::byte b : data) {
    c ^= static_cast<std::uint8_t>(b);
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return ~c;
}

std::vector<std::byte> random_bytes(std::size_t n) {
  std::mt19937 rng(static_cast<unsigned>(n));
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

TEST(Crc32Test, CheckValue) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32(std::as_bytes(std::span(text.data(), text.size()))), 0xCBF43926u);
  EXPECT_EQ(crc32({}), 0u);
}

TEST(Crc32Test, MatchesBitwiseReferenceAtEveryLengthAndAlignment) {
  const auto data = random_bytes(4096 + 64);
  for (std::size_t offset = 0; offset < 16; ++offset)
    for (std::size_t n = 0; n <= 300; ++n) {
      const auto part = std::span(data).subspan(offset, n);
      ASSERT_EQ(crc32(part), crc32_bitwise(part)) << "length " << n << " at offset " << offset;
    }
  for (const std::size_t n : {std::size_t{4095}, std::size_t{4096}, std::size_t{4096 + 63}}) {
    const auto part = std::span(data).subspan(1, n);
    EXPECT_EQ(crc32(part), crc32_bitwise(part)) << "length " << n;
  }
}

TEST(Crc32Test, LargeBuffersAndContinuation) {
  const auto data = random_bytes((3 << 20) + 77);
  const std::span<const std::byte> all(data);
  const std::uint32_t whole = crc32_bitwise(all);
  EXPECT_EQ(crc32(all), whole);
  const std::vector<std::size_t> cuts = {1, 63, 64, 1000, 1 << 20};
  for (const std::size_t cut : cuts)
    EXPECT_EQ(crc32(all.subspan(cut), crc32(all.first(cut))), whole) << "continued after " << cut << " bytes";
}

}  // namespace
}  // namespace trestle
