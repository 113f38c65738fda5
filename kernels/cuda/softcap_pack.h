// Soft-capping's work for one pack of V elements, as each CUDA thread does it (cuda_kernels.cu), in a header the CPU
// tests run too. `E` converts elements: E::load(T) -> float, E::store(float) -> T (rounding to nearest).
#pragma once

#include <math.h>

#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace trestle::kernels::cuda {

// y = cap · tanh(x / cap) for the pack at element k (a multiple of V).
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline void softcap_forward_pack(const T* x, T* y, float cap, std::int64_t k) {
  using P = Pack<T, V>;
  const P in = *reinterpret_cast<const P*>(x + k);
  P out;
  TRESTLE_UNROLL
  for (int i = 0; i < V; ++i) out.v[i] = E::store(cap * tanhf(E::load(in.v[i]) / cap));
  *reinterpret_cast<P*>(y + k) = out;
}

// dx = dy · (1 − (y / cap)²), from the forward's output y, for the pack at element k.
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline void softcap_backward_pack(const T* dy, const T* y, T* dx, float cap, std::int64_t k) {
  using P = Pack<T, V>;
  const P d = *reinterpret_cast<const P*>(dy + k), out = *reinterpret_cast<const P*>(y + k);
  P grad;
  TRESTLE_UNROLL
  for (int i = 0; i < V; ++i) {
    const float t = E::load(out.v[i]) / cap;
    grad.v[i] = E::store(E::load(d.v[i]) * (1.0f - t * t));
  }
  *reinterpret_cast<P*>(dx + k) = grad;
}

}  // namespace trestle::kernels::cuda
