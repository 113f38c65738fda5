// numpy.random.RandomState(seed) as Megatron's dataset indices use it: MT19937 seeded the legacy way and the legacy
// shuffle (Fisher-Yates from the end, each bound drawn by masked rejection), so a seed gives numpy's permutation.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>

namespace trestle::data {

class NumpyRandomState {
 public:
  explicit NumpyRandomState(std::uint32_t seed) : mt_(seed) {}

  // A uniform integer in [0, max], as numpy's random_interval draws it.
  std::uint64_t interval(std::uint64_t max) {
    if (max == 0) return 0;
    std::uint64_t mask = max;
    for (int shift = 1; shift <= 32; shift <<= 1) mask |= mask >> shift;
    std::uint64_t value;
    if (max <= 0xffffffffULL) {
      while ((value = (mt_() & mask)) > max) {
      }
    } else {
      while ((value = (next64() & mask)) > max) {
      }
    }
    return value;
  }

  // RandomState.shuffle of a one-dimensional array.
  template <class T>
  void shuffle(std::span<T> values) {
    for (std::size_t i = values.size(); i-- > 1;) std::swap(values[i], values[interval(i)]);
  }

 private:
  std::uint64_t next64() {
    const std::uint64_t high = mt_();
    return (high << 32) | mt_();
  }
  std::mt19937 mt_;  // init_genrand seeding and genrand_int32 output are numpy's legacy MT19937
};

}  // namespace trestle::data
