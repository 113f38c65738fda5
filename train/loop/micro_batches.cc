#include "train/loop/micro_batches.h"

#include <ATen/ATen.h>

#include <string>

namespace trestle::train {

Result<BatchShape> make_batch_shape(std::int64_t micro_batch_size, std::int64_t global_batch_size, int data_parallel) {
  if (micro_batch_size < 1 || global_batch_size < 1 || data_parallel < 1)
    return Status::Error("micro batch size (" + std::to_string(micro_batch_size) + "), global batch size (" +
                         std::to_string(global_batch_size) + ") and data parallel size (" +
                         std::to_string(data_parallel) + ") must be positive");
  if (global_batch_size % (micro_batch_size * data_parallel) != 0)
    return Status::Error("global batch size (" + std::to_string(global_batch_size) +
                         ") is not divisible by micro batch size (" + std::to_string(micro_batch_size) +
                         ") times data parallel size (" + std::to_string(data_parallel) + ")");
  return BatchShape{micro_batch_size, global_batch_size, data_parallel};
}

std::vector<std::int64_t> micro_batch_samples(const BatchShape& shape, std::int64_t consumed, int dp_rank,
                                              std::int64_t micro) {
  const std::int64_t first = consumed + micro * shape.micro_batch_size * shape.data_parallel +
                             static_cast<std::int64_t>(dp_rank) * shape.micro_batch_size;
  std::vector<std::int64_t> samples(static_cast<std::size_t>(shape.micro_batch_size));
  for (std::int64_t i = 0; i < shape.micro_batch_size; ++i) samples[static_cast<std::size_t>(i)] = first + i;
  return samples;
}

TokenBatch on_device(TokenBatch batch, at::Device device) {
  if (!device.is_cuda()) return batch;
  for (at::Tensor* t : {&batch.tokens, &batch.labels, &batch.loss_mask, &batch.positions, &batch.documents,
                        &batch.mtp_tokens, &batch.mtp_labels, &batch.mtp_loss_mask})
    if (t->defined() && !t->is_cuda()) *t = t->pin_memory().to(device, /*non_blocking=*/true);
  return batch;
}

Result<TokenBatch> read_token_batch(const data::SampleSource& source, const std::vector<std::int64_t>& samples,
                                    const BatchOptions& options) {
  const std::int64_t batch = static_cast<std::int64_t>(samples.size()), seq = options.sequence_length;
  std::vector<std::int64_t> text(static_cast<std::size_t>(batch * (seq + 1)));
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t index = samples[static_cast<std::size_t>(b)];
    if (index < 0 || static_cast<std::size_t>(index) >= source.size())
      return Status::Error("sample " + std::to_string(index) + " is past the dataset's " +
                           std::to_string(source.size()) + " samples");
    auto sample = source.sample(static_cast<std::size_t>(index));
    if (!sample.ok()) return sample.status();
    if (static_cast<std::int64_t>(sample->size()) != seq + 1)
      return Status::Error("sample " + std::to_string(index) + " has " + std::to_string(sample->size()) +
                           " tokens; sequence length " + std::to_string(seq) + " needs " + std::to_string(seq + 1));
    if (options.vocab_size > 0)
      for (std::size_t i = 0; i < sample->size(); ++i) {
        const std::int64_t id = (*sample)[i];
        if (id != options.pad_token_id && (id < 0 || id >= options.vocab_size))
          return Status::Error("sample " + std::to_string(index) + " holds token id " + std::to_string(id) +
                               " at position " + std::to_string(i) + ", outside the model's vocabulary [0, " +
                               std::to_string(options.vocab_size) + "): the dataset was tokenized for another model");
      }
    std::copy(sample->begin(), sample->end(), text.begin() + b * (seq + 1));
  }
  at::Tensor all = at::tensor(text, at::kLong).view({batch, seq + 1});
  TokenBatch out;
  out.tokens = all.narrow(1, 0, seq).clone();
  out.labels = all.narrow(1, 1, seq).clone();
  out.loss_mask = at::ones({batch, seq}, at::kFloat);
  out.loss_mask.masked_fill_(out.labels == options.pad_token_id, 0.0);
  if (options.eod_mask_loss) out.loss_mask.masked_fill_(out.tokens == options.eod_token_id, 0.0);
  if (options.reset_attention_mask) {  // before the padding ids are replaced, as Megatron's masks are made
    const at::Tensor ends = (out.tokens == options.eod_token_id).to(at::kLong);
    out.documents = ends.cumsum(1) - ends;
  }
  out.tokens.masked_fill_(out.tokens == options.pad_token_id, 0);
  out.labels.masked_fill_(out.labels == options.pad_token_id, 0);
  out.positions = at::arange(seq, at::kLong).unsqueeze(0).expand({batch, seq}).contiguous();
  return out;
}

}  // namespace trestle::train
