// Soft-capping's work for one pack of V elements, as each CUDA thread does it (cuda_kernels.cu: the *_values functions
// on packs it has read), in a header the CPU tests run too (the *_pack functions). `E` converts elements: E::load(T) ->
// float, E::store(float) -> T (rounding to nearest).
#pragma once

#include <math.h>

#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace trestle::kernels::cuda {

// cap · tanh(x / cap) for a pack of x.
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline Pack<T, V> softcap_forward_values(const Pack<T, V>& x, float cap) {
  Pack<T, V> y;
  TRESTLE_UNROLL
  for (int i = 0; i < V; ++i) y.v[i] = E::store(cap * tanhf(E::load(x.v[i]) / cap));
  return y;
}

// dy · (1 − (y / cap)²) for a pack of the output's gradient dy and the forward's output y.
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline Pack<T, V> softcap_backward_values(const Pack<T, V>& dy, const Pack<T, V>& y, float cap) {
  Pack<T, V> dx;
  TRESTLE_UNROLL
  for (int i = 0; i < V; ++i) {
    const float t = E::load(y.v[i]) / cap;
    dx.v[i] = E::store(E::load(dy.v[i]) * (1.0f - t * t));
  }
  return dx;
}

// y = cap · tanh(x / cap) for the pack at element k (a multiple of V).
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline void softcap_forward_pack(const T* x, T* y, float cap, std::int64_t k) {
  using P = Pack<T, V>;
  *reinterpret_cast<P*>(y + k) = softcap_forward_values<T, E, V>(*reinterpret_cast<const P*>(x + k), cap);
}

// dx = dy · (1 − (y / cap)²), from the forward's output y, for the pack at element k.
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline void softcap_backward_pack(const T* dy, const T* y, T* dx, float cap, std::int64_t k) {
  using P = Pack<T, V>;
  *reinterpret_cast<P*>(dx + k) =
      softcap_backward_values<T, E, V>(*reinterpret_cast<const P*>(dy + k), *reinterpret_cast<const P*>(y + k), cap);
}

}  // namespace trestle::kernels::cuda
