// The vocabulary-parallel ends of the model, as Megatron-Core computes them: each tensor-parallel rank holds rows
// [start, start + rows) of the padded vocabulary. The embedding looks up the ids inside its rows (zeros elsewhere) and
// the partial results are summed over the group; the cross-entropy never gathers the logits: an all-reduce MAX of
// the row maxima, then all-reduce SUMs of the target logit and of Σexp, loss = log Σexp − target logit, and the
// gradient is softmax − one-hot on each rank's own columns.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

#include "train/model/tp_group.h"

namespace trestle::train {

struct VocabRange {
  std::int64_t start = 0;  // first padded-vocab row this rank holds
  std::int64_t rows = 0;   // rows this rank holds (padded vocab / tp)
  std::int64_t valid = 0;  // of those, rows of the real vocabulary; the rest is padding
};
VocabRange vocab_range(std::int64_t vocab_size, std::int64_t padded_vocab_size, const TpGroup& group);

// ids [batch, seq] (int64, global ids) -> this rank's partial embeddings [batch, seq, hidden]: rows of `weight`
// ([rows, hidden]) for the ids it holds, zeros for the others. The caller reduces them over the group.
at::Tensor vocab_parallel_embedding_partial(const at::Tensor& ids, const at::Tensor& weight, const VocabRange& range);

// logits [..., rows] (this rank's columns) and targets [...] (global ids) -> per-token loss [...] in fp32. Padding
// columns take no part in the softmax, so the loss is the one over the real vocabulary (Hugging Face's); with a vocab
// that needs no padding it is Megatron's exactly.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const VocabRange& range,
                                        const TpGroup& group);

}  // namespace trestle::train
