// RoPE's work for one slot of one head, as each CUDA thread does it (cuda_kernels.cu), in a header that host code
// compiles too, so that the CPU tests run the very arithmetic and indexing the GPU runs. A head of head_dim elements
// has (head_dim + 1) / 2 slots; slot p < rot_dim / 2 rotates one pair, (p, p + rot_dim / 2), or (2p, 2p + 1)
// interleaved, by the row's tables (the transpose when `transpose`: sin negated and, plain, taken at the partner's
// index); a slot past them copies the (one or) two elements past rot_dim it stands for, from rot_dim + 2 (p - rot_dim
// / 2) on.
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

}  // namespace trestle::kernels::cuda
