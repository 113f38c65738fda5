#include "train/data/gpt_indices.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "ckpt/process_memory.h"
#include "train/data/numpy_random.h"

namespace trestle::data {
namespace {

// The tokens the exposed documents hold in one epoch, after the checks both building and checking indices need.
Result<std::int64_t> exposed_tokens(std::span<const std::int32_t> sequence_lengths,
                                    std::span<const std::int32_t> documents, std::optional<std::int64_t> num_samples,
                                    const GptIndexOptions& options) {
  if (options.sequence_length < 1) return Status::Error("GPT dataset: sequence length must be at least 1");
  for (const auto d : documents)
    if (d < 0 || static_cast<std::size_t>(d) >= sequence_lengths.size())
      return Status::Error("GPT dataset: document " + std::to_string(d) + " outside the dataset's " +
                           std::to_string(sequence_lengths.size()) + " sequences");
  const std::int64_t per_epoch = tokens_per_epoch(sequence_lengths, documents);
  if (per_epoch < 1)  // (Megatron's epoch count would never end)
    return Status::Error("GPT dataset: the exposed documents hold no tokens; samples need at least one");
  if (num_samples && *num_samples < 0) return Status::Error("GPT dataset: negative sample count");
  if (num_samples) {
    // Megatron's helpers take the epoch count as an int32: more epochs than that wrapped around, and a far smaller
    // index was built (and cached) under the description of the one asked for.
    std::int64_t requested = 0;
    if (__builtin_mul_overflow(*num_samples, options.sequence_length, &requested) ||
        requested > std::numeric_limits<std::int64_t>::max() - 1 ||
        (requested + (options.add_extra_token_to_sequence ? 1 : 0) - 1) / per_epoch + 1 >
            std::int64_t{std::numeric_limits<std::int32_t>::max()})
      return Status::Error("GPT dataset: " + std::to_string(*num_samples) + " samples of " +
                           std::to_string(options.sequence_length) +
                           " tokens need more than 2147483647 epochs of the " + "split's " + std::to_string(per_epoch) +
                           " tokens (Megatron's index builder takes an " +
                           "int32 epoch count): ask for fewer samples, or give the split more data");
    // The indices hold every epoch's documents (the shuffled document index) and each sample's start and place in
    // the shuffle: more than this machine's memory is refused before any is built, not found out by running out.
    const std::int64_t epochs = (requested + (options.add_extra_token_to_sequence ? 1 : 0) - 1) / per_epoch + 1;
    const double bytes = static_cast<double>(epochs) * static_cast<double>(documents.size()) * 12.0 +
                         static_cast<double>(*num_samples) * 24.0;
    const auto memory = static_cast<double>(physical_memory_bytes());
    if (memory > 0 && bytes > memory) {
      constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
      char text[512];
      std::snprintf(text, sizeof text,
                    "GPT dataset: %lld samples of %lld tokens need indices of about %.1f GiB (%lld epochs of the "
                    "split's %zu documents), more than this machine's %.1f GiB of memory: ask for fewer samples",
                    static_cast<long long>(*num_samples), static_cast<long long>(options.sequence_length), bytes / kGiB,
                    static_cast<long long>(epochs), documents.size(), memory / kGiB);
      return Status::Error(text);
    }
  }
  return per_epoch;
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
  const std::int64_t samples = count_samples(per_epoch, epochs, o);
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

std::int32_t count_epochs(std::int64_t per_epoch, std::optional<std::int64_t> num_samples,
                          const GptIndexOptions& options) {
  if (!num_samples) return 1;
  // The fewest epochs whose tokens reach the requested (at least one); exposed_tokens() checked it fits an int32.
  const std::int64_t requested = *num_samples * options.sequence_length + (options.add_extra_token_to_sequence ? 1 : 0);
  return static_cast<std::int32_t>(std::max<std::int64_t>(1, (requested - 1) / per_epoch + 1));
}

std::int64_t count_samples(std::int64_t per_epoch, std::int32_t epochs, const GptIndexOptions& options) {
  const std::int64_t tokens = epochs * per_epoch - (options.add_extra_token_to_sequence ? 1 : 0);
  if (options.drop_last_partial_sequence) return tokens / options.sequence_length;
  return static_cast<std::int64_t>(std::ceil(static_cast<float>(tokens) / static_cast<float>(options.sequence_length)));
}

std::int64_t tokens_per_epoch(std::span<const std::int32_t> sequence_lengths, std::span<const std::int32_t> documents) {
  std::int64_t tokens = 0;
  for (const auto d : documents) tokens += sequence_lengths[static_cast<std::size_t>(d)];
  return tokens;
}

Result<GptIndices> build_gpt_indices(std::span<const std::int32_t> sequence_lengths,
                                     std::span<const std::int32_t> documents, std::optional<std::int64_t> num_samples,
                                     const GptIndexOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t per_epoch,
                           exposed_tokens(sequence_lengths, documents, num_samples, options));
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

namespace {

std::string entry(const std::string& name, std::size_t i) { return name + ": entry " + std::to_string(i); }
std::string epochs_text(std::int32_t epochs) { return std::to_string(epochs) + (epochs == 1 ? " epoch" : " epochs"); }

// Whole epochs of the split's documents: each document `epochs` times (however Megatron shuffled them, the separated
// last epoch included) and nothing else.
Status check_document_index(std::span<const std::int64_t> index, std::span<const std::int32_t> documents,
                            std::int32_t epochs, const std::string& name) {
  const std::size_t expected = documents.size() * static_cast<std::size_t>(epochs);
  if (index.size() != expected)
    return Status::Error(name + ": " + std::to_string(index.size()) + " entries, expected " + std::to_string(expected) +
                         " (the split's " + std::to_string(documents.size()) + " documents once in each of " +
                         epochs_text(epochs) + ")");
  const auto [low, high] = std::minmax_element(documents.begin(), documents.end());
  std::vector<std::int64_t> left(static_cast<std::size_t>(*high - *low) + 1, 0);  // appearances still expected
  std::vector<bool> exposed(left.size(), false);
  for (const auto d : documents) {
    left[static_cast<std::size_t>(d - *low)] += epochs;
    exposed[static_cast<std::size_t>(d - *low)] = true;
  }
  for (std::size_t i = 0; i < index.size(); ++i) {
    const std::int64_t d = index[i];
    const bool in_split = d >= *low && d <= *high && exposed[static_cast<std::size_t>(d - *low)];
    if (!in_split)
      return Status::Error(entry(name, i) + " is sequence " + std::to_string(d) +
                           ", not one of the split's documents (sequences " + std::to_string(*low) + " to " +
                           std::to_string(*high) + ")");
    if (left[static_cast<std::size_t>(d - *low)]-- == 0)
      return Status::Error(entry(name, i) + " is sequence " + std::to_string(d) + " again: expected each of the " +
                           "split's documents once in each of " + epochs_text(epochs));
  }
  return OkStatus();
}

// The rows helpers.cpp build_sample_idx writes: row 0 is (0, 0) and each next row starts sequence_length tokens of the
// document index further on (a sample reads sequence_length + extra tokens from row i to row i + 1, the extra one
// shared with the next sample). A row's offset lies inside its document, leaving room for the extra token; the one
// exception is where the walk ran out of documents, (last position, its length - extra), which only a kept last
// partial sequence reaches short of sequence_length tokens. Rows are walked once, the document index with them.
Status check_sample_index(const GptIndices& x, std::span<const std::int32_t> sequence_lengths, std::int64_t per_epoch,
                          std::int32_t epochs, const GptIndexOptions& o, const std::string& name) {
  const std::int64_t extra = o.add_extra_token_to_sequence ? 1 : 0;
  const std::int64_t samples = count_samples(per_epoch, epochs, o);
  const std::span<const std::int64_t> rows = x.sample_index;
  if (rows.size() != 2 * static_cast<std::size_t>(samples + 1))
    return Status::Error(name + ": " + std::to_string(rows.size() / 2) + " rows, expected " +
                         std::to_string(samples + 1) + " (" + std::to_string(samples) + " samples of " +
                         std::to_string(o.sequence_length) + " tokens from " + epochs_text(epochs) + " of " +
                         std::to_string(per_epoch) + " tokens)");
  if (rows[0] != 0 || rows[1] != 0)
    return Status::Error(entry(name, 0) + " is (" + std::to_string(rows[0]) + ", " + std::to_string(rows[1]) +
                         "), expected (0, 0): the first sample starts at the document index's first token");
  const std::size_t positions = x.document_index.size();
  const auto length_at = [&](std::size_t p) {
    return static_cast<std::int64_t>(sequence_lengths[static_cast<std::size_t>(x.document_index[p])]);
  };
  const std::int64_t data_end = epochs * per_epoch - extra;  // where the walk stops when it runs out of documents
  std::size_t position = 0;
  std::int64_t before = 0;  // tokens of the document index before `position`
  std::int64_t previous = 0;
  for (std::size_t i = 1; i <= static_cast<std::size_t>(samples); ++i) {
    const std::int64_t p = rows[2 * i];
    const std::int64_t offset = rows[2 * i + 1];
    if (p < static_cast<std::int64_t>(position))
      return Status::Error(entry(name, i) + " is at document index position " + std::to_string(p) + ", before entry " +
                           std::to_string(i - 1) + "'s " + std::to_string(position) +
                           ": expected rows that never go backwards");
    if (p >= static_cast<std::int64_t>(positions))
      return Status::Error(entry(name, i) + " is at document index position " + std::to_string(p) +
                           ", past the document index's " + std::to_string(positions) + " positions");
    for (; static_cast<std::int64_t>(position) < p; ++position) before += length_at(position);
    const std::int64_t length = length_at(position);
    const bool ran_out = position + 1 == positions && offset == length - extra;
    if (!ran_out && (offset < 0 || offset > length - extra))
      return Status::Error(entry(name, i) + " has offset " + std::to_string(offset) + ", outside sequence " +
                           std::to_string(x.document_index[position]) + "'s " + std::to_string(length) +
                           " tokens at position " + std::to_string(p) +
                           (extra ? " (less the extra token the sample shares with the next)" : ""));
    const std::int64_t start = before + offset;
    const std::int64_t span = start - previous;
    const bool kept_partial =
        !o.drop_last_partial_sequence && start == data_end && span >= 0 && span <= o.sequence_length;
    if (span != o.sequence_length && !kept_partial)
      return Status::Error(name + ": sample " + std::to_string(i - 1) + " (entries " + std::to_string(i - 1) + " to " +
                           std::to_string(i) + ") spans " + std::to_string(span) +
                           " tokens of the document index, expected the sequence length " +
                           std::to_string(o.sequence_length));
    previous = start;
  }
  return OkStatus();
}

Status check_shuffle_index(std::span<const std::int64_t> index, std::size_t samples, const std::string& name) {
  if (index.size() != samples)
    return Status::Error(name + ": " + std::to_string(index.size()) + " entries, expected one for each of the " +
                         std::to_string(samples) + " samples");
  std::vector<bool> seen(samples, false);
  for (std::size_t i = 0; i < index.size(); ++i) {
    const std::int64_t s = index[i];
    if (s < 0 || static_cast<std::size_t>(s) >= samples)
      return Status::Error(entry(name, i) + " is sample " + std::to_string(s) + ", outside the " +
                           std::to_string(samples) + " samples");
    if (seen[static_cast<std::size_t>(s)])
      return Status::Error(entry(name, i) + " is sample " + std::to_string(s) +
                           " again: expected a permutation of the " + std::to_string(samples) + " samples");
    seen[static_cast<std::size_t>(s)] = true;
  }
  return OkStatus();
}

}  // namespace

Status check_gpt_indices(const GptIndices& x, std::span<const std::int32_t> sequence_lengths,
                         std::span<const std::int32_t> documents, std::optional<std::int64_t> num_samples,
                         const GptIndexOptions& options, const GptIndexNames& names) {
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t per_epoch,
                           exposed_tokens(sequence_lengths, documents, num_samples, options));
  const std::int32_t epochs = count_epochs(per_epoch, num_samples, options);
  TRESTLE_RETURN_IF_ERROR(check_document_index(x.document_index, documents, epochs, names.document_index));
  TRESTLE_RETURN_IF_ERROR(check_sample_index(x, sequence_lengths, per_epoch, epochs, options, names.sample_index));
  return check_shuffle_index(x.shuffle_index, x.sample_count(), names.shuffle_index);
}

}  // namespace trestle::data
