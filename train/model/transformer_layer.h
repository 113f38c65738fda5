// One decoder layer of the plain transformer, as the math reads: x + attention(rmsnorm(x)), then + swiglu(rmsnorm(x)).
// Attention is grouped-query (MQA/GQA) with RoPE, optional QKV bias, optional q/k RMSNorm per head (or, OLMo 2, over
// the whole projection), causal with an optional sliding window, its output optionally gated (Qwen3-Next); or
// multi-latent attention (DeepSeek); or a Gated DeltaNet (Qwen3-Next's linear attention). A hybrid model's layer
// (Nemotron-H, Megatron-Core's MambaModel) has one mixer, x + mixer(rmsnorm(x)): a Mamba-2 mixer, attention alone (no
// RoPE), an MLP alone or a mixture of experts alone; its MLPs are squared-ReLU. Gemma's and OLMo 2's
// variants: norms after attention and the MLP (and none before them: OLMo 2), (1 + w) norms, GeGLU, soft-capped
// attention logits, Gemma's attention scale, windows and RoPE bases per layer. Gemma 4's: head sizes and KV heads per
// layer, keys as values, value norms, KV sharing, per-layer inputs, a layer scalar, experts beside the MLP. Under
// tensor parallelism QKV and fc1 are column-parallel and linear_proj and fc2 row-parallel (the region boundaries of tp_regions.h); under sequence
// parallelism x is this rank's slice of the sequence. Tensors are [sequence, batch, hidden].
#pragma once

#include <ATen/Tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/layout/model_spec.h"
#include "train/model/context_parallel.h"
#include "train/model/fused_linear.h"
#include "train/model/lora.h"
#include "train/model/model_parameters.h"
#include "train/model/moe_router.h"
#include "train/model/rope.h"
#include "train/model/tp_group.h"

