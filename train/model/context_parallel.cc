#include "train/model/context_parallel.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace trestle::train {

std::array<std::int64_t, 2> cp_chunks(int cp, int rank) {
  if (cp < 1 || rank < 0 || rank >= cp)
    throw std::invalid_argument("context parallel rank " + std::to_string(rank) + " of " + std::to_string(cp));
  return {rank, 2 * static_cast<std::int64_t>(cp) - 1 - rank};
}

at::Tensor cp_slice(const at::Tensor& t, std::int64_t seq_dim, int cp, int rank) {
  const auto [first, second] = cp_chunks(cp, rank);
  const std::int64_t seq = t.size(seq_dim);
  if (seq % (2 * cp) != 0)
    throw std::invalid_argument("sequence length " + std::to_string(seq) + " does not divide into 2 x cp = " +
                                std::to_string(2 * cp) + " chunks");
  const std::int64_t chunk = seq / (2 * cp);
  return at::cat({t.narrow(seq_dim, first * chunk, chunk), t.narrow(seq_dim, second * chunk, chunk)}, seq_dim);
}

at::Tensor cp_positions(std::int64_t seq, int cp, int rank) {
  return cp_slice(at::arange(seq, at::kLong), 0, cp, rank);
}

AttentionPartial causal_block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& q_pos, const at::Tensor& k_pos, double scale) {
  const at::Tensor visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1);  // [sq, sk]
  const at::Tensor scores =
      at::matmul(q, k.transpose(-2, -1)).mul(scale).masked_fill(visible.logical_not(),
                                                                 -std::numeric_limits<float>::infinity());
  const at::Tensor lse = at::logsumexp(scores, -1);  // -inf for a query that sees nothing
  const at::Tensor safe_lse = at::where(at::isinf(lse), at::zeros_like(lse), lse);
  const at::Tensor weights = at::exp(scores - safe_lse.unsqueeze(-1));  // exp(-inf) = 0 on hidden keys
  return {at::matmul(weights, v), lse};
}

AttentionPartial merge_attention(const AttentionPartial& a, const AttentionPartial& b) {
  const at::Tensor lse = at::logaddexp(a.lse, b.lse);
  const at::Tensor safe = at::where(at::isinf(lse), at::zeros_like(lse), lse);
  const at::Tensor wa = at::exp(a.lse - safe).unsqueeze(-1), wb = at::exp(b.lse - safe).unsqueeze(-1);
  return {a.out * wa + b.out * wb, lse};
}

}  // namespace trestle::train
