#include "train/model/context_parallel.h"

#include <gtest/gtest.h>

#include <cmath>

namespace trestle::train {
namespace {

TEST(ContextParallel, RankHoldsChunksRAndTwoCpMinusOneMinusR) {
  EXPECT_EQ(cp_chunks(2, 0), (std::array<std::int64_t, 2>{0, 3}));
  EXPECT_EQ(cp_chunks(2, 1), (std::array<std::int64_t, 2>{1, 2}));
  EXPECT_EQ(cp_chunks(4, 3), (std::array<std::int64_t, 2>{3, 4}));
  const at::Tensor pos = cp_positions(16, 2, 0);
  EXPECT_TRUE(at::equal(pos, at::tensor({0, 1, 2, 3, 12, 13, 14, 15}, at::kLong)));
  // every position once over the ranks
  const at::Tensor all = at::cat({cp_positions(24, 3, 0), cp_positions(24, 3, 1), cp_positions(24, 3, 2)});
  EXPECT_TRUE(at::equal(std::get<0>(at::sort(all)), at::arange(24, at::kLong)));
  EXPECT_THROW(cp_positions(10, 3, 0), std::invalid_argument);
  EXPECT_THROW(cp_chunks(2, 2), std::invalid_argument);
}

// Each rank's queries over every rank's key/value block in ring order, merged by log-sum-exp, reassembled in global
// order, equal LibTorch's causal scaled-dot-product attention over the whole sequence.
TEST(ContextParallel, RingOfBlocksEqualsFullCausalAttention) {
  at::manual_seed(3);
  const std::int64_t b = 2, h = 3, seq = 24, d = 8;
  const at::Tensor q = at::randn({b, h, seq, d}), k = at::randn({b, h, seq, d}), v = at::randn({b, h, seq, d});
  const at::Tensor full = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int cp : {1, 2, 3, 4}) {
    at::Tensor assembled = at::empty_like(full);
    for (int rank = 0; rank < cp; ++rank) {
      const at::Tensor q_local = cp_slice(q, 2, cp, rank), q_pos = cp_positions(seq, cp, rank);
      AttentionPartial acc;
      for (int step = 0; step < cp; ++step) {
        const int source = (rank - step + cp) % cp;  // the block the ring has brought here at this step
        const auto part = causal_block_attention(q_local, cp_slice(k, 2, cp, source), cp_slice(v, 2, cp, source),
                                                 q_pos, cp_positions(seq, cp, source), scale);
        acc = step == 0 ? part : merge_attention(acc, part);
      }
      ASSERT_FALSE(at::isinf(acc.lse).any().item<bool>());  // every query sees at least itself
      assembled.index_copy_(2, q_pos, acc.out);
    }
    EXPECT_LE((assembled - full).abs().max().item<float>(), 1e-5) << "cp " << cp;
  }
}

// With documents (each sequence's own, of uneven lengths) the ring's blocks, masked by document, equal LibTorch's
// attention over the whole sequence with the mask causal within each document; so do they with a sliding window too.
TEST(ContextParallel, RingOfBlocksMaskedByDocumentEqualsFullMaskedAttention) {
  at::manual_seed(5);
  const std::int64_t b = 2, h = 2, seq = 24, d = 8, window = 5;
  const at::Tensor q = at::randn({b, h, seq, d}), k = at::randn({b, h, seq, d}), v = at::randn({b, h, seq, d});
  // Sequence 0: documents of 3, 10 and 11 tokens; sequence 1: one of 20, then one of 4.
  at::Tensor documents = at::zeros({b, seq}, at::kLong);
  documents[0].narrow(0, 3, 10).fill_(1);
  documents[0].narrow(0, 13, 11).fill_(2);
  documents[1].narrow(0, 20, 4).fill_(1);
  const at::Tensor i = at::arange(seq, at::kLong).unsqueeze(1), j = i.transpose(0, 1);
  const at::Tensor same = (documents.unsqueeze(2) == documents.unsqueeze(1)).unsqueeze(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (const std::int64_t w : {std::int64_t{0}, window}) {
    at::Tensor allowed = same & (j <= i);
    if (w > 0) allowed = allowed & (i - j < w);
    const at::Tensor full = at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, scale);
    for (int cp : {1, 2, 3}) {
      at::Tensor assembled = at::empty_like(full);
      for (int rank = 0; rank < cp; ++rank) {
        const at::Tensor q_pos = cp_positions(seq, cp, rank), q_doc = cp_slice(documents, 1, cp, rank);
        AttentionPartial acc;
        for (int step = 0; step < cp; ++step) {
          const int source = (rank - step + cp) % cp;
          const auto part = causal_block_attention(cp_slice(q, 2, cp, rank), cp_slice(k, 2, cp, source),
                                                   cp_slice(v, 2, cp, source), q_pos, cp_positions(seq, cp, source),
                                                   scale, w, 0.0, q_doc, cp_slice(documents, 1, cp, source));
          acc = step == 0 ? part : merge_attention(acc, part);
        }
        assembled.index_copy_(2, q_pos, acc.out);
      }
      EXPECT_LE((assembled - full).abs().max().item<float>(), 1e-5) << "cp " << cp << ", window " << w;
    }
  }
  // The mask matters: causal attention over the whole sequence differs.
  EXPECT_GT((at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, scale) -
             at::scaled_dot_product_attention(q, k, v, same & (j <= i), 0.0, false, scale))
                .abs()
                .max()
                .item<float>(),
            0.1);
}

TEST(ContextParallel, ABlockAQuerySeesNothingOfGivesZeroAndMinusInfinity) {
  const at::Tensor q = at::randn({1, 1, 2, 4}), k = at::randn({1, 1, 3, 4}), v = at::randn({1, 1, 3, 4});
  const auto part = causal_block_attention(q, k, v, at::tensor({0, 1}, at::kLong), at::tensor({5, 6, 7}, at::kLong),
                                           0.5);
  EXPECT_TRUE(at::isinf(part.lse).all().item<bool>());
  EXPECT_EQ(part.out.abs().max().item<float>(), 0.0f);
  // merging it changes nothing
  const auto seen = causal_block_attention(q, k, v, at::tensor({9, 9}, at::kLong), at::tensor({0, 1, 2}, at::kLong),
                                           0.5);
  const auto merged = merge_attention(seen, part);
  EXPECT_TRUE(at::allclose(merged.out, seen.out));
  EXPECT_TRUE(at::allclose(merged.lse, seen.lse));
}

}  // namespace
}  // namespace trestle::train
