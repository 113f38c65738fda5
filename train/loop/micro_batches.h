// How Megatron cuts an iteration's global batch (its MegatronPretrainingSampler with the "single" data loader): the
// iteration reads samples [consumed, consumed + global_batch) in order; micro-batch k of data-parallel rank d holds
// samples consumed + k·micro·dp + d·micro ... + micro - 1. And how a micro-batch's samples become model inputs
// (GPTDataset's
// __getitem__): tokens = sample[:-1], labels = sample[1:], no loss where the label is padding (or, with eod_mask_loss,
// where the token is the end-of-document token), padding ids replaced by 0, positions 0..seq-1; with
// reset_attention_mask each token's document (its sequence's end-of-document tokens before it), which attention keeps
// within; with inter_document_masking the documents the dataset read the sample from, positions restarting in each.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "ckpt/status.h"
#include "train/data/gpt_dataset.h"

namespace trestle::train {

struct BatchShape {
  std::int64_t micro_batch_size = 1;
  std::int64_t global_batch_size = 1;
  int data_parallel = 1;
  std::int64_t micro_batches() const { return global_batch_size / (micro_batch_size * data_parallel); }
};

// Checks global = micro × dp × (number of micro-batches), as Megatron does, naming the three sizes otherwise. With
// `decrease_if_needed` (Megatron's --decrease-batch-size-if-needed) a global batch that does not divide runs as the
// largest multiple of micro × dp below it (at least one).
Result<BatchShape> make_batch_shape(std::int64_t micro_batch_size, std::int64_t global_batch_size, int data_parallel,
                                    bool decrease_if_needed = false);

// Megatron's --rampup-batch-size START INCREMENT SAMPLES (megatron-core 0.16's
// RampupBatchsizeNumMicroBatchesCalculator): the global batch grows from START by INCREMENT over (global - START) /
// INCREMENT equal shares of SAMPLES consumed samples, then stays at the global batch size.
struct BatchRampup {
  std::int64_t start = 0;
  std::int64_t increment = 0;
  std::int64_t samples = 0;
};
// Megatron's checks of a ramp-up towards `global_batch_size` (the interval divisible by the increment), and those
// where its division by zero would fail (no increments, no samples).
Status check_batch_rampup(const BatchRampup& rampup, std::int64_t global_batch_size);
// The global batch size once `consumed` samples are done (megatron-core's update(): the share count truncated from a
// double division, as Python's int(consumed / per_increment)).
std::int64_t ramped_global_batch(const BatchRampup& rampup, std::int64_t global_batch_size, std::int64_t consumed);
// Megatron's update_train_iters for sample-based training with a ramp-up: the ramp-up's iterations while consumed
// samples stay within both the ramp-up's and the training's, then whole global batches of what is left. The ramp-up's
// iterations are counted one by one, so more than `most` of them are refused rather than counted.
Result<std::int64_t> rampup_train_iterations(const BatchRampup& rampup, std::int64_t global_batch_size,
                                             std::int64_t train_samples, std::int64_t most = 1'000'000'000);

// Megatron-LM 0.19's --step-batch-size-schedule "THRESHOLD:BATCH ..." (megatron-core 0.19's
// StepBatchsizeNumMicroBatchesCalculator): from THRESHOLD tokens on (integer division by the sequence length makes
// them samples), the global batch is BATCH. Numbers may end in K, M, B or T (1e3 ... 1e12) and be decimals; entries
// are separated by spaces or commas and sorted by threshold. `steps`: (threshold in samples, batch), ascending.
struct BatchSizeSteps {
  std::vector<std::pair<std::int64_t, std::int64_t>> steps;
};
Result<BatchSizeSteps> parse_step_batch_size_schedule(std::string_view text, std::int64_t sequence_length);
std::int64_t stepped_global_batch(const BatchSizeSteps& schedule, std::int64_t consumed);
// Megatron-LM 0.19's update_train_iters with a step schedule: iterations until train_samples are consumed, counted one
// by one (more than `most` refused).
Result<std::int64_t> step_schedule_train_iterations(const BatchSizeSteps& schedule, std::int64_t train_samples,
                                                    std::int64_t most = 1'000'000'000);

// The sample indices of micro-batch `micro` of data-parallel rank `dp_rank` in the iteration that starts at `consumed`.
std::vector<std::int64_t> micro_batch_samples(const BatchShape& shape, std::int64_t consumed, int dp_rank,
                                              std::int64_t micro);

struct TokenBatch {
  at::Tensor tokens;     // [batch, seq] int64
  at::Tensor labels;     // [batch, seq] int64
  at::Tensor loss_mask;  // [batch, seq] fp32: 1 where the label counts
  at::Tensor positions;  // [batch, seq] int64
  // Megatron's --reset-attention-mask: token i's document, the number of end-of-document tokens before it in its
  // sequence (with --dataloader-inter-document-masking: the dataset's document it came from) ([batch, seq] int64, the
  // whole sequences even under context parallelism); a token attends only to the tokens of its own document.
  // Undefined: every token attends to every earlier one.
  at::Tensor documents;
  // Models with multi-token prediction: the tokens, labels and loss mask depth d = 1..D sees, [D, batch, seq]
  // (shifted_ahead of the whole sequences); undefined otherwise.
  at::Tensor mtp_tokens, mtp_labels, mtp_loss_mask;
};

// The batch's tensors on `device`. To a GPU they go through pinned host memory without the host waiting: a copy
// from pageable memory first waits for all the work already queued on the stream, idling the GPU at every batch.
TokenBatch on_device(TokenBatch batch, at::Device device);

struct BatchOptions {
  std::int64_t sequence_length = 0;
  std::int64_t pad_token_id = -1;  // the dataset's pad id (Megatron's _PAD_TOKEN_ID)
  bool eod_mask_loss = false;
  std::int64_t eod_token_id = -1;
  bool reset_attention_mask = false;  // fill TokenBatch::documents (eod_token_id ends a document)
  // Megatron's --dataloader-inter-document-masking: TokenBatch::documents from the dataset's document parts
  // (sample_documents), and positions counted from each document's start.
  bool inter_document_masking = false;
  std::int64_t vocab_size = 0;  // > 0: every token but the pad id must lie in [0, vocab_size)
};

// megatron-core's GPTDataset with inter_document_masking: a sample's documents from the tokens each document part
// contributed (data::Sample::document_lengths). The extra token for the last label comes off the last part (an emptied
// part is dropped), padding up to sequence_length joins the last document, and every token gets its document's
// number and its position within it (megatron-core's cu_seqlens and reset position_ids, one entry per token).
struct SampleDocuments {
  std::vector<std::int64_t> documents;  // sequence_length entries, non-decreasing from 0
  std::vector<std::int64_t> positions;  // 0 at each document's first token
};
Result<SampleDocuments> sample_documents(std::vector<std::int64_t> lengths, std::int64_t sequence_length);

// Reads the samples and builds the inputs. Errors name the sample when it is out of range, not sequence + 1 long, or
// holds a token id outside the model's vocabulary (a dataset tokenized for another model).
Result<TokenBatch> read_token_batch(const data::SampleSource& source, const std::vector<std::int64_t>& samples,
                                    const BatchOptions& options);

}  // namespace trestle::train
