// The vocabulary-parallel cross-entropy's arithmetic per logit, as the CUDA kernels do it (cuda/cuda_kernels.cu), in a
// header the CPU builds (cpu_kernels.cc: the target's own term) run too. A chunk's logits l come in the output layer's
// dtype and are read as fp32; z = cap · tanh(l / cap) when soft-capped (cap > 0), else l.
#pragma once

#include <math.h>

#include "kernels/cpu/host_device_qualifier.h"

namespace trestle::kernels {

TRESTLE_HOST_DEVICE inline float cross_entropy_logit(float l, float cap) { return cap > 0 ? tanhf(l / cap) * cap : l; }

// The logit's gradient from the row's log-sum-exp and the loss's gradient: (exp(z − lse) − [the target]) · grad_loss,
// times the soft-cap's derivative 1 − tanh²(l / cap) when capped.
TRESTLE_HOST_DEVICE inline float cross_entropy_gradient(float l, float lse, bool target, float grad_loss, float cap) {
  const float t = cap > 0 ? tanhf(l / cap) : 0.0f;
  float g = expf((cap > 0 ? t * cap : l) - lse);
  if (target) g += -1.0f;
  g *= grad_loss;
  if (cap > 0) g *= 1.0f - t * t;
  return g;
}

}  // namespace trestle::kernels
