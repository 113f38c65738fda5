#include "train/model/context_parallel.h"

#include <torch/autograd.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

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
    throw std::invalid_argument("sequence length " + std::to_string(seq) +
                                " does not divide into 2 x cp = " + std::to_string(2 * cp) + " chunks");
  const std::int64_t chunk = seq / (2 * cp);
  return at::cat({t.narrow(seq_dim, first * chunk, chunk), t.narrow(seq_dim, second * chunk, chunk)}, seq_dim);
}

at::Tensor cp_positions(std::int64_t seq, int cp, int rank, at::Device device) {
  return cp_slice(at::arange(seq, at::TensorOptions().dtype(at::kLong).device(device)), 0, cp, rank);
}

AttentionPartial causal_block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& q_pos, const at::Tensor& k_pos, double scale,
                                        std::int64_t window, double softcap, const at::Tensor& q_doc,
                                        const at::Tensor& k_doc) {
  ScoresAttention options;
  options.scale = scale;
  options.softcap = softcap;
  options.q_positions = q_pos;
  options.k_positions = k_pos;
  options.window = window;
  options.q_documents = q_doc;
  options.k_documents = k_doc;
  return blockwise_attention_with_lse(q, k, v, options);
}

AttentionPartial merge_attention(const AttentionPartial& a, const AttentionPartial& b) {
  const at::Tensor lse = at::logaddexp(a.lse, b.lse);
  const at::Tensor safe = at::where(at::isinf(lse), at::zeros_like(lse), lse);
  const at::Tensor wa = at::exp(a.lse - safe).unsqueeze(-1), wb = at::exp(b.lse - safe).unsqueeze(-1);
  return {a.out * wa + b.out * wb, lse};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Sends `t` to `to` and receives a tensor like it from `from`, both posted before either is waited on.
at::Tensor exchange(const at::Tensor& t, const CpRing& ring, int to, int from) {
  std::vector<at::Tensor> out{at::empty_like(t, at::MemoryFormat::Contiguous)};
  std::vector<at::Tensor> in{t.contiguous()};
  auto sent = ring.backend->send(in, to, /*tag=*/0);
  auto received = ring.backend->recv(out, from, /*tag=*/0);
  sent->wait();
  received->wait();
  return out[0];
}

struct RingShift : torch::autograd::Function<RingShift> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& t, const CpRing& ring) {
    ctx->saved_data["backend"] = c10::IValue(static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&ring)));
    return exchange(t, ring, (ring.rank + 1) % ring.size, (ring.rank + ring.size - 1) % ring.size);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto* ring = reinterpret_cast<const CpRing*>(static_cast<std::intptr_t>(ctx->saved_data["backend"].toInt()));
    return {exchange(grad[0], *ring, (ring->rank + ring->size - 1) % ring->size, (ring->rank + 1) % ring->size),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_shift(const at::Tensor& t, const CpRing& ring) {
  if (ring.size == 1) return t;
  return RingShift::apply(t, ring);
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CpRing& ring,
                          double scale, std::int64_t window, double softcap, const at::Tensor& sinks,
                          const at::Tensor& documents) {
  const std::int64_t local = q.size(2), seq = local * ring.size;
  const at::Tensor q_pos = cp_positions(seq, ring.size, ring.rank);
  TORCH_CHECK(!documents.defined() || (documents.dim() == 2 && documents.size(1) == seq),
              "ring attention's documents must be [batch, ", seq, "], got ", documents.sizes());
  auto documents_of = [&](int rank) {
    return documents.defined() ? cp_slice(documents, 1, ring.size, rank) : at::Tensor();
  };
  const at::Tensor q_doc = documents_of(ring.rank);
  // One message per step; keys and values may differ in head dim (multi-latent attention: DeepSeek-V3's 192 and 128).
  const std::int64_t key_dim = k.size(3), value_dim = v.size(3);
  at::Tensor kv = at::cat({k, v}, -1);
  std::optional<AttentionPartial> merged;
  for (int step = 0; step < ring.size; ++step) {
    if (step > 0) kv = ring_shift(kv, ring);
    const int source = (ring.rank - step + ring.size) % ring.size;
    // The positions on the host, where the blocks' ranges of keys are worked out (blockwise_attention moves them).
    const at::Tensor k_pos = cp_positions(seq, ring.size, source);
    // Every block holds keys some query here sees: each rank's second chunk comes after every first chunk.
    AttentionPartial block = causal_block_attention(q, kv.narrow(-1, 0, key_dim), kv.narrow(-1, key_dim, value_dim),
                                                    q_pos, k_pos, scale, window, softcap, q_doc, documents_of(source));
    merged = merged ? merge_attention(*merged, block) : block;
  }
  if (!sinks.defined()) return merged->out.to(v.scalar_type());
  // A sink is one more term of each head's softmax denominator, whose value contributes nothing.
  const at::Tensor sink = sinks.to(merged->lse.scalar_type()).view({1, -1, 1}).expand_as(merged->lse);
  return (merged->out * at::exp(merged->lse - at::logaddexp(merged->lse, sink)).unsqueeze(-1)).to(v.scalar_type());
}

}  // namespace trestle::train
