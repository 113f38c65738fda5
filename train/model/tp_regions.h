// Megatron-Core's tensor- and sequence-parallel region boundaries as autograd functions (its mappings.py):
//   copy_to_tp             identity forward,                 all-reduce of the gradient backward
//   reduce_from_tp         all-reduce forward,               identity backward
//   gather_from_sequence   all-gather over dim 0 forward,    reduce-scatter of the gradient backward
//   reduce_scatter_to_sequence  reduce-scatter forward,      all-gather of the gradient backward
//   sum_over_tp            all-reduce forward,               all-reduce of the gradient backward (a statistic every
//                          rank's own heads use, such as OLMo 2's q/k norm over the whole projection)
//   gather_last_dim        all-gather over the last dim,     reduce-scatter of the gradient over it (a column-parallel
//                          output every rank uses whole, each for its own heads: multi-latent attention's latents)
//   gather_from_tp         all-gather over the last dim,     this rank's slice of the gradient (a column-parallel
//                          output that goes on replicated: the multi-token-prediction layers' eh_proj)
//   scatter_to_sequence    this rank's slice of dim 0,       all-gather of the gradient backward
// Tensors are [sequence, batch, ...]; sequence parallelism splits dim 0. The group must outlive the autograd graph.
#pragma once

#include <ATen/Tensor.h>

#include "train/model/tp_group.h"

namespace trestle::train {

at::Tensor copy_to_tp(const at::Tensor& x, const TpGroup& group);
at::Tensor reduce_from_tp(const at::Tensor& x, const TpGroup& group);
at::Tensor gather_from_sequence(const at::Tensor& x, const TpGroup& group);
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const TpGroup& group);
at::Tensor sum_over_tp(const at::Tensor& x, const TpGroup& group);
at::Tensor gather_last_dim(const at::Tensor& x, const TpGroup& group);
at::Tensor gather_from_tp(const at::Tensor& x, const TpGroup& group);
at::Tensor scatter_to_sequence(const at::Tensor& x, const TpGroup& group);

}  // namespace trestle::train