namespace trestle::train {

// What every layer of one forward shares.
struct LayerContext {
  const GptModelSpec* spec = nullptr;
  const TpGroup* group = nullptr;
  bool sequence_parallel = false;
  RopeTables rope;
  RopeTables local_rope;  // the windowed layers' own (Gemma 3's rope_local_base_freq); undefined: `rope`
  // Gemma 4: each kind of layer's tables by (windowed, head size); empty: `rope` / `local_rope`.
  std::map<std::pair<bool, std::int64_t>, RopeTables> layer_rope;
  // Gemma 4's per-layer inputs of this rank's tokens, [seq, batch, num_layers, per_layer_input_size]; undefined without.
  at::Tensor per_layer_inputs;
  // Gemma 4's KV sharing: the keys and values ([seq, batch, this rank's groups, d], normed and rotated) of the last
  // layer of each kind (windowed or not) before the sharing layers, stored by it and read by them in one forward.
  std::shared_ptr<std::map<bool, std::pair<at::Tensor, at::Tensor>>> shared_kv;
  // Which keys each query may attend to (bool, true = may attend), broadcast over [batch, heads, seq, seq]: the
  // windowed layers' (causal within the window, and within the document with documents; none: no window shorter than
  // the sequence and no documents), and the other softmax attention layers' (causal within the document; none: plain
  // causal). Without context parallelism.
  std::optional<at::Tensor> window_mask, full_mask;
  // Under context parallelism, TokenBatch::documents of the whole sequences ([batch, seq · cp]; undefined: none), which
  // the ring's blocks mask by.
  at::Tensor documents;
  // Context parallelism: x holds this rank's two chunks of the sequence (context_parallel.h) and attention runs as
  // ring attention over the group; null (or size 1): the whole sequence is here.
  const CpRing* cp = nullptr;
  // The same group for collectives through autograd (the Mamba mixers' all-to-all); null without cp.
  const TpGroup* cp_group = nullptr;
  // Expert parallelism: this rank's expert-parallel group (null or size 1: every expert is here).
  const TpGroup* ep = nullptr;
  // Megatron's --moe-router-dtype: the router's logits (its GEMM), top-k, probabilities and losses in this dtype
  // (their gradients return in the model's); the combined expert outputs are cast back. Undefined: the model's dtype.
  at::ScalarType router_dtype = at::ScalarType::Undefined;
  // The routed experts' tensor-parallel group (Megatron's expert tensor parallelism); null: `group`.
  const TpGroup* expert_tp = nullptr;
  // MoE: Megatron's load-balancing (aux) loss and router z-loss coefficients (0: none), and what their gradients are
  // scaled by in backward (Megatron's MoEAuxLossAutoScaler: loss scale / micro-batches). Both only where gradients
  // are computed.
  LoadBalancingCoefficients load_balancing;
  // The data-parallel group (global_aux_loss counts the experts' tokens over it); null: none.
  const TpGroup* dp = nullptr;
  double z_loss_coeff = 0.0;
  ExpertCapacity capacity;  // Megatron's --moe-expert-capacity-factor and its policies (none: every token kept)
  double aux_loss_backward_scale = 1.0;
  // --calculate-per-token-loss: the scale is also multiplied by the tokens the router saw on this rank (megatron-core's
  // router, whose gradients are then divided by the global batch's counted tokens).
  bool aux_loss_times_tokens = false;
  // MoE: each projection of the local experts runs as one grouped GEMM over the rows grouped by expert (PyTorch's
  // _grouped_mm; CUDA only: its CPU backward is missing) instead of a GEMM per expert. Same weights, same names. Experts
  // with LoRA adapters run a GEMM per expert all the same.
  bool grouped_experts = false;
  // The fused kernels (kernels/fused_ops.h) for the norms, the gated units and soft-capping where they take the
  // tensors; otherwise (and when false) the composites of ATen ops. Same values within fp32 rounding.
  bool fused_kernels = false;
  LoraForward lora;  // the layers' adapters' scale and dropout (TransformerLayer::adapters)
};

// The residual stream between layers: base + delta, the addition left to the next layer's input norm, which does it in
// its own pass (add_then_norm); delta undefined: base alone.
struct ResidualStream {
  at::Tensor base, delta;
  at::Tensor whole() const;  // base + delta
};

struct TransformerLayer {
  // input_norm and mlp_norm are undefined without norms before attention and the MLP (OLMo 2); post_attention_norm and
  // post_mlp_norm are defined with norms after them (Gemma, OLMo 2).
  at::Tensor input_norm, qkv_weight, qkv_bias, q_norm, k_norm, proj_weight, mlp_norm, fc1_weight, fc2_weight;
  at::Tensor post_attention_norm, post_mlp_norm;
  bool windowed = false;  // this layer attends through the sliding window (GptModelSpec::layer_has_window)
  std::int64_t index = 0;  // the layer's number in the model
  // Its attention's head size and KV heads (Gemma 4's differ by layer), whether its keys are its values (no value rows
  // in linear_qkv), and whether it stores its keys and values for later layers (kv_store) or reuses an earlier
  // layer's (kv_reuse: queries through q_proj alone).
  std::int64_t kv_channels = 0, query_groups = 0;
  bool k_eq_v = false, kv_store = false, kv_reuse = false;
  // Gemma 4: the per-layer input's gate, projection and post-norm, and the scalar the layer's output is multiplied by
  // (transformers' buffer: read detached, so it stays as loaded); undefined without.
  at::Tensor per_layer_gate, per_layer_projection, per_layer_norm, layer_scalar;
  // Gemma 4's MoE layers: the dense MLP (fc1_weight / fc2_weight) with its own pre- and post-norm beside the experts,
  // the router's input scale and per-expert weight scale, and the norms after the experts and after both.
  at::Tensor dense_mlp_norm, dense_post_norm, router_scale, per_expert_scale, post_moe_norm, post_ffn_norm;
  // GPT-OSS: biases of linear_proj and the dense MLP (added after the row-parallel reduction, fc1's before the
  // activation), the router's, and the attention sinks (one learned logit per head in each softmax's denominator, this
  // rank's heads); undefined in models without them.
  at::Tensor proj_bias, fc1_bias, fc2_bias, router_bias, sinks;
  // Multi-latent attention (DeepSeek) instead of qkv_weight: queries through q_down, its norm and q_up (or q_proj
  // alone), keys and values from kv_down's latent (normed, then kv_up per head) and its shared RoPE key. The down
  // projections are replicated (Transformer Engine's names) or column-parallel, their output gathered (local names).
  at::Tensor q_down, q_latent_norm, q_up, q_proj, kv_down, kv_latent_norm, kv_up;
  // Gated DeltaNet (Qwen3-Next / Qwen3.5's linear attention) instead of qkv_weight, in layers the spec marks: in_proj's
  // parts [query; key; value; z; beta; alpha] and conv1d's [query; key; value] (this rank's heads: column-parallel),
  // dt_bias and A_log (this rank's value heads), the gated norm's zero-centred weight (replicated); out_proj is
  // proj_weight. Empty / undefined in other layers.
  std::vector<at::Tensor> in_proj, conv1d;
  at::Tensor dt_bias, a_log, out_norm;
  // A hybrid model's layer: its one mixer ('M', '*', '-' or 'E': GptModelSpec::hybrid_layer; 0 in other models). A
  // Mamba-2 mixer ('M') has in_proj's parts [z; x; B; C; dt] and conv1d's weights and biases over [x; B; C] (this
  // rank's heads and groups: column-parallel), A_log, D and dt_bias per head and the gated norm's weight (this rank's
  // heads, out_norm), out_proj as proj_weight; its norm is input_norm. The MLP and MoE layers' norm is mlp_norm.
  char mixer = 0;
  std::vector<at::Tensor> mamba_in_proj, mamba_conv_weight, mamba_conv_bias;
  at::Tensor mamba_d;
  // Nemotron-H's latent MoE: the routed experts' rows enter through fc1_latent and leave through fc2_latent
  // (replicated); undefined without.
  at::Tensor fc1_latent, fc2_latent;
  at::Tensor expert_bias;  // the router's selection bias (DeepSeek's aux-loss-free balancing); undefined without
  // With expert_bias: its value in fp32 (Megatron's fp32 buffer), which routing reads and the balancing moves; the
  // parameter (in the model's dtype, what a save writes) follows it. GptModel::load_expert_bias_state fills it.
  std::shared_ptr<at::Tensor> expert_bias_state;
  // With expert_bias: the tokens routed to each expert (fp32 [num_experts]) by this rank's forwards that compute
  // gradients since the last reset (a recomputed forward counts once), which the balancing moves the bias by.
  std::shared_ptr<at::Tensor> expert_load;
  // With global_aux_loss (MoE layers): the expert counts over the tp·dp·cp ranks summed over this iteration's
  // micro-batches so far, and how many micro-batches that is (megatron-core's global_tokens_per_expert and ga_steps).
  // GptModel::reset_global_expert_counts clears it after each iteration; null without.
  struct RunningExpertCounts {
    at::Tensor sum;  // fp32 [num_experts]; undefined before the first micro-batch
    std::int64_t micro_batches = 0;
  };
  std::shared_ptr<RunningExpertCounts> global_counts;
  // MoE layers: the router losses (RouterLoss order, fp32 [kRouterLosses] on the layer's device) of this rank's
  // forwards that compute gradients since GptModel::take_router_losses, each this rank's share of the layer's loss as
  // megatron-core's tracker sums it (its tokens' term; a loss every tensor-parallel rank computes whole, once over
  // them); null in dense layers.
  std::shared_ptr<at::Tensor> router_loss_log;
  // Mixture of experts (spec.num_experts > 0) instead of fc1/fc2: the router, the fc1 / fc2 pieces of this rank's
  // experts (a contiguous block under expert parallelism) and the shared expert (with its gate) when the model has one.
  at::Tensor router_weight, shared_fc1, shared_fc2, shared_gate, shared_fc1_bias, shared_fc2_bias;
  std::vector<at::Tensor> expert_fc1, expert_fc2, expert_fc1_bias, expert_fc2_bias;  // biases: empty without
  // Where the four linears' weight gradients accumulate when fused (fused_linear.h); null: through autograd.
  WeightGradSink *qkv_sink = nullptr, *proj_sink = nullptr, *fc1_sink = nullptr, *fc2_sink = nullptr;
  LayerAdapters adapters;  // LoRA on the dense linears (lora.h); none by default

