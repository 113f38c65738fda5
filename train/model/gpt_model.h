// The GPT model (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3, OLMo 2, Mixtral-style MoE) of one tensor-parallel rank
// of one pipeline stage: built from a GptModelSpec, the parallel layout, this rank's stage and its tensor-parallel
// group; its parameters are this rank's pieces of the canonical Megatron tensors (model_parameters.h) that its stage
// holds. A stage holds one model chunk per virtual pipeline stage (the layers pipeline_layers gives it); the first
// virtual stage starts with the embedding, the last ends with the final norm and the output layer (with tied
// embeddings, the last stage keeps its own copy of the embedding, whose gradient the trainer sums with the first
// stage's as Megatron does). Multi-token prediction (Megatron-Core's MTP block, DeepSeek-V3's) follows the final norm
// on the last stage: depth d (1..D) normalises the previous depth's hidden states (hnorm) and the embedding of the
// tokens d positions ahead (enorm), projects their concatenation (eh_proj), runs one transformer layer and its own
// final norm, and shares the output layer; the last stage then also holds a copy of the embedding when pp > 1.
// forward_chunk runs one chunk through autograd; forward and loss run the whole model when there is no pipeline. The
// training loop calls finish_grads after each backward.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "ckpt/load.h"
#include "parallel/layout/lora_spec.h"
#include "parallel/layout/model_spec.h"
#include "parallel/layout/parallel_layout.h"
#include "train/model/chunked_cross_entropy.h"
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
  int pipeline_stage = 0;  // this rank's pipeline stage (pp_rank)
  CpRing cp;  // this rank's context-parallel group (size layout.cp): inputs are its chunks of each sequence
  // Megatron's --moe-router-load-balancing-type with --moe-aux-loss-coeff
  LoadBalancingCoefficients moe_load_balancing;
  double moe_z_loss_coeff = 0.0;    // Megatron's --moe-z-loss-coeff
  ExpertCapacity moe_capacity;      // Megatron's --moe-expert-capacity-factor (LayerContext::capacity)
  at::ScalarType moe_router_dtype = at::ScalarType::Undefined;  // --moe-router-dtype (LayerContext::router_dtype)
  bool moe_grouped_gemm = false;    // Megatron's --moe-grouped-gemm (LayerContext::grouped_experts)
  bool fused_kernels = false;       // the fused norm, gated-unit and soft-cap kernels (LayerContext::fused_kernels)
  // The output layer fused with the cross-entropy in chunks of tokens (chunked_cross_entropy.h): the last chunk's
  // output (and the MTP depths') is then the final norm's output, which loss_from_output takes.
  bool fused_output_loss = false;
  TpGroup ep;  // this rank's expert-parallel group (size layout.ep): it holds experts_of_rank(ep.rank)
  TpGroup dp;  // this rank's data-parallel group (size layout.dp()): global_aux_loss counts the experts' tokens over it
  // The routed experts' tensor-parallel group (size layout.expert_tp()); unused (the tensor-parallel group serves)
  // when the layout's expert_tp() is its tp.
  TpGroup expert_tp;
  // LoRA: the adapters (lora_spec.h) are the model's trainable parameters, the base's weights frozen (no gradient).
  std::optional<LoraConfig> lora;
};

// What one chunk's forward gives: its output, and the per-forward state its backward still reads (recompute).
struct ChunkForward {
  // Hidden states [s, b, h] (s / tp under sequence parallelism); on the last chunk its logits, or with
  // ModelOptions::fused_output_loss the final norm's output (loss_from_output takes either).
  at::Tensor output;
  // On the last chunk of a model with multi-token prediction: depth d's logits (d = 1..D, as `output`'s; with
  // fused_output_loss its normed hidden states), which predict the labels d positions ahead (shifted_ahead).
  std::vector<at::Tensor> mtp_logits;
  std::shared_ptr<const LayerContext> context;
};

