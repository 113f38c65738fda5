#include "train/model/tp_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
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

// On the CPU, Gloo's collectives of a few hundred KB cost their round trips, not their bytes: its ring all-reduce and
// reduce-scatter take twice the exchanges of an all-gather (measured on 2 cores, 2 ranks: a 16 KB all-reduce ~1.9 ms,
// an all-gather of it ~0.7-1 ms). Up to this many bytes gathered, a CPU sum or maximum is the all-gather's rows
// reduced in rank order: every rank reduces the same rows in the same order, so all hold the same bits.
constexpr std::int64_t kGatheredReductionBytes = std::int64_t{1} << 20;

bool reduce_gathered(const TpGroup& group, const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.numel() * tensor.element_size() * group.size <= kGatheredReductionBytes;
}

// The group's tensors (each `tensor`'s shape, contiguous) as rows [size, ...] of one all-gather.
at::Tensor gather_rows(const TpGroup& group, const at::Tensor& tensor, const char* collective) {
  std::vector<std::int64_t> shape = {group.size};
  shape.insert(shape.end(), tensor.sizes().begin(), tensor.sizes().end());
  at::Tensor flat = at::empty({group.size * tensor.numel()}, tensor.options());
  at::Tensor input = tensor.reshape({tensor.numel()});  // (Gloo's output is the inputs' dim 0 times the group's size)
  wait_for(group, collective, group.backend->_allgather_base(flat, input));
  return flat.view(shape);
}

// rows[0] op rows[1] op ... in rank order, into `out`.
void reduce_rows(const at::Tensor& rows, c10d::ReduceOp op, at::Tensor& out) {
  out.copy_(rows[0]);
  for (std::int64_t r = 1; r < rows.size(0); ++r) {
    if (op == c10d::ReduceOp::MAX) {
      at::maximum_out(out, out, rows[r]);
    } else {
      out.add_(rows[r]);
    }
  }
}

void all_reduce(const TpGroup& group, at::Tensor& tensor, c10d::ReduceOp op) {
  if (group.size == 1) return;
  TORCH_CHECK(tensor.is_contiguous(), "tensor-parallel all-reduce needs a contiguous tensor");
  if (reduce_gathered(group, tensor)) {
    reduce_rows(gather_rows(group, tensor, "all-reduce"), op, tensor);
    return;
  }
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
  if (reduce_gathered(*this, input)) {
    // Every rank's whole tensor gathered; this rank sums its own block of rows.
    at::Tensor rows = gather_rows(*this, input, "reduce-scatter").narrow(1, rank * shape[0], shape[0]);
    reduce_rows(rows, c10d::ReduceOp::SUM, output);
    return output;
  }
  wait_for(*this, "reduce-scatter", backend->_reduce_scatter_base(output, input));
  return output;
}

}  // namespace trestle::train
