// RoPE's work for one slot of one head, as each CUDA thread does it (cuda_kernels.cu), in a header that host code
// compiles too, so that the CPU tests run the very arithmetic and indexing the GPU runs. A head of head_dim elements
// has (head_dim + 1) / 2 slots; slot p < rot_dim / 2 rotates one pair, (p, p + rot_dim / 2), or (2p, 2p + 1)
// interleaved, by the row's tables (the transpose when `transpose`: sin negated and, plain, taken at the partner's
// index); a slot past them copies the (one or) two elements past rot_dim it stands for, from rot_dim + 2 (p - rot_dim
// / 2) on. rope_pack does the same for V slots at once, read and written as packs of V elements.
#pragma once

#include "kernels/cuda/host_device.h"

namespace trestle::kernels::cuda {

// `x(d)`: the head's element d as float; `y(d, value)`: stores it, rounded to the element type; `c`, `s`: the row's
// cos and sin tables.
template <typename Load, typename Store>
TRESTLE_HOST_DEVICE inline void rope_slot(int p, int head_dim, int rot, bool interleaved, bool transpose,
                                          const float* c, const float* s, const Load& x, const Store& y) {
  const int h = rot / 2;
  if (p >= h) {
    const int d = rot + 2 * (p - h);
    y(d, x(d));
    if (d + 1 < head_dim) y(d + 1, x(d + 1));
    return;
  }
  if (interleaved) {
    const float a = x(2 * p), b = x(2 * p + 1);
    const float sine = transpose ? -s[p] : s[p];
    y(2 * p, a * c[p] - b * sine);
    y(2 * p + 1, b * c[p] + a * sine);
    return;
  }
  const float a = x(p), b = x(p + h);
  y(p, a * c[p] - b * (transpose ? -s[p + h] : s[p]));
  y(p + h, b * c[p + h] + a * (transpose ? -s[p] : s[p + h]));
}

// Slots of a head.
TRESTLE_HOST_DEVICE inline int rope_slots(int head_dim) { return (head_dim + 1) / 2; }

// Whether a head's work splits into packs of V elements (V even): plain, the rotated halves into packs; interleaved,
// the rotated pairs; and the pass-through dims.
TRESTLE_HOST_DEVICE inline bool rope_packs_fit(int head_dim, int rot, bool interleaved, int V) {
  return V % 2 == 0 && head_dim % V == 0 && rot % (interleaved ? V : 2 * V) == 0;
}

// A head's packs (rope_packs_fit): first those that rotate, then those that copy.
TRESTLE_HOST_DEVICE inline int rope_rotating_packs(int rot, bool interleaved, int V) {
  return interleaved ? rot / V : rot / 2 / V;
}
TRESTLE_HOST_DEVICE inline int rope_packs(int head_dim, int rot, bool interleaved, int V) {
  return rope_rotating_packs(rot, interleaved, V) + (head_dim - rot) / V;
}

// Pack q of a head x (its output y), 16-byte aligned where V · sizeof(T) is: plain, the V slots from q · V, elements
// [qV, qV + V) with [qV + rot/2, ...); interleaved, elements [qV, qV + V), V / 2 pairs; past the rotating packs, V
// elements copied. The arithmetic is rope_slot's, slot by slot.
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline void rope_pack(int q, int rot, bool interleaved, bool transpose, const float* c,
                                          const float* s, const T* x, T* y) {
  using P = Pack<T, V>;
  const int rotating = rope_rotating_packs(rot, interleaved, V);
  if (q >= rotating) {
    const int d = rot + (q - rotating) * V;
    *reinterpret_cast<P*>(y + d) = *reinterpret_cast<const P*>(x + d);
    return;
  }
  const int d = q * V;
  if (interleaved) {
    const P in = *reinterpret_cast<const P*>(x + d);
    P out;
    TRESTLE_UNROLL
    for (int i = 0; i < V; i += 2) {
      const int p = (d + i) / 2;
      const float a = E::load(in.v[i]), b = E::load(in.v[i + 1]);
      const float sine = transpose ? -s[p] : s[p];
      out.v[i] = E::store(a * c[p] - b * sine);
      out.v[i + 1] = E::store(b * c[p] + a * sine);
    }
    *reinterpret_cast<P*>(y + d) = out;
    return;
  }
  const int h = rot / 2;
  const P first = *reinterpret_cast<const P*>(x + d), second = *reinterpret_cast<const P*>(x + d + h);
  P out_first, out_second;
  TRESTLE_UNROLL
  for (int i = 0; i < V; ++i) {
    const int p = d + i;
    const float a = E::load(first.v[i]), b = E::load(second.v[i]);
    out_first.v[i] = E::store(a * c[p] - b * (transpose ? -s[p + h] : s[p]));
    out_second.v[i] = E::store(b * c[p + h] + a * (transpose ? -s[p] : s[p + h]));
  }
  *reinterpret_cast<P*>(y + d) = out_first;
  *reinterpret_cast<P*>(y + d + h) = out_second;
}

}  // namespace trestle::kernels::cuda
