// The gated units' work for one pack of V columns of one row, as each CUDA thread does it (cuda_kernels.cu), in a
// header the CPU tests run too. `E` converts elements: E::load(T) -> float, E::store(float) -> T (rounding to nearest).
#pragma once

#include <math.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/host_device.h"

namespace trestle::kernels::cuda {

// act(g) and its derivative: SwiGLU's g·σ(g), GeGLU's tanh-approximated GELU.
TRESTLE_HOST_DEVICE inline void glu_activation(cpu::Glu glu, float g, float& act, float& slope) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kGeluCubic = 0.044715f;
  if (glu == cpu::Glu::kSwiGlu) {
    const float sigma = 1.0f / (1.0f + expf(-g));
    act = g * sigma;
    slope = sigma * (1.0f + g * (1.0f - sigma));
    return;
  }
  const float t = tanhf(kSqrt2OverPi * (g + kGeluCubic * g * g * g));
  act = 0.5f * g * (1.0f + t);
  slope = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * g * g);
}

// out[k] = act(gate[k]) · up[k] for the pack at column k (a multiple of V) of a row: gate, up, out its rows.
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline void glu_forward_pack(cpu::Glu glu, const T* gate, const T* up, T* out, int k) {
  using P = Pack<T, V>;
  const P g = *reinterpret_cast<const P*>(gate + k), u = *reinterpret_cast<const P*>(up + k);
  P o;
  TRESTLE_UNROLL
  for (int i = 0; i < V; ++i) {
    float act, slope;
    glu_activation(glu, E::load(g.v[i]), act, slope);
    o.v[i] = E::store(act * E::load(u.v[i]));
  }
  *reinterpret_cast<P*>(out + k) = o;
}

// d_gate[k] = d[k] · up[k] · act'(gate[k]), d_up[k] = d[k] · act(gate[k]) for the pack at column k of a row.
template <typename T, typename E, int V>
TRESTLE_HOST_DEVICE inline void glu_backward_pack(cpu::Glu glu, const T* d_out, const T* gate, const T* up, T* d_gate,
                                                  T* d_up, int k) {
  using P = Pack<T, V>;
  const P d = *reinterpret_cast<const P*>(d_out + k), g = *reinterpret_cast<const P*>(gate + k),
          u = *reinterpret_cast<const P*>(up + k);
  P dg, du;
  TRESTLE_UNROLL
  for (int i = 0; i < V; ++i) {
    float act, slope;
    glu_activation(glu, E::load(g.v[i]), act, slope);
    const float di = E::load(d.v[i]);
    dg.v[i] = E::store(di * E::load(u.v[i]) * slope);
    du.v[i] = E::store(di * act);
  }
  *reinterpret_cast<P*>(d_gate + k) = dg;
  *reinterpret_cast<P*>(d_up + k) = du;
}

}  // namespace trestle::kernels::cuda
