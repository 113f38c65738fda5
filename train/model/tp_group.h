// The tensor-parallel group a model runs in (a c10d backend plus this rank's place in it) and the four blocking
// collectives tensor and sequence parallelism need; the expert-parallel group is described the same way. A group of
// size 1 needs no backend and every collective is the identity. Collectives are issued in program order; every rank of
// the group must issue the same sequence.
#pragma once

#include <ATen/Tensor.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace trestle::train {

struct TpGroup {
  c10::intrusive_ptr<c10d::Backend> backend;  // null when size == 1
  int rank = 0;
  int size = 1;

  static TpGroup single() { return {}; }

  // In place: the sum (or maximum) over the group.
  void all_reduce_sum(at::Tensor& tensor) const;
  void all_reduce_max(at::Tensor& tensor) const;
  // The ranks' tensors concatenated along dim 0 (every rank contributes the same shape).
  at::Tensor all_gather_dim0(const at::Tensor& tensor) const;
  // The sum over the group of `tensor`, of which this rank keeps rows [rank·n/size, (rank+1)·n/size) of dim 0.
  at::Tensor reduce_scatter_dim0(const at::Tensor& tensor) const;
};

}  // namespace trestle::train
