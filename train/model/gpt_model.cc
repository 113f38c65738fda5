#include "train/model/gpt_model.h"

#include <ATen/ATen.h>

#include <string>

#include "train/model/recompute.h"
#include "train/model/tp_regions.h"

namespace trestle::train {

Result<std::unique_ptr<GptModel>> GptModel::create(const GptModelSpec& spec, const ParallelLayout& layout,
                                                   TpGroup group, const ModelOptions& options) {
  if (spec.is_moe()) return Status::Error("the trainer's model has no mixture-of-experts layers yet (num_experts > 0)");
  if (spec.geglu || spec.zero_centered_norms || spec.post_norms || spec.attn_logit_softcapping > 0 ||
      spec.final_logit_softcapping > 0 || spec.mixed_attention)
    return Status::Error(
        "the trainer's model does not implement Gemma's layers yet (GeGLU, (1 + w) norms, post-norms, "
        "logit soft-capping, alternating sliding-window layers)");
  if (layout.pp != 1 || layout.vpp != 1 || layout.cp != 1)
    return Status::Error("the trainer's model runs without pipeline or context parallelism for now (pp " +
                         std::to_string(layout.pp) + ", vpp " + std::to_string(layout.vpp) + ", cp " +
                         std::to_string(layout.cp) + ")");
  if (group.size != layout.tp || group.rank < 0 || group.rank >= group.size || (group.size > 1 && !group.backend))
    return Status::Error("the tensor-parallel group (rank " + std::to_string(group.rank) + " of " +
                         std::to_string(group.size) + ") does not match the layout's tp " + std::to_string(layout.tp));
  TRESTLE_RETURN_IF_ERROR(check_layout(layout, spec.num_layers, spec.num_query_groups, 0));
  if (spec.kv_channels % 2 != 0) return Status::Error("RoPE needs an even head dim (kv_channels)");
  TRESTLE_ASSIGN_OR_RETURN(auto tensors, canonical_tensors(spec));
  const std::int64_t padded =
      trestle::padded_vocab_size(spec.vocab_size, layout.make_vocab_size_divisible_by, layout.tp);
  TRESTLE_ASSIGN_OR_RETURN(auto parameters,
                           ModelParameters::allocate(tensors, layout.tp, group.rank, padded, options.sequence_parallel,
                                                     at::TensorOptions().dtype(options.dtype).device(options.device)));
  std::unique_ptr<GptModel> model(new GptModel(spec, layout, std::move(group), options, std::move(parameters)));
  model->padded_vocab_ = padded;
  TRESTLE_RETURN_IF_ERROR(model->bind());
  return model;
}

GptModel::GptModel(GptModelSpec spec, ParallelLayout layout, TpGroup group, ModelOptions options,
                   ModelParameters parameters)
    : spec_(std::move(spec)),
      layout_(layout),
      group_(std::move(group)),
      options_(options),
      parameters_(std::move(parameters)) {}

Status GptModel::bind() {
  vocab_ = train::vocab_range(spec_.vocab_size, padded_vocab_, group_);
  inverse_frequencies_ = rope_inverse_frequencies(spec_).to(options_.device);
  embedding_ = parameters_.get("embedding.word_embeddings.weight");
  final_norm_ = parameters_.get("decoder.final_layernorm.weight");
  output_weight_ = spec_.tied_embeddings ? embedding_ : parameters_.get("output_layer.weight");
  if (!embedding_.defined() || !final_norm_.defined() || !output_weight_.defined())
    return Status::Error("the model's parameters lack the embedding, final norm or output layer");
  for (std::int64_t i = 0; i < spec_.num_layers; ++i) {
    TRESTLE_ASSIGN_OR_RETURN(auto layer, TransformerLayer::bind(parameters_, spec_, i));
    layers_.push_back(std::move(layer));
  }
  context_.spec = &spec_;
  context_.group = &group_;
  context_.sequence_parallel = options_.sequence_parallel;
  return OkStatus();
}

void GptModel::prepare_context(const at::Tensor& positions, std::int64_t seq) {
  context_.rope = rope_tables(inverse_frequencies_, positions.to(options_.device));
  context_.attention_mask.reset();
  if (spec_.window_size > 0 && spec_.window_size < seq) {
    at::Tensor i = at::arange(seq, at::TensorOptions().dtype(at::kLong).device(options_.device)).unsqueeze(1);
    at::Tensor j = i.transpose(0, 1);
    context_.attention_mask = (j <= i) & (i - j < spec_.window_size);
  }
}

at::Tensor GptModel::forward(const at::Tensor& tokens, const at::Tensor& positions) {
  TORCH_CHECK(tokens.dim() == 2 && positions.sizes() == tokens.sizes(),
              "tokens and positions must both be [batch, seq]");
  const std::int64_t seq = tokens.size(1);
  TORCH_CHECK(!options_.sequence_parallel || seq % group_.size == 0, "sequence parallelism needs the sequence (", seq,
              ") divisible by tp ", group_.size);
  prepare_context(positions, seq);
  at::Tensor ids = tokens.to(options_.device);
  // [b, s, h] partial sums -> [s, b, h], reduced over tp (and scattered over the sequence under SP).
  at::Tensor x = vocab_parallel_embedding_partial(ids, embedding_, vocab_).transpose(0, 1).contiguous();
  x = options_.sequence_parallel ? reduce_scatter_to_sequence(x, group_) : reduce_from_tp(x, group_);
  for (const auto& layer : layers_)
    x = options_.recompute ? recomputed_layer_forward(layer, x, context_) : layer.forward(x, context_);
  x = rms_norm(x, final_norm_, spec_.norm_epsilon);
  return fused_linear(enter_tp_region(x, context_), output_weight_, output_sink_);
}

at::Tensor GptModel::loss(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& labels) {
  at::Tensor logits = forward(tokens, positions);
  at::Tensor targets = labels.to(options_.device).transpose(0, 1);
  return vocab_parallel_cross_entropy(logits, targets, vocab_, group_).transpose(0, 1);
}

void GptModel::fuse_weight_grads(const std::function<WeightGradSink*(const at::Tensor& weight)>& sink_of) {
  for (auto& l : layers_) {
    l.qkv_sink = sink_of(l.qkv_weight);
    l.proj_sink = sink_of(l.proj_weight);
    l.fc1_sink = sink_of(l.fc1_weight);
    l.fc2_sink = sink_of(l.fc2_weight);
  }
  // A tied output layer shares its weight with the embedding, whose gradient autograd accumulates.
  if (!spec_.tied_embeddings) output_sink_ = sink_of(output_weight_);
}

void GptModel::finish_grads(std::vector<at::Tensor>& all_grads) {
  if (group_.size == 1) return;
  // One all-reduce for all of them: these are small (norm weights), so latency dominates.
  std::vector<at::Tensor> grads;
  const auto& params = parameters_.all();
  for (std::size_t i = 0; i < params.size() && i < all_grads.size(); ++i)
    if (params[i].grad_summed_over_tp && all_grads[i].defined()) grads.push_back(all_grads[i]);
  if (grads.empty()) return;
  std::vector<at::Tensor> flat;
  for (const auto& g : grads) flat.push_back(g.flatten());
  at::Tensor summed = at::cat(flat);
  group_.all_reduce_sum(summed);
  std::int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(summed.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

}  // namespace trestle::train
