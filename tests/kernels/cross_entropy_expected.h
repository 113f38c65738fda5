// What the cross-entropy's passes over a chunk of logits should give, computed by ATen in double (the kernel tests'
// yardstick for every CPU build and the CUDA kernels): z = cap · tanh(l / cap) when cap > 0, else l.
#pragma once

#include <ATen/ATen.h>

namespace trestle::kernels {

struct CrossEntropyExpected {
  at::Tensor max;       // [rows]: the row's largest z
  at::Tensor target_z;  // [rows]: the target's z − max (0 where outside)
  at::Tensor sum_exp;   // [rows]: Σ exp(z − max)
  at::Tensor lse;       // [rows]: log Σ exp(z)
  at::Tensor grad;  // [rows, cols]: (exp(z − lse) − [target]) · grad_loss · (1 − tanh²(l / cap) when capped)

  CrossEntropyExpected(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& outside,
                       const at::Tensor& grad_loss, double cap) {
    at::Tensor z = logits.to(at::kDouble), tanh;
    if (cap > 0) {
      tanh = at::tanh(z / cap);
      z = tanh * cap;
    }
    max = std::get<0>(z.max(-1));
    const at::Tensor shifted = z - max.unsqueeze(-1);
    target_z = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
    sum_exp = shifted.exp().sum(-1);
    lse = sum_exp.log() + max;
    grad = (z - lse.unsqueeze(-1)).exp();
    grad.scatter_add_(-1, target.unsqueeze(-1), -(~outside).to(at::kDouble).unsqueeze(-1));
    grad.mul_(grad_loss.to(at::kDouble).unsqueeze(-1));
    if (cap > 0) grad.mul_(1 - tanh * tanh);
  }
};

}  // namespace trestle::kernels
