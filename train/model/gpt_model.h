// The GPT model (Llama 2/3, Mistral, Qwen2/3 dense) of one tensor-parallel rank: built from a GptModelSpec, the
// parallel layout and this rank's tensor-parallel group; its parameters are this rank's pieces of the canonical
// Megatron tensors (model_parameters.h). forward runs embedding -> decoder layers -> final norm -> output layer
// (or the tied embedding) through autograd; loss adds the vocabulary-parallel cross-entropy. The training loop calls
// finish_grads after each backward. Pipeline stages (pp > 1) are not built here yet: create refuses them.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "ckpt/load.h"
#include "parallel/layout/model_spec.h"
#include "parallel/layout/parallel_layout.h"
#include "train/model/model_parameters.h"
#include "train/model/tp_group.h"
#include "train/model/transformer_layer.h"
#include "train/model/vocab_parallel.h"

namespace trestle::train {

struct ModelOptions {
  bool sequence_parallel =
      false;               // Megatron's --sequence-parallel: the sequence is split over tp outside attention/MLP
  bool recompute = false;  // full activation recompute of every layer
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
};

class GptModel {
 public:
  // `group` is the tensor-parallel group of this rank (size layout.tp). Errors name what the layout cannot split.
  static Result<std::unique_ptr<GptModel>> create(const GptModelSpec& spec, const ParallelLayout& layout, TpGroup group,
                                                  const ModelOptions& options);
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  // tokens, positions [batch, seq] int64 -> this rank's logits [seq, batch, padded_vocab / tp] (vocab_range()).
  // With sequence parallelism seq must be divisible by tp.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions);
  // Per-token loss [batch, seq] (fp32) of predicting labels [batch, seq].
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& labels);
  // After backward: sums over tp the gradients of replicated parameters that saw only part of the data on each rank
  // (sequence-parallel norms, q/k norms), as Megatron's finalize_model_grads does.
  void finish_grads(std::vector<at::Tensor>& grads);  // grads: one per parameters() entry (undefined: none)
  // Gradient accumulation fusion: the linear layers' weights (the output layer's unless tied to the embedding) whose
  // `sink_of` gives a sink accumulate their gradients there (fused_linear.h); the others keep autograd's .grad.
  void fuse_weight_grads(const std::function<WeightGradSink*(const at::Tensor& weight)>& sink_of);

  const GptModelSpec& spec() const { return spec_; }
  const ParallelLayout& layout() const { return layout_; }
  const TpGroup& tp_group() const { return group_; }
  const VocabRange& vocab_range() const { return vocab_; }
  std::int64_t padded_vocab_size() const { return padded_vocab_; }
  std::vector<ModelParameter>& parameters() { return parameters_.all(); }
  ModelParameters& parameter_store() { return parameters_; }

 private:
  GptModel(GptModelSpec spec, ParallelLayout layout, TpGroup group, ModelOptions options, ModelParameters parameters);
  Status bind();
  void prepare_context(const at::Tensor& positions, std::int64_t seq);

  GptModelSpec spec_;
  ParallelLayout layout_;
  TpGroup group_;
  ModelOptions options_;
  ModelParameters parameters_;
  std::int64_t padded_vocab_ = 0;
  VocabRange vocab_;
  at::Tensor inverse_frequencies_;
  at::Tensor embedding_, final_norm_, output_weight_;
  WeightGradSink* output_sink_ = nullptr;
  std::vector<TransformerLayer> layers_;
  LayerContext context_;  // of the latest forward; recompute reads it during that forward's backward
};

// Loads the model's pieces from a checkpoint (any saved layout).
inline Status load_model_pieces(GptModel& model, const CheckpointReader& reader) {
  return load_model_pieces(model.parameter_store(), reader);
}

}  // namespace trestle::train
