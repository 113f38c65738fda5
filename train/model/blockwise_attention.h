// Causal attention computed from its scores a block of queries at a time, for what no fused kernel takes: soft-capped
// scores (Gemma 2: cap · tanh(q·kᵀ · scale / cap)) and attention sinks (GPT-OSS: one logit per head joining each
// softmax's denominator), and context parallelism's ring blocks, merged by their log-sum-exps. FlashAttention's
// scheme in ATen's ops, on any device: forward keeps each query's log-sum-exp, not its probabilities, and backward
// recomputes each block's scores, so one block's scores are held at a time instead of [b, heads, sq, sk] per layer;
// keys after a block's last query (and before its window) are never scored.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>

namespace trestle::train {

struct ScoresAttention {
  double scale = 1.0;  // the scores' scale before the cap
  double softcap = 0;  // > 0: scores soft-capped at it
  at::Tensor sinks;    // [heads], one logit per head in each softmax's denominator; undefined: none
  // The queries' [sq] and the keys' [sk] positions (int64, the keys' not decreasing; both undefined: 0, 1, ..., and
  // sq = sk). A key after its query's position is hidden.
  at::Tensor q_positions, k_positions;
  // > 0: a key `window` or more positions before its query is hidden too (sliding window).
  std::int64_t window = 0;
  // The tokens' documents ([b, sq] and [b, sk]; undefined: none): a key of another document is hidden too.
  at::Tensor q_documents, k_documents;
  // Which keys each query may attend to besides (bool, true = may), [sq, sk] or [b, 1, sq, sk]; none: every key the
  // positions, window and documents leave.
  std::optional<at::Tensor> allowed;
  // Scores held at a time (batch · heads · block rows · sk); 0: a default for the device. At least one row a block.
  std::int64_t block_scores = 0;
};

// A block's attention: the output and each query's log-sum-exp (-inf for a query that sees no key and has no sink).
struct AttentionPartial {
  at::Tensor out;  // [b, heads, sq, dv]
  at::Tensor lse;  // [b, heads, sq], fp32 (double for double inputs)
};

// q [b, heads, sq, d]; k [b, groups, sk, d] and v [b, groups, sk, dv], each group serving heads / groups consecutive
// query heads. The output (0 for a query that sees no key and has no sink) and the log-sum-exps, both differentiable
// in q, k, v and the sinks; softmax in fp32 (double for double inputs), the products in the inputs' dtype.
AttentionPartial blockwise_attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const ScoresAttention& options);
// Its output alone: [b, heads, sq, dv].
at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const ScoresAttention& options);

// The same from the whole score matrix through autograd (ATen's composite: --no-fused-kernels), q, k, v of one
// length, masked as causal, by the window and by `allowed` (no positions or documents): [b, heads, s, dv]; a query
// that sees nothing gets NaN.
at::Tensor whole_matrix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const ScoresAttention& options);

}  // namespace trestle::train
