#include "train/model/model_init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <cmath>

namespace trestle::train {
namespace {

bool ends_with(const std::string& s, std::string_view suffix) { return s.ends_with(suffix); }

// The whole canonical tensor as Megatron would initialise it.
at::Tensor canonical_init(const CanonicalTensor& t, std::uint64_t seed, std::size_t index, const InitOptions& o) {
  std::vector<std::int64_t> shape(t.shape.begin(), t.shape.end());
  const std::string& name = t.name;
  // Gated DeltaNet (megatron-core's GatedDeltaNet.reset_parameters): the gated norm zero-centred whatever the model's
  // other norms are, dt_bias 1, A = exp(A_log) uniform in [1, 16], conv1d PyTorch's Conv1d default (uniform within
  // ± 1 / sqrt(kernel width)).
  if (ends_with(name, ".out_norm.weight")) return at::zeros(shape, at::kFloat);
  const bool mamba = name.find(".mixer.") != std::string::npos;
  if (ends_with(name, ".dt_bias") && !mamba) return at::ones(shape, at::kFloat);
  if (ends_with(name, ".mixer.D")) return at::ones(shape, at::kFloat);
  if (ends_with(name, "layernorm.weight") || ends_with(name, "layer_norm_weight") || ends_with(name, "norm.weight"))
    return o.zero_centered_norms ? at::zeros(shape, at::kFloat) : at::ones(shape, at::kFloat);
  // Gemma 4's layer scalar (transformers' buffer of ones) and its router's input and per-expert scales.
  if (ends_with(name, ".layer_scalar") || ends_with(name, ".router.scale") || ends_with(name, ".per_expert_scale"))
    return at::ones(shape, at::kFloat);
  if (ends_with(name, ".bias") || ends_with(name, "layer_norm_bias") || ends_with(name, ".softmax_offset") ||
      ends_with(name, ".expert_bias"))
    return at::zeros(shape, at::kFloat);
  const bool adapter = name.find(".adapter.") != std::string::npos;
  // Adapters are numbered in a list of their own: their generators are offset from the base weights'.
  auto generator =
      at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + index + (adapter ? 0x9E3779B97F4A7C15ULL : 0));
  if (adapter) {
    // LoRA (Megatron-Bridge's defaults): B zero, so training starts from the base model; A xavier-normal.
    if (ends_with(name, "linear_out.weight")) return at::zeros(shape, at::kFloat);
    const double xavier = std::sqrt(2.0 / static_cast<double>(shape.at(0) + shape.at(1)));
    return at::normal(0.0, xavier, shape, generator, at::TensorOptions().dtype(at::kFloat));
  }
  // A Mamba-2 mixer (megatron-core's MambaMixer): the step's bias the inverse softplus of a step drawn log-uniformly in
  // [0.001, 0.1] (at least 1e-4), A_log as Gated DeltaNet's, conv1d's weights and biases PyTorch's Conv1d default.
  if (ends_with(name, ".dt_bias")) {
    const at::Tensor dt =
        (at::empty(shape, at::kFloat).uniform_(0.0, 1.0, generator) * (std::log(0.1) - std::log(0.001)) +
         std::log(0.001))
            .exp()
            .clamp_min(1e-4);
    return dt + at::log(-at::expm1(-dt));
  }
  if (name.find(".conv1d.bias.") != std::string::npos) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(o.conv_kernel));
    return at::empty(shape, at::kFloat).uniform_(-bound, bound, generator);
  }
  if (ends_with(name, ".A_log")) return at::log(at::empty(shape, at::kFloat).uniform_(1.0, 16.0, generator));
  if (name.find(".conv1d.weight.") != std::string::npos) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(shape.back()));
    return at::empty(shape, at::kFloat).uniform_(-bound, bound, generator);
  }
  double std = o.init_method_std;
  if (name == "embedding.word_embeddings.weight" && o.embedding_init_method_std) std = *o.embedding_init_method_std;
  if (ends_with(name, "linear_proj.weight") || ends_with(name, "linear_fc2.weight") ||
      ends_with(name, ".out_proj.weight") || ends_with(name, ".fc2_latent_proj.weight"))
    std /= std::sqrt((o.hybrid ? 1.0 : 2.0) * static_cast<double>(o.num_layers));
  return at::normal(0.0, std, shape, generator, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

Status initialize_parameters(ModelParameters& parameters, const InitOptions& options) {
  c10::NoGradGuard no_grad;
  for (auto& p : parameters.all()) {
    const at::Tensor whole = canonical_init(p.canonical, options.seed, p.canonical_index, options);
    at::Tensor target = p.tensor.detach();
    target.zero_();  // vocabulary padding rows stay zero
    std::int64_t row = 0;
    for (const Box& box : p.boxes) {
      at::Tensor source = whole;
      for (std::size_t d = 0; d < box.shape.size(); ++d)
        source = source.narrow(static_cast<std::int64_t>(d), box.offset[d], box.shape[d]);
      if (target.dim() == 0) {
        target.copy_(source);
        continue;
      }
      target.narrow(0, row, box.shape[0]).copy_(source);
      row += box.shape[0];
    }
  }
  return OkStatus();
}

}  // namespace trestle::train
