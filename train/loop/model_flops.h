// A model's FLOPs per token of training (forward and backward), the numerator of MFU, as Megatron-LM counts them
// (megatron/training/training.py's num_floating_point_operations, in its form since 2025-03): 3 × the forward's, which
// is 2 × the GEMM weights a token meets (its top-k experts and the shared expert in an MoE layer, the output layer at
// the padded vocabulary) plus causal attention over half the score matrix, for unpacked sequences of seq_length tokens.
#pragma once

#include <cstdint>

#include "parallel/layout/model_spec.h"

namespace trestle::train {

// Each kind of layer as Megatron-LM's formula has it: standard and gated attention (Megatron's attention_output_gate),
// multi-latent attention, Gated DeltaNet, dense and MoE MLPs (latent MoE included), multi-token prediction, and the
// hybrid (Mamba) models' mixers. Where the trainer's model has more than the formula covers (Gemma 4's per-layer
// widths, shared keys and values, double-wide MLPs and per-layer inputs), their GEMMs count the same way; a Mamba
// mixer's inner width is its heads × head dim (Megatron's formula assumes 2 × hidden, which Nemotron-H's sizes are).
// Sliding windows count as full causal attention, as Megatron's formula counts them.
double model_flops_per_token(const GptModelSpec& spec, std::int64_t seq_length, std::int64_t padded_vocab_size);

}  // namespace trestle::train