class GptModel {
 public:
  // `group` is the tensor-parallel group of this rank (size layout.tp). Errors name what the layout cannot split.
  static Result<std::unique_ptr<GptModel>> create(const GptModelSpec& spec, const ParallelLayout& layout, TpGroup group,
                                                  const ModelOptions& options);
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  // Model chunk `chunk` of this stage: the first virtual stage embeds `tokens` (`input` undefined), the others take
  // the previous virtual stage's hidden states as `input`. With context parallelism tokens and positions are this
  // rank's chunks of the sequences (cp_slice) and positions their global positions; the last virtual stage returns this
  // rank's logits [seq, batch, padded_vocab / tp] (vocab_range()). tokens, positions [batch, seq] int64; with sequence
  // parallelism seq must be divisible by tp. With multi-token prediction the last virtual stage also embeds
  // `mtp_tokens` [D, batch, seq], the tokens 1..D positions ahead (shifted_ahead of the whole sequences, then this
  // rank's context-parallel chunks); undefined: shifted here from `tokens` (no context parallelism). `documents`
  // [batch, whole seq] int64 (TokenBatch::documents, never sliced for context parallelism), when defined, keeps each
  // token's softmax attention within its document (Megatron's --reset-attention-mask, whose documents the
  // linear-attention and Mamba mixers ignore as megatron-core's do, or --dataloader-inter-document-masking).
  ChunkForward forward_chunk(int chunk, const at::Tensor& input, const at::Tensor& tokens, const at::Tensor& positions,
                             const at::Tensor& mtp_tokens = at::Tensor(), const at::Tensor& documents = at::Tensor());
  // The whole model (one stage, one chunk): logits as forward_chunk's.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& documents = at::Tensor());
  // Per-token loss [batch, seq] (fp32) of predicting labels [batch, seq].
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& labels);
  // Per-token loss [batch, seq] (fp32) from the last chunk's logits.
  at::Tensor loss_from_logits(const at::Tensor& logits, const at::Tensor& labels) const;
  // Per-token loss [batch, seq] (fp32) from the last chunk's output: its logits, or with fused_output_loss the final
  // norm's output, through the chunked output-layer cross-entropy.
  at::Tensor loss_from_output(const at::Tensor& output, const at::Tensor& labels) const;
  // Σ token_weights · loss (fp32, 0-dim) from the same output, and the per-token loss without gradient: the
  // trainer's loss, whose gradient reaches each token as its weight (a loss mask times the loss's scale) times one
  // scalar. With fused_output_loss the output layer's gradients are made in the forward pass
  // (weighted_output_cross_entropy: no logits computed again).
  WeightedOutputLoss weighted_loss_from_output(const at::Tensor& output, const at::Tensor& labels,
                                               const at::Tensor& token_weights) const;
  // Sequence length, width and dtype of what chunk `chunk` of this stage receives: [hidden_sequence(seq), batch,
  // stage_width(chunk)]: the hidden states; with Gemma 4's per-layer inputs (made from the embedding on the first
  // stage, read by every layer) beside them, [..., + layers · per_layer_input_size]; then, for each kind of layer
  // (full attention, then windowed) whose shared keys and values an earlier chunk made and this one or a later one
  // reuses, its keys and values ([s, b, this rank's groups · d] each; under sequence parallelism the sequence's tp
  // slices side by side, [s / tp, b, tp · groups · d]).
  std::int64_t hidden_sequence(std::int64_t seq) const;
  std::int64_t stage_width(int chunk) const;
  at::ScalarType activation_dtype() const { return options_.dtype; }

  // What the MoE aux loss's gradient is scaled by from the next forward on (loss scale x cp / micro-batches; with
  // `times_tokens`, --calculate-per-token-loss, the loss scale times the tokens each router saw on this rank).
  void set_aux_loss_backward_scale(double scale, bool times_tokens = false) {
    aux_loss_backward_scale_ = scale;
    aux_loss_times_tokens_ = times_tokens;
  }
  int stage() const { return options_.pipeline_stage; }
  int chunks() const { return static_cast<int>(chunk_layers_.size()); }
  bool is_first_virtual_stage(int chunk) const { return stage() == 0 && chunk == 0; }
  bool is_last_virtual_stage(int chunk) const { return stage() == layout_.pp - 1 && chunk == chunks() - 1; }
  // The last stage's copy of the embedding that the output layer (tied embeddings) or multi-token prediction uses
  // (pp > 1): its gradient is summed with the first stage's, and it is left out of the gradient norm.
  bool holds_embedding_copy() const {
    return (spec_.tied_embeddings || spec_.mtp_num_layers > 0) && layout_.pp > 1 && stage() == layout_.pp - 1;
  }
  // After backward: sums over tp the gradients of replicated parameters that saw only part of the data on each rank
  // (sequence-parallel norms, q/k norms), as Megatron's finalize_model_grads does; routed experts' over the experts'
  // tensor-parallel group.
  void finish_grads(std::vector<at::Tensor>& grads);  // grads: one per parameters() entry (undefined: none)
  // Gradient accumulation fusion: the linear layers' weights (the output layer's unless tied to the embedding) whose
  // `sink_of` gives a sink accumulate their gradients there (fused_linear.h); the others keep autograd's .grad.
  void fuse_weight_grads(const std::function<WeightGradSink*(const at::Tensor& weight)>& sink_of);

  // The MoE layers' router expert biases with the tokens routed to each expert since the last reset (null when the
  // model has no expert bias), in layer order: what Megatron's aux-loss-free balancing reads and moves.
  struct ExpertBalance {
    at::Tensor bias;                    // the parameter, in the model's dtype
    std::shared_ptr<at::Tensor> state;  // its fp32 value, which routing reads
    std::shared_ptr<at::Tensor> load;
  };
  std::vector<ExpertBalance> expert_balances() const;
  // global_aux_loss: clears the MoE layers' running expert counts (TransformerLayer::global_counts), after each
  // iteration's forwards and backwards, as megatron-core's finalize_model_grads resets its routers' trackers.
  void reset_global_expert_counts();
  // The router losses this rank's MoE layers logged since the last call (TransformerLayer::router_loss_log), cleared:
  // fp64 on the CPU, [num_layers + mtp_num_layers, kRouterLosses], a row per decoder layer and then per MTP layer
  // (megatron-core's tracker's rows), zero where this rank holds no MoE layer. Whether this rank holds one:
  // has_moe_layer.
  at::Tensor take_router_losses();
  bool has_moe_layer() const;
  // Megatron keeps the expert bias as an fp32 buffer, so its balancing steps add up in fp32 whatever the training
  // dtype. Fills each held bias's fp32 state: from `reader` (the optimizer's fp32 master of it where the checkpoint
  // holds one, else the stored weight, read as fp32), or without a reader from the parameters. After loading or
  // initialising the parameters.
  Status load_expert_bias_state(const CheckpointReader* reader);
  // The held expert biases' fp32 states by parameter name (what a save writes for them).
  std::map<std::string, at::Tensor> expert_bias_states() const;

  const GptModelSpec& spec() const { return spec_; }
  const ParallelLayout& layout() const { return layout_; }
  const TpGroup& tp_group() const { return group_; }
  const VocabRange& vocab_range() const { return vocab_; }
  std::int64_t padded_vocab_size() const { return padded_vocab_; }
  // The trainable parameters: the adapters under LoRA, else every weight the stage holds.
  std::vector<ModelParameter>& parameters() { return trainable().all(); }
  ModelParameters& parameter_store() { return trainable(); }
  // Every base weight the stage holds (frozen under LoRA).
  ModelParameters& base_parameter_store() { return parameters_; }
  // The tensors a vision-language model carries beside its language model (its vision tower, first stage): never read
  // by text-only training, so frozen; loaded, saved and exported unchanged.
  ModelParameters& carried_store() { return carried_; }
  const std::optional<LoraConfig>& lora() const { return options_.lora; }

 private:
  // Each held parameter that is a router expert bias, with its balance (state and load).
  std::vector<std::pair<const ModelParameter*, ExpertBalance>> held_expert_biases() const;
  GptModel(GptModelSpec spec, ParallelLayout layout, TpGroup group, ModelOptions options, ModelParameters parameters);
  Status bind(const std::vector<LayerRange>& chunks);
  // An MoE layer's running expert counts, under global_aux_loss.
  void hold_global_expert_counts(TransformerLayer& layer) const;
  std::shared_ptr<LayerContext> make_context(const at::Tensor& positions, std::int64_t seq,
                                             const at::Tensor& documents) const;
  // tokens [b, s] -> the embedded sequence [s, b, h] (this rank's slice of it under sequence parallelism).
  at::Tensor embed(const at::Tensor& tokens) const;
  // The chunked output loss's options for this model on `device`.
  OutputLossOptions output_loss_options(at::Device device) const;
  // Gemma 4: the per-layer inputs [s, b, num_layers, per_layer_input_size] of the tokens [b, s] whose embedded
  // sequence is `embedded` (this rank's slice of both under sequence parallelism).
  at::Tensor per_layer_inputs(const at::Tensor& tokens, const at::Tensor& embedded) const;
  // The final norm's output -> this rank's logits.
  at::Tensor output_logits(const at::Tensor& normed, const LayerContext& context) const;
  at::Tensor run_layer(const TransformerLayer& layer, const at::Tensor& x, const LayerContext& context) const;
  // One multi-token-prediction depth: the previous depth's hidden states and the tokens this depth looks ahead to
  // -> its hidden states after its final norm.
  struct MtpLayer {
    at::Tensor enorm, hnorm, eh_proj, final_norm;
    TransformerLayer layer;
  };
  at::Tensor mtp_forward(const MtpLayer& mtp, const at::Tensor& hidden, const at::Tensor& tokens,
                         const LayerContext& context) const;

  GptModelSpec spec_;
  ParallelLayout layout_;
  TpGroup group_;
  ModelOptions options_;
  ModelParameters& trainable() { return options_.lora ? adapters_ : parameters_; }

  ModelParameters parameters_;
  ModelParameters adapters_;  // LoRA's (none without)
  ModelParameters carried_;   // a vision tower's (none without)
  std::int64_t padded_vocab_ = 0;
  VocabRange vocab_;
  at::Tensor inverse_frequencies_, local_inverse_frequencies_;
  std::map<std::pair<bool, std::int64_t>, at::Tensor> layer_inverse_frequencies_;  // Gemma 4's, by (windowed, head size)
  at::Tensor per_layer_embeddings_, per_layer_model_projection_, per_layer_projection_norm_;  // Gemma 4's
  TpGroup cp_group_;  // options_.cp as a TpGroup (the Mamba mixers' all-to-all)
  at::Tensor embedding_, final_norm_, output_weight_;
  WeightGradSink* output_sink_ = nullptr;
  double aux_loss_backward_scale_ = 1.0;
  bool aux_loss_times_tokens_ = false;
  std::vector<std::vector<TransformerLayer>> chunk_layers_;  // per chunk of this stage
  std::vector<LayerRange> chunk_ranges_;                     // their layers' numbers (a chunk may hold none)
  // Gemma 4: the kinds of layer (windowed or not) whose shared keys and values cross into a chunk starting at `layer`,
  // and the width one of its keys or values takes in what chunks pass on.
  std::vector<bool> kv_kinds_into(std::int64_t layer) const;
  std::int64_t kv_source_of_kind(bool windowed) const;  // the layer making that kind's shared keys and values
  std::int64_t passed_kv_width(bool windowed) const;
  std::vector<MtpLayer> mtp_layers_;                         // on the last stage
  std::shared_ptr<const LayerContext> latest_context_;       // of forward(): kept until the next one (its backward)
};

// t [batch, seq] -> [depth, batch, seq]: row d - 1 holds t shifted d positions left (t[:, i + d]), zeros past the
// end: the tokens, labels and loss mask multi-token-prediction depth d sees (Megatron's roll_tensor, applied d times).
at::Tensor shifted_ahead(const at::Tensor& t, std::int64_t depth);

// Loads the model's base weights from a checkpoint (any saved layout), the router expert biases' fp32 state with them.
inline Status load_model_pieces(GptModel& model, const CheckpointReader& reader) {
  TRESTLE_RETURN_IF_ERROR(load_model_pieces(model.base_parameter_store(), reader));
  return model.load_expert_bias_state(&reader);
}

}  // namespace trestle::train
