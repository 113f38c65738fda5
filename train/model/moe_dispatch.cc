#include "train/model/moe_dispatch.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <numeric>
#include <stdexcept>
#include <string>

namespace trestle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor exchange(const at::Tensor& x, const TpGroup& group, std::vector<std::int64_t> output_splits,
                    std::vector<std::int64_t> input_splits) {
  std::vector<std::int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] = std::accumulate(output_splits.begin(), output_splits.end(), std::int64_t{0});
  at::Tensor input = x.contiguous();
  at::Tensor output = at::empty(shape, input.options());
  group.backend->alltoall_base(output, input, output_splits, input_splits)->wait();
  return output;
}

struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TpGroup& group,
                            std::vector<std::int64_t> output_splits, std::vector<std::int64_t> input_splits) {
    ctx->saved_data["group"] = c10::IValue(static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&group)));
    ctx->saved_data["output_splits"] = output_splits;
    ctx->saved_data["input_splits"] = input_splits;
    return exchange(x, group, std::move(output_splits), std::move(input_splits));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto* group = reinterpret_cast<const TpGroup*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt()));
    return {exchange(grad[0], *group, ctx->saved_data["input_splits"].toIntVector(),
                     ctx->saved_data["output_splits"].toIntVector()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor all_to_all(const at::Tensor& x, const TpGroup& group, std::vector<std::int64_t> output_splits,
                      std::vector<std::int64_t> input_splits) {
  if (group.size == 1) return x;
  if (static_cast<int>(output_splits.size()) != group.size || static_cast<int>(input_splits.size()) != group.size ||
      std::accumulate(input_splits.begin(), input_splits.end(), std::int64_t{0}) != x.size(0))
    throw std::invalid_argument("all-to-all: the splits do not match the group of " + std::to_string(group.size) +
                                " ranks and the " + std::to_string(x.size(0)) + " rows");
  return AllToAll::apply(x, group, std::move(output_splits), std::move(input_splits));
}

TokenDispatcher::TokenDispatcher(const at::Tensor& tokens_per_expert, const TpGroup& ep, const TpGroup& tp)
    : ep_(&ep), tp_(&tp) {
  const std::int64_t experts = tokens_per_expert.numel();
  if (experts % ep.size != 0)
    throw std::invalid_argument(std::to_string(experts) + " experts do not divide over " + std::to_string(ep.size) +
                                " expert-parallel ranks");
  const std::int64_t local = experts / ep.size;
  first_local_expert_ = ep.rank * local;
  // counts[(t·ep + j)·experts + e]: the rows tensor-parallel rank t of expert-parallel rank j sends to expert e.
  at::Tensor gathered = tp.all_gather_dim0(ep.all_gather_dim0(tokens_per_expert.to(at::kLong).reshape(-1)));
  gathered = gathered.cpu();
  const std::int64_t* counts = gathered.data_ptr<std::int64_t>();
  auto count = [&](int t, int j, std::int64_t e) { return counts[(t * ep.size + j) * experts + e]; };
  ep_send_.assign(static_cast<std::size_t>(ep.size), 0);
  ep_receive_.assign(static_cast<std::size_t>(ep.size), 0);
  tp_receive_.assign(static_cast<std::size_t>(tp.size), 0);
  rows_per_local_expert_.assign(static_cast<std::size_t>(local), 0);
  for (int j = 0; j < ep.size; ++j)
    for (std::int64_t l = 0; l < local; ++l) {
      ep_send_[j] += count(tp.rank, ep.rank, j * local + l);
      ep_receive_[j] += count(tp.rank, j, first_local_expert_ + l);
    }
  received_ = std::accumulate(ep_receive_.begin(), ep_receive_.end(), std::int64_t{0});
  // The received rows arrive as (tp rank, ep rank, local expert) runs; the experts want them by local expert.
  std::vector<std::int64_t> run_start;
  std::int64_t row = 0;
  for (int t = 0; t < tp.size; ++t)
    for (int j = 0; j < ep.size; ++j)
      for (std::int64_t l = 0; l < local; ++l) {
        const std::int64_t n = count(t, j, first_local_expert_ + l);
        run_start.push_back(row);
        row += n;
        tp_receive_[t] += n;
        rows_per_local_expert_[l] += n;
      }
  if (local > 1 && tp.size * ep.size > 1) {
    std::vector<std::int64_t> order;
    order.reserve(static_cast<std::size_t>(row));
    for (std::int64_t l = 0; l < local; ++l)
      for (int t = 0; t < tp.size; ++t)
        for (int j = 0; j < ep.size; ++j) {
          const std::int64_t start = run_start[(t * ep.size + j) * local + l];
          for (std::int64_t i = 0; i < count(t, j, first_local_expert_ + l); ++i) order.push_back(start + i);
        }
    const at::TensorOptions options = at::TensorOptions().dtype(at::kLong).device(tokens_per_expert.device());
    at::Tensor sort = at::tensor(order, at::kLong);
    at::Tensor unsort = at::empty_like(sort);
    unsort.index_put_({sort}, at::arange(row, at::kLong));
    // Not waiting for the stream: pageable memory is staged before the copy returns.
    sort_ = sort.to(options.device(), /*non_blocking=*/true);
    unsort_ = unsort.to(options.device(), /*non_blocking=*/true);
  }
}

at::Tensor TokenDispatcher::dispatch(const at::Tensor& rows) const {
  at::Tensor x = all_to_all(rows, *ep_, ep_receive_, ep_send_);
  if (tp_->size > 1)
    x = all_to_all(x.repeat({tp_->size, 1}), *tp_, tp_receive_, std::vector<std::int64_t>(tp_->size, received_));
  return sort_.defined() ? x.index_select(0, sort_) : x;
}

at::Tensor TokenDispatcher::combine(const at::Tensor& outputs) const {
  at::Tensor y = unsort_.defined() ? outputs.index_select(0, unsort_) : outputs;
  if (tp_->size > 1)
    y = all_to_all(y, *tp_, std::vector<std::int64_t>(tp_->size, received_), tp_receive_)
            .view({tp_->size, received_, y.size(-1)})
            .sum(0);
  return all_to_all(y, *ep_, ep_send_, ep_receive_);
}

}  // namespace trestle::train
