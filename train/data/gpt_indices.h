// Megatron-Core's GPT dataset indices, built from a seed exactly as its GPTDataset and C++ helpers build them:
// the document index (the exposed documents repeated per epoch and shuffled, the last epoch shuffled apart when it
// is used for less than 80% of its samples), the sample index (where each sample of seq_length + 1 tokens starts:
// a position in the document index and a token offset) and the shuffle index (a permutation of the samples, the
// separated last epoch permuted on its own). check_gpt_indices is the builder's inverse: what any index built from
// the same documents and options must satisfy, for indices read back from a cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
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

// Megatron's _get_num_epochs: the epochs whose tokens hold num_samples samples (1 for nullopt).
std::int32_t count_epochs(std::int64_t per_epoch, std::optional<std::int64_t> num_samples,
                          const GptIndexOptions& options);
// helpers.cpp build_sample_idx's sample count over `epochs` epochs (rounded up, in float as Megatron does, when the
// last partial sequence is kept).
std::int64_t count_samples(std::int64_t per_epoch, std::int32_t epochs, const GptIndexOptions& options);

// sequence_lengths: the whole dataset's; documents: the exposed sequence ids (a split's range); num_samples: how
// many samples are wanted (more epochs are added until they fit), or nullopt for one epoch.
Result<GptIndices> build_gpt_indices(std::span<const std::int32_t> sequence_lengths,
                                     std::span<const std::int32_t> documents, std::optional<std::int64_t> num_samples,
                                     const GptIndexOptions& options);

// What each array is called in the errors of check_gpt_indices (the cache files they were read from).
struct GptIndexNames {
  std::string document_index = "document_index";
  std::string sample_index = "sample_index";
  std::string shuffle_index = "shuffle_index";
};

// Checks in O(n) that x could have been built by build_gpt_indices from these documents and options with some seed:
// the document index holds each document once per epoch (and the epochs num_samples needs); the sample index starts
// at (0, 0), never goes backwards and each sample spans exactly sequence_length tokens of the document index (only a
// kept last partial sequence may span fewer, ending at the data's end), with the sample count Megatron cuts; the
// shuffle index is a permutation of the samples. An error names the array, the entry and what was expected.
Status check_gpt_indices(const GptIndices& x, std::span<const std::int32_t> sequence_lengths,
                         std::span<const std::int32_t> documents, std::optional<std::int64_t> num_samples,
                         const GptIndexOptions& options, const GptIndexNames& names = {});

}  // namespace trestle::data
