#include "train/model/tp_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <vector>

namespace trestle::train {
namespace {

// Waits for a collective of `group`; what a failed or timed-out one throws comes back as c10d's DistBackendError
// naming the collective and the group's size and this rank's place in it.
void wait_for(const TpGroup& group, const char* collective, const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, std::string(collective) + " in the model's group of " +
                                          std::to_string(group.size) + " ranks (this one its rank " +
                                          std::to_string(group.rank) + ") failed: " + e.what());
  }
}

void all_reduce(const TpGroup& group, at::Tensor& tensor, c10d::ReduceOp op) {
  if (group.size == 1) return;
  TORCH_CHECK(tensor.is_contiguous(), "tensor-parallel all-reduce needs a contiguous tensor");
  std::vector<at::Tensor> tensors = {tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  wait_for(group, "all-reduce", group.backend->allreduce(tensors, options));
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
  wait_for(*this, "all-gather", backend->_allgather_base(output, input));
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
  wait_for(*this, "reduce-scatter", backend->_reduce_scatter_base(output, input));
  return output;
}

}  // namespace trestle::train
