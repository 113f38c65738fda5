#include "train/model/tp_regions.h"

#include <torch/autograd.h>

#include <cstdint>

namespace trestle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void keep_group(AutogradContext* ctx, const TpGroup& group) {
  ctx->saved_data["group"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&group));
}
const TpGroup& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<const TpGroup*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt()));
}

at::Tensor summed(const at::Tensor& x, const TpGroup& group) {
  at::Tensor out = x.contiguous().clone();
  group.all_reduce_sum(out);
  return out;
}

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TpGroup& group) {
    keep_group(ctx, group);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {summed(grad[0], group_of(ctx)), at::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const TpGroup& group) { return summed(x, group); }
  static variable_list backward(AutogradContext*, variable_list grad) { return {grad[0], at::Tensor()}; }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TpGroup& group) {
    keep_group(ctx, group);
    return group.all_gather_dim0(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {group_of(ctx).reduce_scatter_dim0(grad[0]), at::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TpGroup& group) {
    keep_group(ctx, group);
    return group.reduce_scatter_dim0(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {group_of(ctx).all_gather_dim0(grad[0]), at::Tensor()};
  }
};

struct SumOverTp : torch::autograd::Function<SumOverTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TpGroup& group) {
    keep_group(ctx, group);
    return summed(x, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {summed(grad[0], group_of(ctx)), at::Tensor()};
  }
};

struct GatherLastDim : torch::autograd::Function<GatherLastDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TpGroup& group) {
    keep_group(ctx, group);
    return group.all_gather_dim0(x.movedim(-1, 0).contiguous()).movedim(0, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {group_of(ctx).reduce_scatter_dim0(grad[0].movedim(-1, 0).contiguous()).movedim(0, -1), at::Tensor()};
  }
};

// This rank's equal slice of dim `dim` of x.
at::Tensor own_slice(const at::Tensor& x, std::int64_t dim, const TpGroup& group) {
  const std::int64_t size = x.size(dim) / group.size;
  return x.narrow(dim, group.rank * size, size).contiguous();
}

struct GatherFromTp : torch::autograd::Function<GatherFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TpGroup& group) {
    keep_group(ctx, group);
    return group.all_gather_dim0(x.movedim(-1, 0).contiguous()).movedim(0, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {own_slice(grad[0], grad[0].dim() - 1, group_of(ctx)), at::Tensor()};
  }
};

struct ScatterToSequence : torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const TpGroup& group) {
    keep_group(ctx, group);
    return own_slice(x, 0, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {group_of(ctx).all_gather_dim0(grad[0].contiguous()), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x, const TpGroup& group) {
  return group.size == 1 ? x : CopyToTp::apply(x, group);
}
at::Tensor reduce_from_tp(const at::Tensor& x, const TpGroup& group) {
  return group.size == 1 ? x : ReduceFromTp::apply(x, group);
}
at::Tensor gather_from_sequence(const at::Tensor& x, const TpGroup& group) {
  return group.size == 1 ? x : GatherFromSequence::apply(x, group);
}
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const TpGroup& group) {
  return group.size == 1 ? x : ReduceScatterToSequence::apply(x, group);
}

at::Tensor sum_over_tp(const at::Tensor& x, const TpGroup& group) {
  return group.size == 1 ? x : SumOverTp::apply(x, group);
}
at::Tensor gather_last_dim(const at::Tensor& x, const TpGroup& group) {
  return group.size == 1 ? x : GatherLastDim::apply(x, group);
}

at::Tensor gather_from_tp(const at::Tensor& x, const TpGroup& group) {
  return group.size == 1 ? x : GatherFromTp::apply(x, group);
}
at::Tensor scatter_to_sequence(const at::Tensor& x, const TpGroup& group) {
  return group.size == 1 ? x : ScatterToSequence::apply(x, group);
}

}  // namespace trestle::train
