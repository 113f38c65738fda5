// Causal attention computed from its scores a block of queries at a time, for what no fused kernel takes: soft-capped
// scores (Gemma 2: cap · tanh(q·kᵀ · scale / cap)) and attention sinks (GPT-OSS: one logit per head joining each
// softmax's denominator). FlashAttention's scheme in ATen's ops, on any device: forward keeps each query's log-sum-exp,
// not its probabilities, and backward recomputes each block's scores, so one block's scores are held at a time instead
// of [b, heads, s, s] per layer; keys after a block's last query (and before its window) are never scored.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>

namespace trestle::train {

struct ScoresAttention {
  double scale = 1.0;  // the scores' scale before the cap
  double softcap = 0;  // > 0: scores soft-capped at it
  at::Tensor sinks;    // [heads], one logit per head in each softmax's denominator; undefined: none
  // Which keys each query may attend to (bool, true = may), [s, s] or [b, 1, s, s], within the causal triangle; none:
  // causal.
  std::optional<at::Tensor> allowed;
  // > 0: `allowed` hides every key `window` or more positions before its query (those keys are skipped).
  std::int64_t window = 0;
  // Scores held at a time (batch · heads · block rows · keys); 0: a default for the device. At least one row a block.
  std::int64_t block_scores = 0;
};

// q [b, heads, s, d]; k [b, groups, s, d] and v [b, groups, s, dv], each group serving heads / groups consecutive query
// heads. Returns [b, heads, s, dv] (0 for a query that sees no key and has no sink), differentiable in q, k, v and the
// sinks; softmax in fp32 (double for double inputs), the products in the inputs' dtype.
at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const ScoresAttention& options);

}  // namespace trestle::train
