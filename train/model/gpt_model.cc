#include "train/model/gpt_model.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <utility>

#include "train/model/chunked_cross_entropy.h"
#include "train/model/recompute.h"
#include "train/model/rope.h"
#include "train/model/tp_regions.h"

namespace trestle::train {

namespace {

// What trestle train cannot run of Gemma 4's layers: per-layer KV heads a tp does not divide, per-layer embeddings
// short of the vocabulary, a KV-sharing layer with no layer to share from, a router described softmax-first. (Per-layer
// inputs and shared keys and values travel between pipeline chunks beside the hidden states, stage_width; under
// activation recompute they are inputs and outputs of the recomputed layers.)
Status check_gemma4_layout(const GptModelSpec& spec, const ParallelLayout& layout) {
  if (spec.moe_beside_mlp && spec.moe_router_pre_softmax)
    return Status::Error("Gemma 4's router renormalises its top-k weights, but the model description says "
                         "moe_router_pre_softmax (a softmax over every expert first, kept unnormalised); convert the "
                         "model again with this trestle");
  if (spec.per_layer_input_size > 0 && spec.per_layer_vocab_size < spec.vocab_size)
    return Status::Error("Gemma 4's per-layer embeddings cover " + std::to_string(spec.per_layer_vocab_size) +
                         " tokens, fewer than the vocabulary's " + std::to_string(spec.vocab_size));
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(spec.layer_query_groups.size()); ++i)
    if (spec.layer_query_groups_of(i) % layout.tp != 0)
      return Status::Error("tensor parallelism " + std::to_string(layout.tp) + " does not divide layer " +
                           std::to_string(i) + "'s " + std::to_string(spec.layer_query_groups_of(i)) + " KV heads");
  for (std::int64_t i = spec.num_layers - spec.kv_shared_layers; i < spec.num_layers; ++i)
    if (spec.kv_source_layer(i) < 0)
      return Status::Error("Gemma 4's KV-sharing layer " + std::to_string(i) +
                           " has no earlier layer of its kind to take keys and values from");
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<GptModel>> GptModel::create(const GptModelSpec& spec, const ParallelLayout& layout,
                                                   TpGroup group, const ModelOptions& options) {
  if (spec.hybrid() && (spec.mamba_num_heads % (layout.tp * layout.cp) != 0 ||
                        spec.mamba_num_groups % (layout.tp * layout.cp) != 0))
    return Status::Error("tensor parallelism " + std::to_string(layout.tp) + " times context parallelism " +
                         std::to_string(layout.cp) + " does not divide the Mamba mixers' " +
                         std::to_string(spec.mamba_num_heads) + " heads and " + std::to_string(spec.mamba_num_groups) +
                         " groups (megatron-core's MambaMixer splits both over tp, and its MambaContextParallel over "
                         "cp)");
  TRESTLE_RETURN_IF_ERROR(check_gemma4_layout(spec, layout));
  if (spec.has_linear_attention() && layout.cp > 1)
    return Status::Error("context parallelism over Gated DeltaNet layers (Qwen3-Next / Qwen3.5): megatron-core's "
                         "GatedDeltaNet has none, and neither has trestle train; use --context-parallel-size 1");
  if (spec.has_linear_attention() &&
      (spec.linear_num_key_heads % layout.tp != 0 || spec.linear_num_value_heads % layout.tp != 0))
    return Status::Error("tensor parallelism " + std::to_string(layout.tp) + " does not divide the Gated DeltaNet's " +
                         std::to_string(spec.linear_num_key_heads) + " key heads and " +
                         std::to_string(spec.linear_num_value_heads) +
                         " value heads (megatron-core's GatedDeltaNet splits both over tp)");
  if (spec.is_moe() && layout.ep > 1 && layout.tp > 1 && !options.sequence_parallel)
    return Status::Error("expert parallelism with tensor parallelism needs --sequence-parallel (as in Megatron): ep " +
                         std::to_string(layout.ep) + ", tp " + std::to_string(layout.tp));
  if (spec.is_moe() && layout.expert_tp() != layout.tp && layout.tp > 1 && !options.sequence_parallel)
    return Status::Error(
        "an expert-tensor-parallel size other than tp needs --sequence-parallel (as in Megatron, "
        "whose MoE layers with tensor parallelism need it): etp " +
        std::to_string(layout.expert_tp()) + ", tp " + std::to_string(layout.tp));
  if (layout.expert_tp() != layout.tp &&
      (options.expert_tp.size != layout.expert_tp() || options.expert_tp.rank < 0 ||
       options.expert_tp.rank >= options.expert_tp.size || (options.expert_tp.size > 1 && !options.expert_tp.backend)))
    return Status::Error("the expert-tensor-parallel group (rank " + std::to_string(options.expert_tp.rank) + " of " +
                         std::to_string(options.expert_tp.size) + ") does not match the layout's etp " +
                         std::to_string(layout.expert_tp()));
  if (options.ep.size != layout.ep || options.ep.rank < 0 || options.ep.rank >= options.ep.size ||
      (options.ep.size > 1 && !options.ep.backend))
    return Status::Error("the expert-parallel group (rank " + std::to_string(options.ep.rank) + " of " +
                         std::to_string(options.ep.size) + ") does not match the layout's ep " +
                         std::to_string(layout.ep));
  if (spec.is_moe() && (spec.moe_router_topk < 1 || spec.moe_router_topk > spec.num_experts))
    return Status::Error("moe_router_topk " + std::to_string(spec.moe_router_topk) + " is not between 1 and the " +
                         std::to_string(spec.num_experts) + " experts");
  if (options.cp.size != layout.cp || options.cp.rank < 0 || options.cp.rank >= options.cp.size ||
      (options.cp.size > 1 && !options.cp.backend))
    return Status::Error("the context-parallel group (rank " + std::to_string(options.cp.rank) + " of " +
                         std::to_string(options.cp.size) + ") does not match the layout's cp " +
                         std::to_string(layout.cp));
  if (options.pipeline_stage < 0 || options.pipeline_stage >= layout.pp)
    return Status::Error("pipeline stage " + std::to_string(options.pipeline_stage) + " is not one of the layout's " +
                         std::to_string(layout.pp));
  if (group.size != layout.tp || group.rank < 0 || group.rank >= group.size || (group.size > 1 && !group.backend))
    return Status::Error("the tensor-parallel group (rank " + std::to_string(group.rank) + " of " +
                         std::to_string(group.size) + ") does not match the layout's tp " + std::to_string(layout.tp));
  TRESTLE_RETURN_IF_ERROR(check_layout(layout, spec.num_layers, spec.num_query_groups, spec.num_experts));
  TRESTLE_RETURN_IF_ERROR(check_rotary_dims(spec));
  TRESTLE_ASSIGN_OR_RETURN(auto tensors, canonical_tensors(spec));
  TRESTLE_ASSIGN_OR_RETURN(auto stages, pipeline_layers(layout, spec.num_layers));
  const std::vector<LayerRange>& chunks = stages[static_cast<std::size_t>(options.pipeline_stage)];
  const bool first = options.pipeline_stage == 0, last = options.pipeline_stage == layout.pp - 1;
  const LayerRange experts = experts_of_rank(layout, spec.num_experts, options.ep.rank);
  std::set<std::string> carried;
  for (const auto& c : spec.carried_tensors) carried.insert(c.name);
  auto held = [&](const CanonicalTensor& t) {
    if (carried.count(t.name)) return false;
    if (t.expert >= 0 && (t.expert < experts.begin || t.expert >= experts.end)) return false;
    switch (t.placement) {
      case Placement::kFirstStage:
        return first || (last && (spec.tied_embeddings || spec.mtp_num_layers > 0) &&
                         t.name == "embedding.word_embeddings.weight");
      case Placement::kLastStage:
        return last;
      case Placement::kLayer:
        for (const LayerRange& r : chunks)
          if (t.layer >= r.begin && t.layer < r.end) return true;
        return false;
    }
    return false;
  };
  const std::int64_t padded =
      trestle::padded_vocab_size(spec.vocab_size, layout.make_vocab_size_divisible_by, layout.tp);
  const bool experts_apart = layout.expert_tp() != layout.tp;
  const TensorParallelPlace place{layout.tp, group.rank, experts_apart ? options.expert_tp.size : 0,
                                  experts_apart ? options.expert_tp.rank : 0};
  TRESTLE_ASSIGN_OR_RETURN(auto parameters, ModelParameters::allocate(
                                                tensors, place, padded, options.sequence_parallel,
                                                at::TensorOptions().dtype(options.dtype).device(options.device), held));
  std::unique_ptr<GptModel> model(new GptModel(spec, layout, std::move(group), options, std::move(parameters)));
  model->padded_vocab_ = padded;
  // A vision-language model's tower: on the first stage, replicated, frozen (text-only training never reads it).
  TRESTLE_ASSIGN_OR_RETURN(
      model->carried_,
      ModelParameters::allocate(tensors, place, padded, false,
                                at::TensorOptions().dtype(options.dtype).device(options.device),
                                [&](const CanonicalTensor& t) { return first && carried.count(t.name); }));
  for (auto& p : model->carried_.all()) p.tensor.requires_grad_(false);
  if (options.lora) {
    if (options.lora->dropout > 0 && options.recompute)
      return Status::Error("LoRA dropout with activation recompute: the recomputed forward would draw other dropout "
                           "masks than the first; use --lora-dropout 0 or no recompute");
    TRESTLE_ASSIGN_OR_RETURN(auto adapter_tensors, lora_tensors(spec, *options.lora));
    TRESTLE_ASSIGN_OR_RETURN(
        model->adapters_,
        ModelParameters::allocate(adapter_tensors, place, padded, options.sequence_parallel,
                                  at::TensorOptions().dtype(options.dtype).device(options.device), held));
    for (auto& p : model->parameters_.all()) p.tensor.requires_grad_(false);
  }
  TRESTLE_RETURN_IF_ERROR(model->bind(chunks));
  return model;
}

GptModel::GptModel(GptModelSpec spec, ParallelLayout layout, TpGroup group, ModelOptions options,
                   ModelParameters parameters)
    : spec_(std::move(spec)),
      layout_(layout),
      group_(std::move(group)),
      options_(options),
      parameters_(std::move(parameters)) {}

Status GptModel::bind(const std::vector<LayerRange>& chunks) {
  vocab_ = train::vocab_range(spec_.vocab_size, padded_vocab_, group_);
  cp_group_ = TpGroup{options_.cp.backend, options_.cp.rank, options_.cp.size};
  inverse_frequencies_ = rope_inverse_frequencies(spec_).to(options_.device);
  if (spec_.rotary_base_local > 0) {  // Gemma 3's windowed layers: their own base, unscaled
    GptModelSpec local = spec_;
    local.rotary_base = spec_.rotary_base_local;
    local.rope_scaling = {};
    local_inverse_frequencies_ = rope_inverse_frequencies(local).to(options_.device);
  }
  if (spec_.global_rope_fraction > 0) {
    // Gemma 4: RoPE per kind of layer and head size, plain in the windowed layers, proportional in the others.
    for (std::int64_t i = 0; i < spec_.num_layers; ++i) {
      const bool windowed = spec_.layer_has_window(i);
      const std::int64_t d = spec_.layer_kv_channels_of(i);
      layer_inverse_frequencies_[{windowed, d}] =
          (windowed ? proportional_rope_inverse_frequencies(spec_.rotary_base_local, d, 1.0)
                    : proportional_rope_inverse_frequencies(spec_.rotary_base, d, spec_.global_rope_fraction))
              .to(options_.device);
    }
  }
  const bool first = stage() == 0, last = stage() == layout_.pp - 1;
  embedding_ = parameters_.get("embedding.word_embeddings.weight");
  if (first && spec_.per_layer_input_size > 0) {
    per_layer_embeddings_ = parameters_.get("per_layer_embedding.weight");
    per_layer_model_projection_ = parameters_.get("per_layer_model_proj.weight");
    per_layer_projection_norm_ = parameters_.get("per_layer_proj_norm.weight");
    if (!per_layer_embeddings_.defined() || !per_layer_model_projection_.defined() ||
        !per_layer_projection_norm_.defined())
      return Status::Error("the model's parameters lack Gemma 4's per-layer input embeddings");
  }
  if (last) {
    final_norm_ = parameters_.get(spec_.hybrid() ? "decoder.final_norm.weight" : "decoder.final_layernorm.weight");
    output_weight_ = spec_.tied_embeddings ? embedding_ : parameters_.get("output_layer.weight");
  }
  if ((first && !embedding_.defined()) || (last && (!final_norm_.defined() || !output_weight_.defined())))
    return Status::Error("the model's parameters lack the embedding, final norm or output layer");
  const LayerRange experts = experts_of_rank(layout_, spec_.num_experts, options_.ep.rank);
  for (std::int64_t k = 0; last && k < spec_.mtp_num_layers; ++k) {
    const std::string p = "mtp.layers." + std::to_string(k) + ".";
    MtpLayer m;
    m.enorm = parameters_.get(p + "enorm.weight");
    m.hnorm = parameters_.get(p + "hnorm.weight");
    m.eh_proj = parameters_.get(p + "eh_proj.weight");
    m.final_norm = parameters_.get(p + "final_layernorm.weight");
    if (!m.enorm.defined() || !m.hnorm.defined() || !m.eh_proj.defined() || !m.final_norm.defined() ||
        !embedding_.defined())
      return Status::Error("the model's parameters lack multi-token-prediction layer " + std::to_string(k) +
                           "'s norms or eh_proj, or the embedding it reads");
    // Its transformer layer is of the last decoder layer's kind (as Megatron-Core builds it).
    TRESTLE_ASSIGN_OR_RETURN(m.layer, TransformerLayer::bind(parameters_, spec_, spec_.num_layers, experts.begin,
                                                             experts.end - experts.begin, p + "transformer_layer."));
    hold_global_expert_counts(m.layer);
    mtp_layers_.push_back(std::move(m));
  }
  for (const LayerRange& range : chunks) {
    std::vector<TransformerLayer> layers;
    for (std::int64_t i = range.begin; i < range.end; ++i) {
      TRESTLE_ASSIGN_OR_RETURN(
          auto layer, TransformerLayer::bind(parameters_, spec_, i, experts.begin, experts.end - experts.begin));
      hold_global_expert_counts(layer);
      if (options_.lora) {
        TRESTLE_ASSIGN_OR_RETURN(layer.adapters, bind_layer_adapters(adapters_, spec_, i, options_.lora->type,
                                                                     experts.begin, experts.end - experts.begin));
        if (layer.router_scale.defined()) {  // Gemma 4: the shared expert is the dense MLP (TransformerLayer::bind)
          layer.adapters.fc1 = std::exchange(layer.adapters.shared_fc1, LoraAdapter());
          layer.adapters.fc2 = std::exchange(layer.adapters.shared_fc2, LoraAdapter());
        }
      }
      layers.push_back(std::move(layer));
    }
    chunk_layers_.push_back(std::move(layers));
    chunk_ranges_.push_back(range);
  }
  return OkStatus();
}

std::shared_ptr<LayerContext> GptModel::make_context(const at::Tensor& positions, std::int64_t seq,
                                                     const at::Tensor& documents) const {
  auto context = std::make_shared<LayerContext>();
  context->spec = &spec_;
  context->group = &group_;
  context->sequence_parallel = options_.sequence_parallel;
  context->rope = rope_tables(inverse_frequencies_, positions.to(options_.device), rope_attention_factor(spec_));
  for (const auto& [kind, frequencies] : layer_inverse_frequencies_)
    context->layer_rope[kind] = rope_tables(frequencies, positions.to(options_.device));
  if (spec_.kv_shared_layers > 0)
    context->shared_kv = std::make_shared<std::map<bool, std::pair<at::Tensor, at::Tensor>>>();
  if (local_inverse_frequencies_.defined())
    context->local_rope = rope_tables(local_inverse_frequencies_, positions.to(options_.device));
  context->load_balancing = options_.moe_load_balancing;
  context->dp = &options_.dp;
  context->z_loss_coeff = options_.moe_z_loss_coeff;
  context->capacity = options_.moe_capacity;
  context->router_dtype = options_.moe_router_dtype;
  context->grouped_experts = options_.moe_grouped_gemm;
  context->fused_kernels = options_.fused_kernels;
  if (options_.lora) context->lora = LoraForward{options_.lora->scale(), options_.lora->dropout};
  context->aux_loss_backward_scale = aux_loss_backward_scale_;
  context->aux_loss_times_tokens = aux_loss_times_tokens_;
  context->ep = &options_.ep;
  context->expert_tp = layout_.expert_tp() != layout_.tp ? &options_.expert_tp : &group_;
  if (documents.defined())
    TORCH_CHECK(
        documents.dim() == 2 && documents.size(0) == positions.size(0) && documents.size(1) == seq * options_.cp.size,
        "documents must be [batch, whole sequence] = [", positions.size(0), ", ", seq * options_.cp.size, "], got ",
        documents.sizes());
  if (options_.cp.size > 1) {
    context->cp = &options_.cp;
    context->cp_group = &cp_group_;
    if (documents.defined()) context->documents = documents.to(options_.device);
    return context;
  }
  const bool windows = spec_.window_size > 0 && spec_.window_size < seq;
  if (!windows && !documents.defined()) return context;
  at::Tensor i = at::arange(seq, at::TensorOptions().dtype(at::kLong).device(options_.device)).unsqueeze(1);
  at::Tensor j = i.transpose(0, 1);
  at::Tensor causal = j <= i;
  if (documents.defined()) {  // [batch, 1, seq, seq]: a query and a key of the same document
    const at::Tensor d = documents.to(options_.device);
    causal = causal & (d.unsqueeze(2) == d.unsqueeze(1)).unsqueeze(1);
    context->full_mask = causal;
  }
  if (windows) context->window_mask = causal & (i - j < spec_.window_size);
  return context;
}

std::int64_t GptModel::hidden_sequence(std::int64_t seq) const {
  return options_.sequence_parallel ? seq / group_.size : seq;
}

std::vector<bool> GptModel::kv_kinds_into(std::int64_t layer) const {
  std::vector<bool> kinds;
  for (const bool windowed : {false, true})
    for (std::int64_t i = layer; i < spec_.num_layers; ++i) {
      const std::int64_t source = spec_.kv_source_layer(i);
      if (source >= 0 && source < layer && spec_.layer_has_window(i) == windowed) {
        kinds.push_back(windowed);
        break;
      }
    }
  return kinds;
}

std::int64_t GptModel::kv_source_of_kind(bool windowed) const {
  for (std::int64_t i = 0; i < spec_.num_layers; ++i)
    if (spec_.kv_source_layer(i) >= 0 && spec_.layer_has_window(i) == windowed) return spec_.kv_source_layer(i);
  return -1;
}

std::int64_t GptModel::passed_kv_width(bool windowed) const {
  const std::int64_t source = kv_source_of_kind(windowed);
  return spec_.layer_query_groups_of(source) / group_.size * spec_.layer_kv_channels_of(source) *
         (options_.sequence_parallel ? group_.size : 1);
}

std::int64_t GptModel::stage_width(int chunk) const {
  std::int64_t width = spec_.hidden_size + spec_.num_layers * spec_.per_layer_input_size;
  for (const bool windowed : kv_kinds_into(chunk_ranges_.at(static_cast<std::size_t>(chunk)).begin))
    width += 2 * passed_kv_width(windowed);
  return width;
}

namespace {

// Shared keys or values [s, b, groups, d] as passed between chunks: [s, b, groups · d], or under sequence parallelism
// the tp slices of the sequence side by side, [s / tp, b, tp · groups · d] (each rank its own heads; no collective).
at::Tensor fold_kv(const at::Tensor& t, std::int64_t tp, bool sequence_parallel) {
  const std::int64_t s = t.size(0), b = t.size(1), width = t.size(2) * t.size(3);
  if (!sequence_parallel) return t.reshape({s, b, width});
  return t.reshape({tp, s / tp, b, width}).permute({1, 2, 0, 3}).reshape({s / tp, b, tp * width});
}

at::Tensor unfold_kv(const at::Tensor& t, std::int64_t tp, bool sequence_parallel, std::int64_t d) {
  const std::int64_t rows = t.size(0), b = t.size(1);
  if (!sequence_parallel) return t.reshape({rows, b, -1, d});
  return t.reshape({rows, b, tp, t.size(2) / tp}).permute({2, 0, 1, 3}).reshape({tp * rows, b, -1, d});
}

}  // namespace

at::Tensor GptModel::embed(const at::Tensor& tokens) const {
  // [b, s, h] partial sums -> [s, b, h], reduced over tp (and scattered over the sequence under SP).
  at::Tensor ids = tokens.to(options_.device);
  at::Tensor x = vocab_parallel_embedding_partial(ids, embedding_, vocab_).transpose(0, 1).contiguous();
  x = options_.sequence_parallel ? reduce_scatter_to_sequence(x, group_) : reduce_from_tp(x, group_);
  // Gemma scales the embedding by sqrt(hidden) rounded to the model's dtype, as transformers does.
  if (spec_.scale_embeddings)
    x = x * at::scalar_tensor(std::sqrt(static_cast<double>(spec_.hidden_size)), x.options());
  return x;
}

// transformers' Gemma4TextModel.get_per_layer_inputs and project_per_layer_inputs: ((norm(W e / sqrt(hidden)) +
// E_pl[token] · sqrt(P)) / sqrt(2)), the embedding scale rounded to the model's dtype, per layer.
at::Tensor GptModel::per_layer_inputs(const at::Tensor& tokens, const at::Tensor& embedded) const {
  const std::int64_t layers = spec_.num_layers, width = spec_.per_layer_input_size;
  at::Tensor ids = tokens.to(options_.device).transpose(0, 1);  // [s, b]
  if (options_.sequence_parallel) {
    const std::int64_t local = ids.size(0) / group_.size;
    ids = ids.narrow(0, group_.rank * local, local);
  }
  const at::Tensor token_part =
      at::embedding(per_layer_embeddings_, ids) *
      at::scalar_tensor(std::sqrt(static_cast<double>(width)), per_layer_embeddings_.options());
  const at::Tensor projected =
      at::linear(embedded, per_layer_model_projection_) * std::pow(static_cast<double>(spec_.hidden_size), -0.5);
  const at::Tensor normed =
      model_norm(projected.view({embedded.size(0), embedded.size(1), layers, width}), per_layer_projection_norm_, spec_,
                 options_.fused_kernels);
  return (normed + token_part.view_as(normed)) * std::pow(2.0, -0.5);
}

at::Tensor GptModel::output_logits(const at::Tensor& normed, const LayerContext& context) const {
  at::Tensor x = fused_linear(enter_tp_region(normed, context), output_weight_, output_sink_);
  if (spec_.final_logit_softcapping > 0)  // Gemma 2: cap · tanh(logits / cap)
    x = softcap(x, spec_.final_logit_softcapping, options_.fused_kernels);
  return x;
}

at::Tensor GptModel::run_layer(const TransformerLayer& layer, const at::Tensor& x, const LayerContext& context) const {
  return options_.recompute ? recomputed_layer_forward(layer, x, context) : layer.forward(x, context);
}

// Megatron-Core's MultiTokenPredictionLayer: eh_proj is column-parallel; its output is gathered whole (each rank's
// gradient then is its slice of the whole one) and, under sequence parallelism, scattered over the sequence again.
at::Tensor GptModel::mtp_forward(const MtpLayer& mtp, const at::Tensor& hidden, const at::Tensor& tokens,
                                 const LayerContext& context) const {
  const bool fused = options_.fused_kernels;
  const at::Tensor both =
      at::cat({model_norm(embed(tokens), mtp.enorm, spec_, fused), model_norm(hidden, mtp.hnorm, spec_, fused)}, -1);
  at::Tensor x = gather_from_tp(at::matmul(enter_tp_region(both, context), mtp.eh_proj.t()), group_);
  if (options_.sequence_parallel) x = scatter_to_sequence(x, group_);
  return model_norm(run_layer(mtp.layer, x, context), mtp.final_norm, spec_, fused);
}

ChunkForward GptModel::forward_chunk(int chunk, const at::Tensor& input, const at::Tensor& tokens,
                                     const at::Tensor& positions, const at::Tensor& mtp_tokens,
                                     const at::Tensor& documents) {
  TORCH_CHECK(chunk >= 0 && chunk < chunks(), "model chunk ", chunk, " of ", chunks());
  TORCH_CHECK(tokens.dim() == 2 && positions.sizes() == tokens.sizes(),
              "tokens and positions must both be [batch, seq]");
  const std::int64_t seq = tokens.size(1);
  TORCH_CHECK(!options_.sequence_parallel || seq % group_.size == 0, "sequence parallelism needs the sequence (", seq,
              ") divisible by tp ", group_.size);
  std::shared_ptr<LayerContext> made = make_context(positions, seq, documents);
  at::Tensor x;
  if (is_first_virtual_stage(chunk)) {
    x = embed(tokens);
    if (per_layer_embeddings_.defined()) made->per_layer_inputs = per_layer_inputs(tokens, x);
  } else {
    TORCH_CHECK(input.defined(), "model chunk ", chunk, " of stage ", stage(), " needs the previous stage's output");
    const std::int64_t width = stage_width(chunk);
    TORCH_CHECK(input.dim() == 3 && input.size(2) == width, "model chunk ", chunk, " of stage ", stage(),
                " takes [seq, batch, ", width, "], got ", input.sizes());
    x = input.narrow(2, 0, spec_.hidden_size);
    std::int64_t at = spec_.hidden_size;
    if (spec_.per_layer_input_size > 0) {  // the per-layer inputs the first stage made, passed on beside x
      const std::int64_t inputs = spec_.num_layers * spec_.per_layer_input_size;
      made->per_layer_inputs = input.narrow(2, at, inputs)
                                   .view({input.size(0), input.size(1), spec_.num_layers, spec_.per_layer_input_size});
      at += inputs;
    }
    // The keys and values an earlier chunk's layer made for this chunk's (or a later one's) KV-sharing layers.
    for (const bool windowed : kv_kinds_into(chunk_ranges_[static_cast<std::size_t>(chunk)].begin)) {
      const std::int64_t w = passed_kv_width(windowed);
      const std::int64_t head = spec_.layer_kv_channels_of(kv_source_of_kind(windowed));
      at::Tensor k = unfold_kv(input.narrow(2, at, w), group_.size, options_.sequence_parallel, head);
      at::Tensor v = unfold_kv(input.narrow(2, at + w, w), group_.size, options_.sequence_parallel, head);
      (*made->shared_kv)[windowed] = {k, v};
      at += 2 * w;
    }
  }
  std::shared_ptr<const LayerContext> context = std::move(made);
  // The residual stream's additions between layers go into the next norm's pass (TransformerLayer's stream form);
  // recomputed layers take and give whole tensors.
  ResidualStream stream{x, {}};
  for (const auto& layer : chunk_layers_[static_cast<std::size_t>(chunk)])
    stream = options_.recompute ? ResidualStream{run_layer(layer, stream.whole(), *context), {}}
                                : layer.forward(stream, *context);
  if (!is_last_virtual_stage(chunk)) {
    x = stream.whole();
    std::vector<at::Tensor> passed{x};
    if (context->per_layer_inputs.defined()) passed.push_back(context->per_layer_inputs.flatten(2));
    for (const bool windowed : kv_kinds_into(chunk_ranges_[static_cast<std::size_t>(chunk)].end)) {
      const auto& [k, v] = context->shared_kv->at(windowed);
      passed.push_back(fold_kv(k, group_.size, options_.sequence_parallel));
      passed.push_back(fold_kv(v, group_.size, options_.sequence_parallel));
    }
    return {passed.size() == 1 ? x : at::cat(passed, 2), {}, std::move(context)};
  }
  at::Tensor hidden = add_then_norm(stream.base, stream.delta, final_norm_, spec_, options_.fused_kernels).normed;
  const bool fused_loss = options_.fused_output_loss;
  ChunkForward out{fused_loss ? hidden : output_logits(hidden, *context), {}, nullptr};
  if (!mtp_layers_.empty()) {
    const auto depth = static_cast<std::int64_t>(mtp_layers_.size());
    TORCH_CHECK(mtp_tokens.defined() || options_.cp.size == 1,
                "multi-token prediction under context parallelism needs the tokens ahead of the whole sequences");
    const at::Tensor ahead = mtp_tokens.defined() ? mtp_tokens : shifted_ahead(tokens, depth);
    TORCH_CHECK(ahead.dim() == 3 && ahead.size(0) == depth && ahead.size(1) == tokens.size(0) &&
                    ahead.size(2) == tokens.size(1),
                "the multi-token-prediction tokens must be [", depth, ", batch, seq]");
    for (std::int64_t d = 0; d < depth; ++d) {
      hidden = mtp_forward(mtp_layers_[static_cast<std::size_t>(d)], hidden, ahead[d], *context);
      out.mtp_logits.push_back(fused_loss ? hidden : output_logits(hidden, *context));
    }
  }
  out.context = std::move(context);
  return out;
}

at::Tensor GptModel::forward(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& documents) {
  TORCH_CHECK(layout_.pp == 1 && chunks() == 1, "forward runs the whole model; a pipeline stage runs forward_chunk");
  ChunkForward result = forward_chunk(0, at::Tensor(), tokens, positions, at::Tensor(), documents);
  latest_context_ = std::move(result.context);
  return options_.fused_output_loss ? output_logits(result.output, *latest_context_) : result.output;
}

at::Tensor GptModel::loss_from_logits(const at::Tensor& logits, const at::Tensor& labels) const {
  at::Tensor targets = labels.to(options_.device).transpose(0, 1);
  return vocab_parallel_cross_entropy(logits, targets, vocab_, group_).transpose(0, 1);
}

at::Tensor GptModel::loss_from_output(const at::Tensor& output, const at::Tensor& labels) const {
  if (!options_.fused_output_loss) return loss_from_logits(output, labels);
  const at::Tensor entered =
      options_.sequence_parallel ? gather_from_sequence(output, group_) : copy_to_tp(output, group_);
  const at::Tensor targets = labels.to(options_.device).transpose(0, 1);
  return chunked_output_cross_entropy(entered, output_weight_, targets, vocab_, group_,
                                      output_loss_options(output.device()))
      .transpose(0, 1);
}

OutputLossOptions GptModel::output_loss_options(at::Device device) const {
  OutputLossOptions loss;
  loss.softcap = spec_.final_logit_softcapping;
  loss.chunk_tokens = output_loss_chunk_tokens(vocab_.rows, device);
  loss.sink = output_sink_;
  loss.fused_kernels = options_.fused_kernels;
  return loss;
}

WeightedOutputLoss GptModel::weighted_loss_from_output(const at::Tensor& output, const at::Tensor& labels,
                                                       const at::Tensor& token_weights) const {
  const at::Tensor weights = token_weights.to(options_.device, at::kFloat);
  if (!options_.fused_output_loss) {
    const at::Tensor per_token = loss_from_logits(output, labels).to(at::kFloat);
    return {(per_token * weights).sum(), per_token.detach()};
  }
  const at::Tensor entered =
      options_.sequence_parallel ? gather_from_sequence(output, group_) : copy_to_tp(output, group_);
  const at::Tensor targets = labels.to(options_.device).transpose(0, 1);
  WeightedOutputLoss loss = weighted_output_cross_entropy(entered, output_weight_, targets, weights.transpose(0, 1),
                                                          vocab_, group_, output_loss_options(output.device()));
  loss.per_token = loss.per_token.transpose(0, 1);
  return loss;
}

at::Tensor GptModel::loss(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& labels) {
  TORCH_CHECK(layout_.pp == 1 && chunks() == 1, "loss runs the whole model; a pipeline stage runs forward_chunk");
  ChunkForward result = forward_chunk(0, at::Tensor(), tokens, positions);
  latest_context_ = std::move(result.context);
  return loss_from_output(result.output, labels);
}

at::Tensor shifted_ahead(const at::Tensor& t, std::int64_t depth) {
  TORCH_CHECK(t.dim() == 2, "shifted_ahead takes [batch, seq]");
  std::vector<at::Tensor> rows;
  const std::int64_t seq = t.size(1);
  for (std::int64_t d = 1; d <= depth; ++d) {
    const std::int64_t kept = std::max<std::int64_t>(seq - d, 0);
    rows.push_back(at::cat({t.narrow(1, seq - kept, kept), at::zeros({t.size(0), seq - kept}, t.options())}, 1));
  }
  return at::stack(rows);
}

void GptModel::hold_global_expert_counts(TransformerLayer& layer) const {
  if (options_.moe_load_balancing.global_batch > 0 && layer.router_weight.defined())
    layer.global_counts = std::make_shared<TransformerLayer::RunningExpertCounts>();
}

void GptModel::reset_global_expert_counts() {
  auto reset = [](TransformerLayer& l) {
    if (l.global_counts) *l.global_counts = {};
  };
  for (auto& chunk : chunk_layers_)
    for (auto& l : chunk) reset(l);
  for (auto& m : mtp_layers_) reset(m.layer);
}

at::Tensor GptModel::take_router_losses() {
  // Gathered on the layers' device, then copied to the CPU once.
  at::Tensor out;
  auto take = [&](TransformerLayer& l, std::int64_t row) {
    if (!l.router_loss_log) return;
    if (!out.defined())
      out = at::zeros({spec_.num_layers + spec_.mtp_num_layers, kRouterLosses}, l.router_loss_log->options());
    out[row].copy_(*l.router_loss_log);
    l.router_loss_log->zero_();
  };
  for (auto& chunk : chunk_layers_)
    for (auto& l : chunk) take(l, l.index);
  for (std::size_t k = 0; k < mtp_layers_.size(); ++k)
    take(mtp_layers_[k].layer, spec_.num_layers + static_cast<std::int64_t>(k));
  if (!out.defined()) out = at::zeros({spec_.num_layers + spec_.mtp_num_layers, kRouterLosses});
  return out.to(at::kCPU, at::kDouble).contiguous();
}

bool GptModel::has_moe_layer() const {
  for (const auto& chunk : chunk_layers_)
    for (const auto& l : chunk)
      if (l.router_loss_log) return true;
  for (const auto& m : mtp_layers_)
    if (m.layer.router_loss_log) return true;
  return false;
}

std::vector<GptModel::ExpertBalance> GptModel::expert_balances() const {
  std::vector<ExpertBalance> out;
  for (const auto& chunk : chunk_layers_)
    for (const auto& l : chunk)
      if (l.expert_load) out.push_back({l.expert_bias, l.expert_bias_state, l.expert_load});
  for (const auto& m : mtp_layers_)
    if (m.layer.expert_load) out.push_back({m.layer.expert_bias, m.layer.expert_bias_state, m.layer.expert_load});
  return out;
}

std::vector<std::pair<const ModelParameter*, GptModel::ExpertBalance>> GptModel::held_expert_biases() const {
  std::vector<std::pair<const ModelParameter*, ExpertBalance>> out;
  const auto balances = expert_balances();
  for (const ModelParameter& p : parameters_.all())
    for (const ExpertBalance& b : balances)
      if (b.bias.is_same(p.tensor)) out.emplace_back(&p, b);
  return out;
}

std::map<std::string, at::Tensor> GptModel::expert_bias_states() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [p, balance] : held_expert_biases()) out[p->name()] = *balance.state;
  return out;
}

