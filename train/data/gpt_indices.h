// Megatron-Core's GPT dataset indices, built from a seed exactly as its GPTDataset and C++ helpers build them:
// the document index (the exposed documents repeated per epoch and shuffled, the last epoch shuffled apart when it
// is used for less than 80% of its samples), the sample index (where each sample of seq_length + 1 tokens starts:
// a position in the document index and a token offset) and the shuffle index (a permutation of the samples, the
// separated last epoch permuted on its own).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "ckpt/status.h"

namespace trestle::data {

struct GptIndexOptions {
  std::int32_t sequence_length = 0;
  std::uint32_t random_seed = 0;
  bool add_extra_token_to_sequence = true;  // samples of sequence_length + 1 tokens (inputs and shifted labels)
  bool drop_last_partial_sequence = true;   // false only for validation with drop_last_partial_validation_sequence off
};

struct GptIndices {
  std::vector<std::int64_t> document_index;  // sequence ids, int32 on disk
  std::vector<std::int64_t> sample_index;    // [samples + 1][2]: (position in document_index, token offset)
  std::vector<std::int64_t> shuffle_index;   // a permutation of [0, samples)
  bool sample_index_is_int64 = false;        // the on-disk dtypes Megatron picks
  bool shuffle_index_is_int64 = false;
  std::int32_t num_epochs = 1;
  std::size_t sample_count() const { return sample_index.size() / 2 - 1; }
};

// Tokens in one epoch over the exposed sequences.
std::int64_t tokens_per_epoch(std::span<const std::int32_t> sequence_lengths, std::span<const std::int32_t> documents);

// sequence_lengths: the whole dataset's; documents: the exposed sequence ids (a split's range); num_samples: how
// many samples are wanted (more epochs are added until they fit), or nullopt for one epoch.
Result<GptIndices> build_gpt_indices(std::span<const std::int32_t> sequence_lengths,
                                     std::span<const std::int32_t> documents, std::optional<std::int64_t> num_samples,
                                     const GptIndexOptions& options);

}  // namespace trestle::data
