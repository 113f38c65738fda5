// The output layer fused with the vocabulary-parallel cross-entropy, in chunks of tokens: the [tokens, vocab / tp]
// logits are never held whole, only one chunk's at a time. Forward computes each chunk's logits (with Gemma 2's final
// soft-cap when given), the vocab-parallel log-sum-exp (all-reduce MAX, then SUM of Σexp and of the target logit over
// the tensor-parallel group, as vocab_parallel.h) and keeps one float per token; backward recomputes each chunk's
// logits (kept from forward instead when one chunk holds every token) and turns softmax − one-hot into the input's
// gradient and the weight's (accumulated into its main-grad buffer with gradient accumulation fusion, fused_linear.h).
// The weighted sum (the trainer's loss) makes those gradients in the forward pass instead. Same loss and gradients as
// output layer + cross-entropy within fp32 rounding.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

#include "train/model/fused_linear.h"
#include "train/model/tp_group.h"
#include "train/model/vocab_parallel.h"

namespace trestle::train {

struct OutputLossOptions {
  double softcap = 0.0;            // cap · tanh(logits / cap) before the softmax (0: none)
  std::int64_t chunk_tokens = 1024;  // tokens per chunk
  WeightGradSink* sink = nullptr;  // the weight's gradient goes here (null: to autograd)
  // The passes over each chunk's logits by the fused cross-entropy kernels (fused_kernels.h: the logits read in the
  // layer's dtype, one pass for the maxima, one for the sums, one for the gradient) instead of ATen's ops on fp32
  // logits. The model asks for them with its fused kernels (on the CPU the vectorised builds of kernels/cpu).
  bool fused_kernels = false;
};

// Tokens per chunk for `vocab_rows` rows of the output layer on `device`, whatever the vocabulary: about 8 M logits
// (32 MiB in fp32) on the CPU; 32 M (128 MiB) on a GPU, where every chunk reads and writes the whole fp32 weight
// gradient once more and wider chunks run the GEMMs faster (at vocab 32000: 1048 tokens, a quarter of 4096).
std::int64_t output_loss_chunk_tokens(std::int64_t vocab_rows, at::Device device);

// hidden [..., h] (the output layer's input, the whole sequence on every tp rank), weight [rows, h] (this rank's
// vocabulary rows, vocab_range), targets [...] (global ids) -> per-token loss [...] in fp32.
at::Tensor chunked_output_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                        const VocabRange& range, const TpGroup& group,
                                        const OutputLossOptions& options);

// The same loss weighted and summed, Σ w·loss over the tokens (token_weights [...] as targets, without gradient: a
// loss mask times the loss's scale), for a loss whose gradient reaches each token as its weight times one scalar,
// as the trainer's does. The gradients are made in the forward pass while each chunk's logits are at hand (no logits
// computed again; the input's and the weight's gradient held until backward, which scales them by the sum's gradient
// and adds the weight's into the sink's buffer). per_token: the loss [...] (fp32, without gradient).
struct WeightedOutputLoss {
  at::Tensor sum, per_token;
};
WeightedOutputLoss weighted_output_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                                 const at::Tensor& targets, const at::Tensor& token_weights,
                                                 const VocabRange& range, const TpGroup& group,
                                                 const OutputLossOptions& options);

}  // namespace trestle::train
