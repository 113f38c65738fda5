// The mixture-of-experts router's arithmetic as Megatron-Core defines it (moe_utils.py): top-k selection with a
// softmax (after or, with pre_softmax, before the top-k) or sigmoid score, optional group-limited top-k, expert-score
// correction bias and scaling; the scores the load-balancing loss uses; the Switch-style load-balancing (aux) loss and
// the ST-MoE z-loss; and the permutation that groups tokens by expert before dispatch and its inverse, which weights
// each expert's output by the token's routing probability and sums them back. Differentiable through autograd; pure
// functions of their tensors.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace trestle::train {

struct RouterOptions {
  int topk = 2;
  std::string score_function = "softmax";  // or "sigmoid"
  bool pre_softmax = false;                // softmax over all experts before the top-k
  int num_groups = 0;                      // group-limited routing: experts in num_groups equal groups ...
  int group_topk = 0;                      // ... of which each token may use group_topk (0: not limited)
  std::optional<double> scaling_factor;
  std::optional<at::Tensor> expert_bias;  // [experts], added to sigmoid scores for selection only
};

struct Routing {
  at::Tensor probs;  // [tokens, experts]: each token's weight for its selected experts, 0 elsewhere
  at::Tensor map;    // [tokens, experts] bool: the selected experts
};

// logits: [tokens, experts]. Throws std::invalid_argument for options that do not fit (topk > experts, groups that do
// not divide the experts, an unknown score function).
Routing topk_routing(const at::Tensor& logits, const RouterOptions& options);

// Megatron's expert capacity (--moe-expert-capacity-factor, its token dropping): each expert takes at most
// ceil(tokens · topk / experts · factor) of the router's tokens (this rank's, as megatron-core's router sees them);
// the rest of its tokens are dropped (their weight for it 0), by the lowest probability first, or with
// drop_by_position the latest tokens first (ties by probability: the later token dropped). With pad, every expert
// takes exactly capacity rows (its kept tokens, then others at weight 0: megatron-core's
// moe_pad_expert_input_to_capacity), which changes the computed outputs in nothing but does count in the experts'
// loads.
struct ExpertCapacity {
  std::optional<double> factor;  // none: no dropping (Megatron's default)
  bool drop_by_position = false;
  bool pad = false;
};

// The capacity of each expert for `tokens` tokens routed to `topk` experts each (megatron-core's get_capacity).
std::int64_t expert_capacity(std::int64_t tokens, int topk, std::int64_t experts, double factor);

// `routing` with capacity's tokens only (megatron-core's apply_router_token_dropping); unchanged without a factor.
Routing drop_over_capacity(const Routing& routing, int topk, const ExpertCapacity& capacity);

// The (map, scores) the aux loss is computed from: softmax (or sum-normalised sigmoid) of the logits over all experts,
// and the top-k of those scores.
Routing routing_scores_for_aux_loss(const at::Tensor& logits, int topk, const std::string& score_function);

// coeff * E / (topk * T^2) * sum_i (sum_tokens probs[:, i]) * tokens_per_expert[i]; E is num_experts, or probs' columns
// when 0 (the per-sequence loss passes [seq, batch · E] probabilities and E).
at::Tensor load_balancing_loss(const at::Tensor& probs, const at::Tensor& tokens_per_expert, std::int64_t total_tokens,
                               int topk, double coeff, std::int64_t num_experts = 0);

// Megatron's load-balancing losses (--moe-router-load-balancing-type with --moe-aux-loss-coeff: one type, or several
// with a coefficient each) as the coefficient of each kind, 0 for none. micro_batch (aux_loss): the micro-batch's
// tokens, their expert counts over the ranks that split its sequences; sequence (seq_aux_loss): each sequence's
// (DeepSeek-V3's sequence-wise loss), averaged over the sequences; global_batch (global_aux_loss): the expert counts
// over the data-parallel ranks too, averaged over the iteration's micro-batches so far (megatron-core's
// global_tokens_per_expert / ga_steps).
struct LoadBalancingCoefficients {
  double micro_batch = 0.0;
  double sequence = 0.0;
  double global_batch = 0.0;
  bool any() const { return micro_batch > 0 || sequence > 0 || global_batch > 0; }
};

// The router losses Megatron's training log tracks (megatron-core's aux-loss tracker), each without its coefficient,
// in the order its router computes them: z-loss, then the load-balancing losses.
enum RouterLoss : int { kZLoss, kLoadBalancingLoss, kSeqLoadBalancingLoss, kGlobalLoadBalancingLoss, kRouterLosses };
inline constexpr const char* kRouterLossNames[kRouterLosses] = {
    "z_loss", "load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss"};

// coeff * mean over tokens of logsumexp(logits)^2
at::Tensor z_loss(const at::Tensor& logits, double coeff);

// Tokens grouped by expert (expert 0's tokens in token order, then expert 1's, ...), as Megatron's permute without
// token dropping: a token routed to k experts appears k times.
struct PermutedTokens {
  at::Tensor tokens;             // [routed, hidden]
  at::Tensor probs;              // [routed]: the routing probability of each row
  at::Tensor sorted_indices;     // [routed]: the source token of each row
  at::Tensor tokens_per_expert;  // [experts] int64
};
PermutedTokens permute_tokens(const at::Tensor& tokens, const Routing& routing);

// Each row of the experts' output weighted by its routing probability and added into its token's row
// ([num_tokens, hidden], in the rows' dtype).
at::Tensor unpermute_tokens(const at::Tensor& expert_output, const PermutedTokens& permuted, std::int64_t num_tokens);

}  // namespace trestle::train
