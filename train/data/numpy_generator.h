// numpy.random.default_rng(seed) as Megatron's mock data draws from it: Generator(PCG64(SeedSequence(seed))). The
// SeedSequence hashes the seed's 32-bit words into a pool of four and expands it into PCG64's 128-bit state and
// increment; PCG64 is the 128-bit LCG with the XSL-RR output; 32-bit draws take the low half of a 64-bit draw and keep
// the high half for the next one; integers(low, high, dtype=int32) is numpy's Lemire bounded fill (use_masked=False).
// Sources: numpy/random/bit_generator.pyx, src/pcg64/pcg64.{h,c}, src/distributions/distributions.c.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace trestle::data {

// SeedSequence(entropy) without a spawn key and with the default pool of four words.
class NumpySeedSequence {
 public:
  // The entropy as _coerce_to_uint32_array splits a non-negative integer: 32-bit words, lowest first (0 is [0]).
  explicit NumpySeedSequence(std::span<const std::uint32_t> entropy);
  explicit NumpySeedSequence(std::uint64_t seed);

  // generate_state(n_words, numpy.uint64): 2 * n_words 32-bit words paired little-endian.
  std::vector<std::uint64_t> generate_state_uint64(std::size_t n_words) const;

 private:
  std::array<std::uint32_t, 4> pool_{};
};

class NumpyPcg64 {
 public:
  explicit NumpyPcg64(const NumpySeedSequence& seed);

  std::uint64_t next64();
  std::uint32_t next32();  // buffered: the low half of a 64-bit draw, then its high half

 private:
  __extension__ using Uint128 = unsigned __int128;
  Uint128 state_ = 0;
  Uint128 increment_ = 0;
  bool has_uint32_ = false;
  std::uint32_t uinteger_ = 0;
};

class NumpyGenerator {
 public:
  explicit NumpyGenerator(std::uint64_t seed) : bits_(NumpySeedSequence(seed)) {}

  // integers(low, high, size, dtype=numpy.int32): size values in [low, high); low < high, both within int32 (high
  // up to 2^31).
  std::vector<std::int32_t> integers_int32(std::int64_t low, std::int64_t high, std::size_t size);

 private:
  std::uint32_t bounded_lemire(std::uint32_t range);  // a uniform value in [0, range]

  NumpyPcg64 bits_;
};

}  // namespace trestle::data
