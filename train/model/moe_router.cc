#include "train/model/moe_router.h"

#include <cmath>
#include <stdexcept>
#include <tuple>

namespace trestle::train {
namespace {

std::tuple<at::Tensor, at::Tensor> group_limited_topk(const at::Tensor& scores, int topk, int num_groups,
                                                      int group_topk) {
  const std::int64_t tokens = scores.size(0), experts = scores.size(1);
  // a group's score: the sum of its best topk / group_topk experts
  const at::Tensor group_scores =
      std::get<0>(scores.view({tokens, num_groups, -1}).topk(topk / group_topk, -1)).sum(-1);
  const at::Tensor group_idx = std::get<1>(at::topk(group_scores, group_topk, -1, /*largest=*/true, /*sorted=*/false));
  const at::Tensor group_mask = at::zeros_like(group_scores).scatter_(1, group_idx, 1);
  const at::Tensor score_mask =
      group_mask.unsqueeze(-1).expand({tokens, num_groups, experts / num_groups}).reshape({tokens, -1});
  const at::Tensor masked = scores.masked_fill(score_mask.logical_not(), -std::numeric_limits<float>::infinity());
  return at::topk(masked, topk, -1);
}

void check(const at::Tensor& logits, const RouterOptions& o) {
  if (logits.dim() != 2) throw std::invalid_argument("router logits must be [tokens, experts]");
  const std::int64_t experts = logits.size(1);
  if (o.topk < 1 || o.topk > experts)
    throw std::invalid_argument("router topk " + std::to_string(o.topk) + " is not between 1 and the " +
                                std::to_string(experts) + " experts");
  if (o.score_function != "softmax" && o.score_function != "sigmoid")
    throw std::invalid_argument("router score function '" + o.score_function + "' is not softmax or sigmoid");
  if (o.group_topk > 0 &&
      (o.num_groups < 1 || experts % o.num_groups != 0 || o.group_topk > o.num_groups || o.topk % o.group_topk != 0))
    throw std::invalid_argument("group-limited routing needs groups dividing the " + std::to_string(experts) +
                                " experts, group_topk <= groups and topk a multiple of group_topk");
}

}  // namespace

Routing topk_routing(const at::Tensor& logits, const RouterOptions& o) {
  check(logits, o);
  auto top = [&](const at::Tensor& scores) {
    if (o.group_topk > 0) return group_limited_topk(scores, o.topk, o.num_groups, o.group_topk);
    return at::topk(scores, o.topk, 1);
  };
  at::Tensor probs, indices;
  if (o.score_function == "softmax") {
    if (o.pre_softmax) {
      const at::Tensor scores = at::softmax(logits, -1, at::kFloat).type_as(logits);
      std::tie(probs, indices) = top(scores);
    } else {
      at::Tensor scores;
      std::tie(scores, indices) = top(logits);
      probs = at::softmax(scores, -1, at::kFloat).type_as(logits);
    }
  } else {
    at::Tensor scores = at::sigmoid(logits.to(at::kFloat)).type_as(logits);
    if (o.expert_bias) {
      indices = std::get<1>(top(scores + *o.expert_bias));
      scores = at::gather(scores, 1, indices).type_as(logits);
    } else {
      std::tie(scores, indices) = top(scores);
    }
    probs = o.topk > 1 ? scores / (scores.sum(-1, true) + 1e-20) : scores;
  }
  if (o.scaling_factor) probs = probs * *o.scaling_factor;
  Routing r;
  r.probs = at::zeros_like(logits).scatter(1, indices, probs);
  r.map = at::zeros_like(logits, at::kInt).scatter(1, indices, 1).to(at::kBool);
  return r;
}

std::int64_t expert_capacity(std::int64_t tokens, int topk, std::int64_t experts, double factor) {
  const double routed = static_cast<double>(tokens * topk);
  return static_cast<std::int64_t>(std::ceil(routed / static_cast<double>(experts) * factor));
}

Routing drop_over_capacity(const Routing& routing, int topk, const ExpertCapacity& capacity) {
  if (!capacity.factor) return routing;
  const std::int64_t tokens = routing.probs.size(0), experts = routing.probs.size(1);
  const std::int64_t kept = expert_capacity(tokens, topk, experts, *capacity.factor);
  at::Tensor keep;
  if (kept > tokens) {
    keep = at::ones_like(routing.map);
  } else {
    // Each expert's column ordered by what it keeps first, a stable sort so that ties keep the earlier token.
    const at::Tensor key =
        capacity.drop_by_position ? routing.map.to(at::kDouble) : routing.probs.detach().to(at::kDouble);  // exact
    const at::Tensor order = std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/true));
    keep = at::zeros_like(routing.map).scatter(0, order.narrow(0, 0, kept), true);
  }
  Routing dropped;
  dropped.map = capacity.pad ? keep : routing.map & keep;
  dropped.probs = routing.probs * dropped.map.to(routing.probs.scalar_type());
  return dropped;
}

Routing routing_scores_for_aux_loss(const at::Tensor& logits, int topk, const std::string& score_function) {
  at::Tensor scores;
  if (score_function == "softmax") {
    scores = at::softmax(logits, -1, at::kFloat);
  } else if (score_function == "sigmoid") {
    scores = at::sigmoid(logits);
    scores = scores / (scores.sum(-1, true) + 1e-20);
  } else {
    throw std::invalid_argument("router score function '" + score_function + "' is not softmax or sigmoid");
  }
  const at::Tensor indices = std::get<1>(at::topk(scores, topk, 1));
  return {scores, at::zeros_like(logits, at::kInt).scatter(1, indices, 1).to(at::kBool)};
}

at::Tensor load_balancing_loss(const at::Tensor& probs, const at::Tensor& tokens_per_expert, std::int64_t total_tokens,
                               int topk, double coeff, std::int64_t num_experts) {
  const double experts = static_cast<double>(num_experts > 0 ? num_experts : probs.size(1));
  const double t = static_cast<double>(total_tokens);
  return at::sum(probs.sum(0) * tokens_per_expert) * (experts * coeff / (topk * t * t));
}

at::Tensor z_loss(const at::Tensor& logits, double coeff) {
  return at::mean(at::square(at::logsumexp(logits, -1))) * coeff;
}

PermutedTokens permute_tokens(const at::Tensor& tokens, const Routing& routing) {
  const std::int64_t num_tokens = tokens.size(0), experts = routing.map.size(1);
  const at::Tensor by_expert = routing.map.to(at::kBool).t().contiguous();  // [experts, tokens]
  const at::Tensor token_index = at::arange(num_tokens, at::TensorOptions().dtype(at::kLong).device(tokens.device()))
                                     .unsqueeze(0)
                                     .expand({experts, num_tokens});
  PermutedTokens p;
  p.sorted_indices = token_index.masked_select(by_expert);
  p.probs = routing.probs.t().contiguous().masked_select(by_expert);
  p.tokens = tokens.index_select(0, p.sorted_indices);
  p.tokens_per_expert = by_expert.sum(1);
  return p;
}

at::Tensor unpermute_tokens(const at::Tensor& expert_output, const PermutedTokens& permuted, std::int64_t num_tokens) {
  const at::Tensor weighted = expert_output * permuted.probs.unsqueeze(-1);
  const std::int64_t hidden = expert_output.size(1);
  at::Tensor out = at::zeros({num_tokens, hidden}, weighted.options());
  out.scatter_add_(0, permuted.sorted_indices.unsqueeze(1).expand({-1, hidden}), weighted);
  return out.to(expert_output.scalar_type());
}

}  // namespace trestle::train
