#include "train/data/mock_gpt_dataset.h"

#include "train/data/numpy_generator.h"

namespace trestle::data {

MockGptLowLevelDataset::MockGptLowLevelDataset(const MockDataTokenizer& tokenizer)
    : tokenizer_(tokenizer), lengths_(NumpyGenerator(kSeed).integers_int32(1, kMaxSequenceLength, kSize)) {}

Status MockGptLowLevelDataset::read(std::size_t sequence, std::size_t offset, std::optional<std::size_t> length,
                                    std::vector<std::int64_t>& out) const {
  if (sequence >= lengths_.size())
    return Status::Error("mock data: sequence " + std::to_string(sequence) + " of " + std::to_string(lengths_.size()));
  const auto size = static_cast<std::size_t>(lengths_[sequence]);
  if (offset > size || (length && *length > size - offset))
    return Status::Error("mock data: tokens [" + std::to_string(offset) + ", " +
                         (length ? std::to_string(offset + *length) : std::string("end")) + ") of sequence " +
                         std::to_string(sequence) + ", which has " + std::to_string(size));
  const std::size_t end = length ? offset + *length : size;
  // Token k of the sequence: (k + 1) % vocab_size, the last one the end-of-document token.
  for (std::size_t k = offset; k < end; ++k)
    out.push_back(k + 1 == size ? tokenizer_.eod : static_cast<std::int64_t>(k + 1) % tokenizer_.vocab_size);
  return OkStatus();
}

}  // namespace trestle::data