Status GptModel::load_expert_bias_state(const CheckpointReader* reader) {
  at::NoGradGuard no_grad;
  for (const auto& [p, balance] : held_expert_biases()) {
    if (!reader) {
      balance.state->copy_(p->tensor);
      continue;
    }
    const std::string master = "optimizer.fp32_param." + p->name();
    const std::string& stored = reader->manifest().tensors.count(master) ? master : p->name();
    TRESTLE_RETURN_IF_ERROR(load_stacked_pieces(*reader, {{stored, &p->boxes, *balance.state}}));
  }
  return OkStatus();
}

void GptModel::fuse_weight_grads(const std::function<WeightGradSink*(const at::Tensor& weight)>& sink_of) {
  auto fuse = [&](TransformerLayer& l) {
    if (l.qkv_weight.defined()) l.qkv_sink = sink_of(l.qkv_weight);     // multi-latent attention has none
    if (l.proj_weight.defined()) l.proj_sink = sink_of(l.proj_weight);  // a hybrid's MLP layers have none
    if (l.fc1_weight.defined()) l.fc1_sink = sink_of(l.fc1_weight);     // MoE layers have experts instead
    if (l.fc2_weight.defined()) l.fc2_sink = sink_of(l.fc2_weight);
  };
  for (auto& chunk : chunk_layers_)
    for (auto& l : chunk) fuse(l);
  for (auto& m : mtp_layers_) fuse(m.layer);
  // A tied output layer shares its weight with the embedding, whose gradient autograd accumulates.
  if (!spec_.tied_embeddings && output_weight_.defined()) output_sink_ = sink_of(output_weight_);
}

void GptModel::finish_grads(std::vector<at::Tensor>& all_grads) {
  // Routed experts' over their own tensor-parallel group where the layout gives them one, the others' over tp.
  const bool experts_apart = layout_.expert_tp() != layout_.tp;
  for (const bool experts : {false, true}) {
    const TpGroup& group = experts && experts_apart ? options_.expert_tp : group_;
    if (group.size == 1 || (experts && !experts_apart)) continue;
    // One all-reduce for all of them: these are small (norm weights), so latency dominates.
    std::vector<at::Tensor> grads;
    const auto& params = trainable().all();
    for (std::size_t i = 0; i < params.size() && i < all_grads.size(); ++i)
      if (params[i].grad_summed_over_tp && all_grads[i].defined() &&
          (experts_apart && params[i].canonical.expert >= 0) == experts)
        grads.push_back(all_grads[i]);
    if (grads.empty()) continue;
    std::vector<at::Tensor> flat;
    for (const auto& g : grads) flat.push_back(g.flatten());
    at::Tensor summed = at::cat(flat);
    group.all_reduce_sum(summed);
    std::int64_t offset = 0;
    for (auto& g : grads) {
      g.copy_(summed.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  }
}

}  // namespace trestle::train
