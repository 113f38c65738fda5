#include "train/model/vocab_parallel.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <limits>

namespace trestle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            const VocabRange& range, const TpGroup& group) {
    at::Tensor local = logits.narrow(-1, 0, range.valid).to(at::kFloat);
    const auto token_shape = targets.sizes();
    at::Tensor max = range.valid > 0 ? std::get<0>(local.max(-1))
                                     : at::full(token_shape, -std::numeric_limits<float>::infinity(), local.options());
    max = max.contiguous();
    group.all_reduce_max(max);
    at::Tensor shifted = local - max.unsqueeze(-1);

    at::Tensor outside = (targets < range.start) | (targets >= range.start + range.valid);
    at::Tensor local_target = (targets - range.start).masked_fill(outside, 0);
    at::Tensor target_logit = range.valid > 0 ? shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
                                              : at::zeros(token_shape, local.options());
    target_logit = target_logit.masked_fill(outside, 0.0).contiguous();
    group.all_reduce_sum(target_logit);

    at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = exp.sum(-1).contiguous();
    group.all_reduce_sum(sum_exp);
    at::Tensor loss = sum_exp.log() - target_logit;

    exp.div_(sum_exp.unsqueeze(-1));  // softmax over the whole vocabulary, this rank's columns
    ctx->save_for_backward({exp, local_target, outside});
    ctx->saved_data["rows"] = range.rows;
    ctx->saved_data["dtype"] = logits.scalar_type();
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor softmax = saved[0], local_target = saved[1], outside = saved[2];
    const std::int64_t rows = ctx->saved_data["rows"].toInt();
    at::Tensor one_hot_weight = (~outside).to(softmax.scalar_type());
    if (softmax.size(-1) > 0) softmax.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot_weight.unsqueeze(-1));
    softmax.mul_(grad[0].unsqueeze(-1));
    at::Tensor grad_logits = softmax;
    if (softmax.size(-1) < rows) {  // padding columns get no gradient
      std::vector<std::int64_t> pad(softmax.sizes().begin(), softmax.sizes().end());
      pad.back() = rows - softmax.size(-1);
      grad_logits = at::cat({softmax, at::zeros(pad, softmax.options())}, -1);
    }
    return {grad_logits.to(ctx->saved_data["dtype"].toScalarType()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

VocabRange vocab_range(std::int64_t vocab_size, std::int64_t padded_vocab_size, const TpGroup& group) {
  VocabRange r;
  r.rows = padded_vocab_size / group.size;
  r.start = r.rows * group.rank;
  r.valid = std::clamp<std::int64_t>(vocab_size - r.start, 0, r.rows);
  return r;
}

at::Tensor vocab_parallel_embedding_partial(const at::Tensor& ids, const at::Tensor& weight, const VocabRange& range) {
  at::Tensor outside = (ids < range.start) | (ids >= range.start + range.rows);
  at::Tensor local = (ids - range.start).masked_fill(outside, 0);
  return at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const VocabRange& range,
                                        const TpGroup& group) {
  return VocabParallelCrossEntropy::apply(logits, targets, range, group);
}

}  // namespace trestle::train
