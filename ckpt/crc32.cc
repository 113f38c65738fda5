#include "ckpt/crc32.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace trestle {
namespace {

// Slice-by-8 tables for the reflected CRC-32 (polynomial 0xEDB88320) that zip uses.
struct Crc32Tables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  Crc32Tables() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

#if defined(__x86_64__)
// CRC-32 by carry-less multiplication (Intel, "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ"):
// four 128-bit lanes are folded forward 512 bits at a time, then into one lane, then reduced to 32 bits (Barrett).
// The constants are x^k mod P for the bit-reflected polynomial. `state` is the running register (not inverted);
// n is a multiple of 16, at least 64.
#define TRESTLE_CLMUL __attribute__((target("pclmul,sse4.1")))
TRESTLE_CLMUL inline __m128i load(const std::uint8_t* at) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
}
// a folded onto the block b that follows it: a's halves times the two constants (x^k mod P), xor b.
TRESTLE_CLMUL inline __m128i fold(__m128i a, __m128i k, __m128i b) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11)), b);
}

TRESTLE_CLMUL std::uint32_t crc32_folded(const std::uint8_t* p, std::size_t n, std::uint32_t state) {
  const __m128i fold512 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
  const __m128i fold128 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
  const __m128i fold64 = _mm_set_epi64x(0, 0x0163cd6124);
  const __m128i barrett = _mm_set_epi64x(0x01f7011641, 0x01db710641);
  const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(state)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x0 = fold(x0, fold512, load(p));
    x1 = fold(x1, fold512, load(p + 16));
    x2 = fold(x2, fold512, load(p + 32));
    x3 = fold(x3, fold512, load(p + 48));
  }
  x0 = fold(fold(fold(x0, fold128, x1), fold128, x2), fold128, x3);
  for (; n >= 16; p += 16, n -= 16) x0 = fold(x0, fold128, load(p));
  // 128 -> 64 bits.
  __m128i x = _mm_xor_si128(_mm_srli_si128(x0, 8), _mm_clmulepi64_si128(x0, fold128, 0x10));
  x = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x, low32), fold64, 0x00), _mm_srli_si128(x, 4));
  // 64 -> 32 bits.
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x, low32), barrett, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), barrett, 0x00);
  return static_cast<std::uint32_t>(_mm_extract_epi32(_mm_xor_si128(x, t), 1));
}

#undef TRESTLE_CLMUL

bool has_carryless_multiply() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}
#endif

}  // namespace

std::uint32_t crc32(std::span<const std::byte> data, std::uint32_t crc) {
#if defined(__x86_64__)
  if (data.size() >= 64 && has_carryless_multiply()) {
    const std::size_t folded = data.size() & ~std::size_t{15};
    crc = ~crc32_folded(reinterpret_cast<const std::uint8_t*>(data.data()), folded, ~crc);
    data = data.subspan(folded);
  }
#endif
  static const Crc32Tables tables;
  const auto& t = tables.t;
  std::uint32_t c = ~crc;
  const auto* p = reinterpret_cast<const std::uint8_t*>(data.data());
  std::size_t n = data.size();
  while (n >= 8) {
    std::uint32_t lo;
    std::uint32_t hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][hi & 0xff] ^
        t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

}  // namespace trestle
