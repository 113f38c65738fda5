// Context parallelism's arithmetic: the sequence is cut into 2·cp chunks and rank r holds chunks r and 2cp−1−r
// (Megatron's get_batch_on_this_cp_rank), which balances the causal attention work; a rank's queries attend to the
// whole sequence's keys and values one block at a time (the ring: its own block first, then each other rank's), each
// block giving a partial output and its log-sum-exp, merged exactly. ring_attention moves the blocks: each step
// passes the keys and values to the next rank of the context-parallel group (point to point, through autograd, so
// backward passes their gradients back around the ring).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "train/model/blockwise_attention.h"

namespace trestle::train {

// The two chunks of 2·cp that rank `rank` holds.
std::array<std::int64_t, 2> cp_chunks(int cp, int rank);
// `t` sliced along `seq_dim` to this rank's two chunks, in order; the length must divide by 2·cp.
at::Tensor cp_slice(const at::Tensor& t, std::int64_t seq_dim, int cp, int rank);
// The global positions of this rank's tokens in a sequence of `seq` tokens (int64 [seq / cp], on `device`).
at::Tensor cp_positions(std::int64_t seq, int cp, int rank, at::Device device = at::kCPU);

// One block's attention: q [b, heads, sq, d] over k, v [b, groups, sk, d] (each group serving heads / groups query
// heads), key j visible to query i when k_pos[j] <= q_pos[i] (k_pos not decreasing). out is softmax-weighted v over
// the visible keys (0 for a query that sees none), lse its log-sum-exp (-inf then), fp32; a block of queries at a time
// (blockwise_attention.h).
// With `window` > 0 a key is also hidden when it is `window` or more positions before the query (sliding window);
// with `softcap` > 0 the scaled scores are soft-capped, softcap · tanh(score / softcap) (Gemma 2); with q_doc [b, sq]
// and k_doc [b, sk] defined (the tokens' documents, TokenBatch::documents), a key of another document is hidden too.
AttentionPartial causal_block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& q_pos, const at::Tensor& k_pos, double scale,
                                        std::int64_t window = 0, double softcap = 0.0,
                                        const at::Tensor& q_doc = at::Tensor(), const at::Tensor& k_doc = at::Tensor());
// The attention over the union of both blocks' keys (the output in the log-sum-exps' wider dtype, for the next merge).
AttentionPartial merge_attention(const AttentionPartial& a, const AttentionPartial& b);

// The context-parallel group of this rank (null backend when size 1).
struct CpRing {
  c10::intrusive_ptr<c10d::Backend> backend;
  int rank = 0;
  int size = 1;
};

// One step of the ring: sends `t` to rank + 1 and returns rank - 1's (same shape and dtype); its backward sends the
// gradient to rank - 1 and takes rank + 1's. Every rank of the ring must call it the same number of times.
at::Tensor ring_shift(const at::Tensor& t, const CpRing& ring);

// Causal attention of this rank's queries over the whole sequence (sequence length 2·cp·chunk, this rank holding
// cp_slice's chunks): q [b, heads, s, d]; k, v [b, groups, s, d], each group serving heads / groups query heads.
// The keys and values go around the ring; returns [b, heads, s, d] (softmax scale `scale`; window and softcap as
// causal_block_attention's; `sinks` [heads], when defined, one more logit per head in each softmax's denominator;
// `documents` [b, whole sequence], when defined, the tokens' documents, attention kept within each).
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CpRing& ring,
                          double scale, std::int64_t window = 0, double softcap = 0.0,
                          const at::Tensor& sinks = at::Tensor(), const at::Tensor& documents = at::Tensor());

}  // namespace trestle::train
