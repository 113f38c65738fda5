#include "train/loop/micro_batches.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>

namespace trestle::train {

Result<BatchShape> make_batch_shape(std::int64_t micro_batch_size, std::int64_t global_batch_size, int data_parallel,
                                    bool decrease_if_needed) {
  if (micro_batch_size < 1 || global_batch_size < 1 || data_parallel < 1)
    return Status::Error("micro batch size (" + std::to_string(micro_batch_size) + "), global batch size (" +
                         std::to_string(global_batch_size) + ") and data parallel size (" +
                         std::to_string(data_parallel) + ") must be positive");
  if (decrease_if_needed) {
    const std::int64_t unit = micro_batch_size * data_parallel;
    if (global_batch_size < unit)
      return Status::Error("--decrease-batch-size-if-needed: global batch size (" + std::to_string(global_batch_size) +
                           ") is below micro batch size (" + std::to_string(micro_batch_size) +
                           ") times data parallel size (" + std::to_string(data_parallel) + ")");
    global_batch_size -= global_batch_size % unit;
  }
  if (global_batch_size % (micro_batch_size * data_parallel) != 0)
    return Status::Error("global batch size (" + std::to_string(global_batch_size) +
                         ") is not divisible by micro batch size (" + std::to_string(micro_batch_size) +
                         ") times data parallel size (" + std::to_string(data_parallel) + ")");
  return BatchShape{micro_batch_size, global_batch_size, data_parallel};
}

Status check_batch_rampup(const BatchRampup& r, std::int64_t global_batch_size) {
  const std::string given = "--rampup-batch-size " + std::to_string(r.start) + " " + std::to_string(r.increment) + " " +
                            std::to_string(r.samples);
  if (r.start < 1 || r.increment < 1 || r.samples < 1)
    return Status::Error(given + ": the start batch size, the increment and the ramp-up samples must be positive");
  if (r.start >= global_batch_size)
    return Status::Error(given + ": the start batch size must be below --global-batch-size " +
                         std::to_string(global_batch_size) + " (nothing to ramp up)");
  if ((global_batch_size - r.start) % r.increment != 0)
    return Status::Error(given + ": expected global batch size interval (" +
                         std::to_string(global_batch_size - r.start) +
                         ") to be divisible by global batch size increment (" + std::to_string(r.increment) + ")");
  return OkStatus();
}

std::int64_t ramped_global_batch(const BatchRampup& r, std::int64_t global_batch_size, std::int64_t consumed) {
  if (consumed > r.samples) return global_batch_size;
  const double per_increment =
      static_cast<double>(r.samples) / static_cast<double>((global_batch_size - r.start) / r.increment);
  const auto steps = static_cast<std::int64_t>(static_cast<double>(consumed) / per_increment);
  return std::min(global_batch_size, r.start + steps * r.increment);
}

Result<std::int64_t> rampup_train_iterations(const BatchRampup& r, std::int64_t global_batch_size,
                                             std::int64_t train_samples, std::int64_t most) {
  std::int64_t iterations = 0, consumed = 0;
  while (consumed <= r.samples && consumed <= train_samples) {
    consumed += ramped_global_batch(r, global_batch_size, consumed);
    if (++iterations > most)
      return Status::Error("--rampup-batch-size: the ramp-up alone takes more than " + std::to_string(most) +
                           " iterations");
  }
  if (train_samples > consumed) iterations += (train_samples - consumed) / global_batch_size;
  return iterations;
}

namespace {

// megatron-core 0.19's _parse_numeric_value: upper-cased, an optional K/M/B/T suffix, int(float(value) * multiplier).
std::optional<std::int64_t> schedule_number(std::string text) {
  for (char& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double multiplier = 1;
  if (!text.empty()) {
    const char last = text.back();
    const double scale = last == 'T' ? 1e12 : last == 'B' ? 1e9 : last == 'M' ? 1e6 : last == 'K' ? 1e3 : 0;
    if (scale > 0) {
      multiplier = scale;
      text.pop_back();
    }
  }
  if (text.empty() || text.find('X') != std::string::npos) return std::nullopt;  // strtod reads hex; Python does not
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const double scaled = value * multiplier;
  if (end != text.c_str() + text.size() || !std::isfinite(scaled) || std::fabs(scaled) > 9e18) return std::nullopt;
  return static_cast<std::int64_t>(scaled);  // Python's int() truncates toward zero
}

}  // namespace

Result<BatchSizeSteps> parse_step_batch_size_schedule(std::string_view text, std::int64_t sequence_length) {
  const std::string where = "--step-batch-size-schedule '" + std::string(text.substr(0, 200)) + "'";
  std::string words(text);
  std::replace(words.begin(), words.end(), ',', ' ');
  std::istringstream in(words);
  BatchSizeSteps out;
  for (std::string entry; in >> entry;) {
    const std::size_t colon = entry.find(':');
    if (colon == std::string::npos)
      return Status::Error(where + ": invalid schedule entry \"" + entry + "\"; expected THRESHOLD:BATCH_SIZE");
    const auto threshold = schedule_number(entry.substr(0, colon));
    const auto batch = schedule_number(entry.substr(colon + 1));
    if (!threshold || !batch)
      return Status::Error(where + ": \"" + entry + "\" is not two numbers (an optional K, M, B or T after each)");
    if (*threshold < 0) return Status::Error(where + ": \"" + entry + "\": a threshold must not be negative");
    out.steps.emplace_back(*threshold / sequence_length, *batch);
  }
  std::stable_sort(out.steps.begin(), out.steps.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (out.steps.empty()) return Status::Error(where + ": schedule must have at least one entry");
  if (out.steps.front().first != 0)
    return Status::Error(where + ": first schedule entry must have threshold 0, got " +
                         std::to_string(out.steps.front().first) + " samples");
  for (std::size_t i = 1; i < out.steps.size(); ++i)
    if (out.steps[i].first <= out.steps[i - 1].first)
      return Status::Error(where + ": schedule thresholds must be strictly increasing (in samples of " +
                           std::to_string(sequence_length) + " tokens), got " + std::to_string(out.steps[i - 1].first) +
                           " before " + std::to_string(out.steps[i].first));
  for (const auto& [threshold, batch] : out.steps)
    if (batch <= 0) return Status::Error(where + ": batch size must be positive, got " + std::to_string(batch));
  return out;
}

std::int64_t stepped_global_batch(const BatchSizeSteps& schedule, std::int64_t consumed) {
  std::int64_t batch = schedule.steps.front().second;
  for (const auto& [threshold, size] : schedule.steps) {
    if (consumed < threshold) break;
    batch = size;
  }
  return batch;
}

Result<std::int64_t> step_schedule_train_iterations(const BatchSizeSteps& schedule, std::int64_t train_samples,
                                                    std::int64_t most) {
  std::int64_t iterations = 0;
  for (std::int64_t consumed = 0; consumed < train_samples; ++iterations) {
    if (iterations == most)
      return Status::Error("--step-batch-size-schedule: --train-samples takes more than " + std::to_string(most) +
                           " iterations");
    consumed += stepped_global_batch(schedule, consumed);
  }
  return iterations;
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

Result<SampleDocuments> sample_documents(std::vector<std::int64_t> lengths, std::int64_t sequence_length) {
  std::int64_t total = 0;
  for (const std::int64_t n : lengths) {
    if (n < 0) return Status::Error("a document part of negative length " + std::to_string(n));
    total += n;
  }
  if (total > sequence_length + 1)
    return Status::Error("its document parts hold " + std::to_string(total) + " tokens, more than the sequence's " +
                         std::to_string(sequence_length + 1));
  // The extra token read for the last label belongs to no input position: megatron-core takes it off the last part
  // even when the sample was padded, so a short last part can vanish and its tokens join the padding's document below.
  if (!lengths.empty() && lengths.back() > 0) {
    --total;
    if (--lengths.back() == 0) lengths.pop_back();
  }
  // Padding past the data's end joins the last document (or is one, when nothing was read).
  if (total < sequence_length) {
    if (lengths.empty()) lengths.push_back(0);
    lengths.back() += sequence_length - total;
  }
  SampleDocuments out;
  out.documents.reserve(static_cast<std::size_t>(sequence_length));
  out.positions.reserve(static_cast<std::size_t>(sequence_length));
  for (std::size_t d = 0; d < lengths.size(); ++d)
    for (std::int64_t p = 0; p < lengths[d]; ++p) {
      out.documents.push_back(static_cast<std::int64_t>(d));
      out.positions.push_back(p);
    }
  return out;
}

Result<TokenBatch> read_token_batch(const data::SampleSource& source, const std::vector<std::int64_t>& samples,
                                    const BatchOptions& options) {
  const std::int64_t batch = static_cast<std::int64_t>(samples.size()), seq = options.sequence_length;
  std::vector<std::int64_t> text(static_cast<std::size_t>(batch * (seq + 1)));
  std::vector<std::int64_t> documents, positions;
  if (options.inter_document_masking) {
    documents.resize(static_cast<std::size_t>(batch * seq));
    positions.resize(static_cast<std::size_t>(batch * seq));
  }
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t index = samples[static_cast<std::size_t>(b)];
    if (index < 0 || static_cast<std::size_t>(index) >= source.size())
      return Status::Error("sample " + std::to_string(index) + " is past the dataset's " +
                           std::to_string(source.size()) + " samples");
    auto sample = source.sample(static_cast<std::size_t>(index));
    if (!sample.ok()) return sample.status();
    const std::vector<std::int64_t>& ids = sample->tokens;
    if (static_cast<std::int64_t>(ids.size()) != seq + 1)
      return Status::Error("sample " + std::to_string(index) + " has " + std::to_string(ids.size()) +
                           " tokens; sequence length " + std::to_string(seq) + " needs " + std::to_string(seq + 1));
    if (options.vocab_size > 0)
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const std::int64_t id = ids[i];
        if (id != options.pad_token_id && (id < 0 || id >= options.vocab_size))
          return Status::Error("sample " + std::to_string(index) + " holds token id " + std::to_string(id) +
                               " at position " + std::to_string(i) + ", outside the model's vocabulary [0, " +
                               std::to_string(options.vocab_size) + "): the dataset was tokenized for another model");
      }
    std::copy(ids.begin(), ids.end(), text.begin() + b * (seq + 1));
    if (options.inter_document_masking) {
      auto parts = sample_documents(sample->document_lengths, seq);
      if (!parts.ok()) return parts.status().with_context("sample " + std::to_string(index));
      std::copy(parts->documents.begin(), parts->documents.end(), documents.begin() + b * seq);
      std::copy(parts->positions.begin(), parts->positions.end(), positions.begin() + b * seq);
    }
  }
  at::Tensor all = at::tensor(text, at::kLong).view({batch, seq + 1});
  TokenBatch out;
  out.tokens = all.narrow(1, 0, seq).clone();
  out.labels = all.narrow(1, 1, seq).clone();
  out.loss_mask = at::ones({batch, seq}, at::kFloat);
  out.loss_mask.masked_fill_(out.labels == options.pad_token_id, 0.0);
  if (options.eod_mask_loss) out.loss_mask.masked_fill_(out.tokens == options.eod_token_id, 0.0);
  if (options.reset_attention_mask &&
      !options.inter_document_masking) {  // before the padding ids are replaced, as Megatron's masks are made
    const at::Tensor ends = (out.tokens == options.eod_token_id).to(at::kLong);
    out.documents = ends.cumsum(1) - ends;
  }
  out.tokens.masked_fill_(out.tokens == options.pad_token_id, 0);
  out.labels.masked_fill_(out.labels == options.pad_token_id, 0);
  if (options.inter_document_masking) {
    out.documents = at::tensor(documents, at::kLong).view({batch, seq});
    out.positions = at::tensor(positions, at::kLong).view({batch, seq});
  } else {
    out.positions = at::arange(seq, at::kLong).unsqueeze(0).expand({batch, seq}).contiguous();
  }
  return out;
}

}  // namespace trestle::train
