#include "train/model/tp_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

namespace trestle::train {
namespace {

void all_reduce(const TpGroup& group, at::Tensor& tensor, c10d::ReduceOp op) {
  if (group.size == 1) return;
  TORCH_CHECK(tensor.is_contiguous(), "tensor-parallel all-reduce needs a contiguous tensor");
  std::vector<at::Tensor> tensors = {tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  group.backend->allreduce(tensors, options)->wait();
}

}  // namespace

void TpGroup::all_reduce_sum(at::Tensor& tensor) const { all_reduce(*this, tensor, c10d::ReduceOp::SUM); }

void TpGroup::all_reduce_max(at::Tensor& tensor) const { all_reduce(*this, tensor, c10d::ReduceOp::MAX); }

at::Tensor TpGroup::all_gather_dim0(const at::Tensor& tensor) const {
  if (size == 1) return tensor;
  at::Tensor input = tensor.contiguous();
  std::vector<std::int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape[0] *= size;
  at::Tensor output = at::empty(shape, input.options());
  backend->_allgather_base(output, input)->wait();
  return output;
}

at::Tensor TpGroup::reduce_scatter_dim0(const at::Tensor& tensor) const {
  if (size == 1) return tensor;
  TORCH_CHECK(tensor.size(0) % size == 0, "sequence-parallel reduce-scatter: dim 0 (", tensor.size(0),
              ") is not divisible by the tensor-parallel size ", size);
  at::Tensor input = tensor.contiguous();
  std::vector<std::int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape[0] /= size;
  at::Tensor output = at::empty(shape, input.options());
  backend->_reduce_scatter_base(output, input)->wait();
  return output;
}

}  // namespace trestle::train
