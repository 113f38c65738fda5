#include "train/data/gpt_indices.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "train/data/numpy_random.h"

namespace trestle::data {
namespace {

std::int32_t count_epochs(std::int64_t per_epoch, std::optional<std::int64_t> num_samples, const GptIndexOptions& o) {
  if (!num_samples) return 1;
  const std::int64_t requested = *num_samples * o.sequence_length + (o.add_extra_token_to_sequence ? 1 : 0);
  std::int32_t epochs = 1;
  for (std::int64_t tokens = per_epoch; tokens < requested; tokens += per_epoch) ++epochs;
  return epochs;
}

// numpy.mgrid-repeated documents over epochs, then one RandomState.shuffle.
void append_shuffled_epochs(std::span<const std::int32_t> documents, std::int32_t epochs, NumpyRandomState& random,
                            std::vector<std::int64_t>& out) {
  std::vector<std::int32_t> index;
  index.reserve(documents.size() * static_cast<std::size_t>(epochs));
  for (std::int32_t e = 0; e < epochs; ++e) index.insert(index.end(), documents.begin(), documents.end());
  random.shuffle(std::span<std::int32_t>(index));
  out.insert(out.end(), index.begin(), index.end());
}

template <class T>
void append_shuffled_range(std::int64_t begin, std::int64_t end, NumpyRandomState& random,
                           std::vector<std::int64_t>& out) {
  std::vector<T> range(static_cast<std::size_t>(end - begin));
  for (std::size_t i = 0; i < range.size(); ++i) range[i] = static_cast<T>(begin + static_cast<std::int64_t>(i));
  random.shuffle(std::span<T>(range));
  out.insert(out.end(), range.begin(), range.end());
}

// helpers.cpp build_sample_idx: walk the document index, cutting a sample every sequence_length tokens (the extra
// token is shared with the next sample).
std::vector<std::int64_t> build_sample_index(std::span<const std::int32_t> sizes,
                                             std::span<const std::int64_t> document_index, std::int64_t per_epoch,
                                             std::int32_t epochs, const GptIndexOptions& o) {
  const std::int64_t extra = o.add_extra_token_to_sequence ? 1 : 0;
  const std::int64_t tokens = epochs * per_epoch - extra;
  const std::int64_t samples =
      o.drop_last_partial_sequence
          ? tokens / o.sequence_length
          : static_cast<std::int64_t>(std::ceil(static_cast<float>(tokens) / static_cast<float>(o.sequence_length)));
  std::vector<std::int64_t> index;
  index.reserve(2 * static_cast<std::size_t>(samples + 1));
  std::int64_t position = 0;
  std::int64_t offset = 0;
  index.push_back(position);
  index.push_back(offset);
  const auto last = static_cast<std::int64_t>(document_index.size()) - 1;
  for (std::int64_t sample = 1; sample <= samples; ++sample) {
    std::int64_t remaining = o.sequence_length + extra;
    while (remaining != 0) {
      const std::int64_t length =
          sizes[static_cast<std::size_t>(document_index[static_cast<std::size_t>(position)])] - offset;
      remaining -= length;
      if (remaining <= 0) {
        offset += remaining + length - extra;
        remaining = 0;
      } else {
        if (position == last) {
          offset = sizes[static_cast<std::size_t>(document_index[static_cast<std::size_t>(position)])] - extra;
          break;
        }
        ++position;
        offset = 0;
      }
    }
    index.push_back(position);
    index.push_back(offset);
  }
  return index;
}

}  // namespace

std::int64_t tokens_per_epoch(std::span<const std::int32_t> sequence_lengths, std::span<const std::int32_t> documents) {
  std::int64_t tokens = 0;
  for (const auto d : documents) tokens += sequence_lengths[static_cast<std::size_t>(d)];
  return tokens;
}

Result<GptIndices> build_gpt_indices(std::span<const std::int32_t> sequence_lengths,
                                     std::span<const std::int32_t> documents, std::optional<std::int64_t> num_samples,
                                     const GptIndexOptions& options) {
  if (options.sequence_length <= 1) return Status::Error("GPT dataset: sequence length must be above 1");
  for (const auto d : documents)
    if (d < 0 || static_cast<std::size_t>(d) >= sequence_lengths.size())
      return Status::Error("GPT dataset: document " + std::to_string(d) + " outside the dataset's " +
                           std::to_string(sequence_lengths.size()) + " sequences");
  const std::int64_t per_epoch = tokens_per_epoch(sequence_lengths, documents);
  if (per_epoch <= 1)
    return Status::Error("GPT dataset: the exposed documents hold " + std::to_string(per_epoch) +
                         " tokens; at least 2 are needed to build samples");
  if (num_samples && *num_samples < 0) return Status::Error("GPT dataset: negative sample count");
  const std::int64_t extra = options.add_extra_token_to_sequence ? 1 : 0;
  GptIndices out;
  out.num_epochs = count_epochs(per_epoch, num_samples, options);

  bool separate_final_epoch = false;
  std::int64_t samples_before_final_epoch = 0;
  if (out.num_epochs > 1) {
    samples_before_final_epoch = ((out.num_epochs - 1) * per_epoch - extra) / options.sequence_length;
    const std::int64_t from_final_epoch = *num_samples - samples_before_final_epoch;
    const std::int64_t per_epoch_samples = (per_epoch - extra) / options.sequence_length;
    separate_final_epoch = from_final_epoch < static_cast<std::int64_t>(0.80 * static_cast<double>(per_epoch_samples));
  }

  NumpyRandomState random(options.random_seed);
  if (separate_final_epoch) {
    append_shuffled_epochs(documents, out.num_epochs - 1, random, out.document_index);
    append_shuffled_epochs(documents, 1, random, out.document_index);
  } else {
    append_shuffled_epochs(documents, out.num_epochs, random, out.document_index);
  }
  out.sample_index = build_sample_index(sequence_lengths, out.document_index, per_epoch, out.num_epochs, options);
  const std::int32_t longest =
      sequence_lengths.empty() ? 0 : *std::max_element(sequence_lengths.begin(), sequence_lengths.end());
  out.sample_index_is_int64 = std::max<std::int64_t>(static_cast<std::int64_t>(out.document_index.size()), longest) >
                              std::numeric_limits<std::int32_t>::max();

  const auto total = static_cast<std::int64_t>(out.sample_count());
  const std::int64_t first = separate_final_epoch ? samples_before_final_epoch : total;
  out.shuffle_index_is_int64 = total >= static_cast<std::int64_t>(std::numeric_limits<std::uint32_t>::max()) - 1;
  if (out.shuffle_index_is_int64) {
    append_shuffled_range<std::int64_t>(0, first, random, out.shuffle_index);
    if (first != total) append_shuffled_range<std::int64_t>(first, total, random, out.shuffle_index);
  } else {
    append_shuffled_range<std::uint32_t>(0, first, random, out.shuffle_index);
    if (first != total) append_shuffled_range<std::uint32_t>(first, total, random, out.shuffle_index);
  }
  return out;
}

}  // namespace trestle::data