  // Binds the layer's pieces (by canonical name: `prefix` and the layer's own names; decoder.layers.<layer>. when
  // empty) from `parameters`, of the experts [first_expert, first_expert + experts) (all of them when experts is 0);
  // `layer` gives its kind (windowed, MoE). Errors name a missing piece.
  static Result<TransformerLayer> bind(const ModelParameters& parameters, const GptModelSpec& spec, std::int64_t layer,
                                       std::int64_t first_expert = 0, std::int64_t experts = 0,
                                       const std::string& prefix = "");
  at::Tensor forward(const at::Tensor& x, const LayerContext& context) const;
  // The same on the stream: a layer with norms before attention and the MLP and nothing after its last residual step
  // (Llama's, Mistral's, Qwen's, Gemma's, ...) takes a pending delta into its input norm's pass and leaves its MLP's
  // output as the next delta; other layers add what is pending first and return their output whole.
  ResidualStream forward(const ResidualStream& in, const LayerContext& context) const;

 private:
  bool streams() const;  // whether the stream form takes a pending delta and leaves one
  at::Tensor attention(const at::Tensor& x, const LayerContext& context) const;
  at::Tensor latent_attention(const at::Tensor& x, const LayerContext& context) const;
  at::Tensor gated_delta_net(const at::Tensor& x, const LayerContext& context) const;
  at::Tensor mamba_mixer(const at::Tensor& x, const LayerContext& context) const;
  at::Tensor mlp(const at::Tensor& x, const LayerContext& context) const;
  at::Tensor dense_mlp(const at::Tensor& x, const LayerContext& context) const;
  // Gemma 4's feed-forward part: the dense MLP and the experts side by side, each with its norms.
  at::Tensor mlp_beside_experts(const at::Tensor& h, const LayerContext& context) const;
  // Gemma 4's per-layer input added to the layer's output h.
  at::Tensor add_per_layer_input(const at::Tensor& h, const LayerContext& context) const;
  // linear_proj on the attention heads' output `heads` (this rank's), with its bias and adapter.
  at::Tensor attention_output(const at::Tensor& heads, const LayerContext& context) const;
  // `router_input` (same layout as x): what the router reads instead of x (Gemma 4's: the layer's un-normed input).
  at::Tensor moe(const at::Tensor& x, const LayerContext& context, const at::Tensor& router_input = {}) const;
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double epsilon);
// The model's RMS norm: rms_norm, or with zero-centred weights (Gemma) (1 + w) · x̂ computed in fp32; `fused`: the
// fused kernel where it takes x.
at::Tensor model_norm(const at::Tensor& x, const at::Tensor& weight, const GptModelSpec& spec, bool fused = false);
// A residual step and the norm after it: {h = x + delta, model_norm(h)}; delta undefined: {x, model_norm(x)}. `fused`
// (where the kernels take x): one autograd node whose backward adds h's gradient from the rest of the stream into the
// norm's in one pass.
struct NormedResidual {
  at::Tensor sum, normed;
};
NormedResidual add_then_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                             const GptModelSpec& spec, bool fused = false);
// An MLP's activation of its fc1 output: Nemotron-H's squared ReLU relu(x)², or the gated unit of an fc1 output
// [gate; up] (last dim): SwiGLU silu(gate) · up, Gemma's GeGLU gelu_tanh(gate) · up, or GPT-OSS's quick GeGLU
// gate · sigmoid(1.702 gate) · (up + offset) with the gate clamped at most to the clamp value and up to ± it.
// `fused`: SwiGLU and GeGLU by the fused kernel where it takes the tensor.
at::Tensor mlp_activation(const at::Tensor& fc1_output, const GptModelSpec& spec, bool fused = false);
// cap · tanh(x / cap) (Gemma 2's soft-capping), by the fused kernel when `fused` and it takes x.
at::Tensor softcap(const at::Tensor& x, double cap, bool fused = false);

// The input of a column-parallel linear (all of the sequence) and the output of a row-parallel one (reduced; this
// rank's slice of the sequence under sequence parallelism).
at::Tensor enter_tp_region(const at::Tensor& x, const LayerContext& context);
at::Tensor leave_tp_region(const at::Tensor& partial, const LayerContext& context);

}  // namespace trestle::train
