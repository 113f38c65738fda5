#include "train/data/numpy_generator.h"

#include <cassert>
#include <limits>

namespace trestle::data {
namespace {

constexpr std::uint32_t kInitA = 0x43b0d7e5;
constexpr std::uint32_t kMultA = 0x931e8875;
constexpr std::uint32_t kInitB = 0x8b51f9dd;
constexpr std::uint32_t kMultB = 0x58f38ded;
constexpr std::uint32_t kMixMultL = 0xca01f9dd;
constexpr std::uint32_t kMixMultR = 0x4973f715;
constexpr int kXShift = 16;

// SeedSequence's hashmix; `multiplier` kMultA when mixing entropy, kMultB when generating state.
std::uint32_t hashmix(std::uint32_t value, std::uint32_t& hash_const, std::uint32_t multiplier = kMultA) {
  value ^= hash_const;
  hash_const *= multiplier;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

std::uint32_t mix(std::uint32_t x, std::uint32_t y) {
  std::uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}

std::vector<std::uint32_t> seed_words(std::uint64_t seed) {
  if (seed >> 32) return {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
  return {static_cast<std::uint32_t>(seed)};
}

}  // namespace

NumpySeedSequence::NumpySeedSequence(std::span<const std::uint32_t> entropy) {
  // SeedSequence.mix_entropy.
  std::uint32_t hash_const = kInitA;
  for (std::size_t i = 0; i < pool_.size(); ++i) pool_[i] = hashmix(i < entropy.size() ? entropy[i] : 0, hash_const);
  for (std::size_t src = 0; src < pool_.size(); ++src)
    for (std::size_t dst = 0; dst < pool_.size(); ++dst)
      if (src != dst) pool_[dst] = mix(pool_[dst], hashmix(pool_[src], hash_const));
  for (std::size_t src = pool_.size(); src < entropy.size(); ++src)
    for (std::size_t dst = 0; dst < pool_.size(); ++dst)
      pool_[dst] = mix(pool_[dst], hashmix(entropy[src], hash_const));
}

NumpySeedSequence::NumpySeedSequence(std::uint64_t seed) : NumpySeedSequence(seed_words(seed)) {}

std::vector<std::uint64_t> NumpySeedSequence::generate_state_uint64(std::size_t n_words) const {
  std::uint32_t hash_const = kInitB;
  std::vector<std::uint32_t> words(2 * n_words);
  for (std::size_t i = 0; i < words.size(); ++i) words[i] = hashmix(pool_[i % pool_.size()], hash_const, kMultB);
  std::vector<std::uint64_t> out(n_words);
  for (std::size_t i = 0; i < n_words; ++i) out[i] = words[2 * i] | (std::uint64_t{words[2 * i + 1]} << 32);
  return out;
}

namespace {

__extension__ using Uint128 = unsigned __int128;
constexpr Uint128 kPcgMultiplier = (Uint128{2549297995355413924ULL} << 64) | 4865540595714422341ULL;

}  // namespace

NumpyPcg64::NumpyPcg64(const NumpySeedSequence& seed) {
  // PCG64._reset_state with generate_state(4, uint64), then pcg64_set_seed / pcg_setseq_128_srandom_r.
  const auto words = seed.generate_state_uint64(4);
  const Uint128 initstate = (Uint128{words[0]} << 64) | words[1];
  const Uint128 initseq = (Uint128{words[2]} << 64) | words[3];
  state_ = 0;
  increment_ = (initseq << 1) | 1;
  state_ = state_ * kPcgMultiplier + increment_;
  state_ += initstate;
  state_ = state_ * kPcgMultiplier + increment_;
}

std::uint64_t NumpyPcg64::next64() {
  state_ = state_ * kPcgMultiplier + increment_;
  const auto high = static_cast<std::uint64_t>(state_ >> 64);
  const auto value = high ^ static_cast<std::uint64_t>(state_);
  const auto rotation = static_cast<unsigned>(state_ >> 122);
  return (value >> rotation) | (value << ((64 - rotation) & 63));
}

std::uint32_t NumpyPcg64::next32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uinteger_;
  }
  const std::uint64_t next = next64();
  has_uint32_ = true;
  uinteger_ = static_cast<std::uint32_t>(next >> 32);
  return static_cast<std::uint32_t>(next);
}

std::uint32_t NumpyGenerator::bounded_lemire(std::uint32_t range) {
  // buffered_bounded_lemire_uint32; range != 0xFFFFFFFF.
  const std::uint32_t range_excl = range + 1;
  std::uint64_t m = std::uint64_t{bits_.next32()} * range_excl;
  auto leftover = static_cast<std::uint32_t>(m);
  if (leftover < range_excl) {
    const std::uint32_t threshold = (std::numeric_limits<std::uint32_t>::max() - range) % range_excl;
    while (leftover < threshold) {
      m = std::uint64_t{bits_.next32()} * range_excl;
      leftover = static_cast<std::uint32_t>(m);
    }
  }
  return static_cast<std::uint32_t>(m >> 32);
}

std::vector<std::int32_t> NumpyGenerator::integers_int32(std::int64_t low, std::int64_t high, std::size_t size) {
  // _rand_int32 then random_bounded_uint32_fill: the closed range [low, high - 1] as an offset and a width.
  assert(low < high && low >= std::numeric_limits<std::int32_t>::min() &&
         high - 1 <= std::numeric_limits<std::int32_t>::max());
  const auto range = static_cast<std::uint32_t>(high - 1 - low);
  const auto offset = static_cast<std::uint32_t>(static_cast<std::int32_t>(low));
  std::vector<std::int32_t> out(size);
  for (auto& value : out) {
    std::uint32_t drawn = 0;
    if (range == 0xFFFFFFFFU) {
      drawn = bits_.next32();
    } else if (range != 0) {
      drawn = bounded_lemire(range);
    }
    value = static_cast<std::int32_t>(offset + drawn);
  }
  return out;
}

}  // namespace trestle::data
