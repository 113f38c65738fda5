// LoRA adapters in the forward pass (their tensors and splits: parallel/layout/lora_spec.h). An adapter adds
// scale · B · A · dropout(x) to its base linear's output. On a column-parallel base (linear_qkv, linear_fc1) x is the
// base's input (the whole sequence), each rank's A rows give their slice of A·x, gathered (reduce-scattered in
// backward), and its B rows the rank's columns of the output; the canonical parts (q, k, v or gate, up) are laid out
// as the fused output is (Megatron's per-group QKV order, [gate; up]). On a row-parallel base (linear_proj,
// linear_fc2) x is the rank's slice of the input: A·x is summed over the ranks as the base's output is (reduced, or
// reduce-scattered over the sequence under sequence parallelism), then the replicated B gives the output.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/layout/lora_spec.h"
#include "train/model/model_parameters.h"
#include "train/model/tp_group.h"

namespace trestle::train {

struct LoraAdapter {
  std::vector<at::Tensor> a;               // this rank's piece of each part's linear_in
  std::vector<std::vector<at::Tensor>> b;  // this rank's rows of each part's linear_out, in its pieces (lora_spec.h)
  bool defined() const { return !a.empty(); }
  // Part p's B as one tensor (its pieces' rows stacked, in the autograd graph).
  at::Tensor out_weight(std::size_t p) const;
};

// The adapters of one decoder layer; undefined where its linear has none. An MoE layer's are per local expert (empty
// without) and the shared expert's.
struct LayerAdapters {
  LoraAdapter qkv, proj, fc1, fc2;  // a Gated DeltaNet's or Mamba mixer's in_proj and out_proj are its qkv and proj
  LoraAdapter q_proj, q_down, q_up, kv_down, kv_up;  // multi-latent attention's, instead of qkv
  std::vector<LoraAdapter> expert_fc1, expert_fc2;
  LoraAdapter shared_fc1, shared_fc2;
};

// Binds layer `layer` of `spec`'s adapters from `adapters` by name (the parts of `type`, lora_tensors' for the layer;
// the local experts [first_expert, first_expert + experts)); a target with some of its tensors missing is an error
// naming the tensor. qkv is a Gemma 4 KV-sharing layer's linear_q_proj's there, a Gated DeltaNet's or Mamba mixer's
// in_proj's (proj its out_proj's); multi-latent attention binds its projections' instead.
Result<LayerAdapters> bind_layer_adapters(const ModelParameters& adapters, const GptModelSpec& spec, std::int64_t layer,
                                          LoraType type, std::int64_t first_expert = 0, std::int64_t experts = 0);

struct LoraForward {
  double scale = 1.0;    // alpha / rank
  double dropout = 0.0;  // applied to the adapter's input when gradients are computed
};

// The fused output's layout the canonical q, k, v parts are put into: this rank's query groups, each with its
// query heads (and as many gate heads in gated attention) then its key and value heads (its key head alone where there
// are two parts: Gemma 4's keys as values), of head_dim each.
struct QkvParts {
  std::int64_t groups = 0, heads_per_group = 0, head_dim = 0;
  bool gated = false;
};

// The adapter's term for a column-parallel base: x [..., in] the base's input -> [..., out / tp]. `qkv` lays out
// canonical q, k[, v] parts (null: parts are concatenated, as gate and up are).
at::Tensor lora_column_output(const LoraAdapter& adapter, const at::Tensor& x, const TpGroup& group,
                              const LoraForward& options, const QkvParts* qkv = nullptr);
// The adapter's term for a row-parallel base: x [s, b, in / tp] this rank's slice of its input -> [s (/ tp under
// sequence parallelism), b, out], as the base's reduced output.
at::Tensor lora_row_output(const LoraAdapter& adapter, const at::Tensor& x, const TpGroup& group,
                           bool sequence_parallel, const LoraForward& options);
// The adapter's term from this rank's A and B alone, without communication: x [..., in] -> [..., out]. For a
// row-parallel base whose partial outputs the caller sums over the tensor-parallel group (the experts' fc2, the shared
// expert's; x is this rank's slice of the input), and for a replicated base (multi-latent attention's down projections
// under Transformer Engine's spec). Either way B (and the down projections' A) is replicated and gets a partial
// gradient on each rank, summed over the group after backward.
at::Tensor lora_local_output(const LoraAdapter& adapter, const at::Tensor& x, const LoraForward& options);

}  // namespace trestle::train
