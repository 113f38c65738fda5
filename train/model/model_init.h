// A model's parameters from scratch, with Megatron-Core's initialisation rules: weights normal(0, init_method_std),
// the layers' output projections (linear_proj, linear_fc2) normal(0, init_method_std / sqrt(2 · num_layers)), norm
// weights one (zero where the model applies them as 1 + w: Megatron's layernorm_zero_centered_gamma), biases,
// attention sinks and the router's expert bias zero; Mamba mixers as megatron-core's MambaMixer; LoRA adapters
// (Megatron-Bridge's defaults) A xavier-normal over the whole tensor, B zero. Each canonical tensor is drawn whole from
// its own generator (seeded by the seed and the tensor's place in the model) and each rank keeps its pieces, so a model
// initialised at any layout is the same model.
#pragma once

#include <cstdint>
#include <optional>

#include "ckpt/status.h"
#include "train/model/model_parameters.h"

namespace trestle::train {

struct InitOptions {
  std::uint64_t seed = 1234;
  double init_method_std = 0.02;
  std::optional<double> embedding_init_method_std;  // Megatron's --embedding-init-method-std (else init_method_std)
  std::int64_t num_layers = 1;
  // A Mamba hybrid (megatron-core's is_hybrid_model, which Megatron-Bridge's Nemotron-H sets): output layers start at
  // std / sqrt(num_layers), where other models' start at std / sqrt(2 num_layers).
  bool hybrid = false;
  bool zero_centered_norms = false;
  std::int64_t conv_kernel = 4;  // a Mamba mixer's conv1d width (its biases' bound)
};

Status initialize_parameters(ModelParameters& parameters, const InitOptions& options);

}  // namespace trestle::train
