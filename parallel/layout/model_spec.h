// The Megatron side of a GPT model (Llama, Mistral, Qwen, Mixtral-style MoE): its sizes as Megatron-Core names them and
// the canonical tensors it has, each with its Megatron-Core name (global layer and expert indices), canonical global
// shape, tensor-parallel split and owning pipeline stage / layer / expert. Converters map Hugging Face names onto this
// list; the trainer's parameters are its pieces. Pure functions; no I/O and no Hugging Face names.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/shape.h"
#include "ckpt/status.h"
#include "parallel/layout/tp_split.h"

namespace trestle {

// Layer-norm names: Transformer Engine's spec fuses the input norm into linear_qkv and (dense MLP) the pre-MLP norm
// into linear_fc1; the local spec keeps input_layernorm / pre_mlp_layernorm. MoE layers keep pre_mlp_layernorm.
enum class NormNaming { kTransformerEngine, kLocal };
std::string_view norm_naming_name(NormNaming naming);        // "transformer_engine" | "local"
std::string input_norm_name(NormNaming naming);              // relative to decoder.layers.{i}.
std::string pre_mlp_norm_name(NormNaming naming, bool moe);  // relative to decoder.layers.{i}.
std::string linear_attention_input_norm_name(NormNaming naming);  // a Gated DeltaNet layer's, relative to the same
struct GptModelSpec;

// The widest dimension a model description may give (hidden, MLP, head and latent sizes) and its largest vocabulary:
// far above any model's, and low enough that a tensor's elements (heads x head size x hidden, experts x MLP x hidden,
// vocabulary x hidden) stay within an int64.
inline constexpr std::int64_t kMaxModelWidth = std::int64_t{1} << 22;
inline constexpr std::int64_t kMaxVocabSize = std::int64_t{1} << 36;

// The norms after attention and after a dense MLP (post_norms), relative to decoder.layers.{i}.: Gemma 2 / 3's and a
// Gemma 4 MoE model's self_attention.linear_proj.post_layernorm and mlp.linear_fc2.post_layernorm, a dense Gemma 4's
// post_self_attn_layernorm and post_mlp_layernorm (Megatron-Bridge's names for each).
std::string post_attention_norm_name(const GptModelSpec& spec);
std::string post_mlp_norm_name(const GptModelSpec& spec);
// Transformer Engine when a tensor named like one of its fused norms (attention's, multi-latent attention's kv norm, a
// Mamba mixer's or a dense MLP's) is present, local otherwise.
NormNaming detect_norm_naming(const std::vector<std::string>& tensor_names);

// RoPE frequency scaling: none, linear interpolation (every frequency divided by factor), Llama 3.1's (low
// frequencies divided by factor, high ones kept, a smooth blend between low_freq_factor and high_freq_factor) or YaRN
// (frequencies blended between interpolated and kept along a ramp over the dimensions set by beta_fast and
// beta_slow rotations, and the cos / sin tables scaled by an attention factor from factor, mscale and mscale_all_dim).
enum class RopeScalingType { kNone, kLinear, kLlama3, kYarn };
std::string_view rope_scaling_name(RopeScalingType type);  // "none" | "linear" | "llama3" | "yarn"
struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;                          // llama3 only
  double high_freq_factor = 4.0;                         // llama3 only
  std::int64_t original_max_position_embeddings = 8192;  // llama3 and yarn
  double beta_fast = 32.0;                               // yarn only
  double beta_slow = 1.0;                                // yarn only
  double mscale = 0.0;                                   // yarn only (0: none)
  double mscale_all_dim = 0.0;                           // yarn only (0: none)
  bool truncate = true;                                  // yarn only: the correction range rounded to whole dims
  bool operator==(const RopeScaling&) const = default;
};

struct GptModelSpec {
  std::int64_t num_layers = 0;
  std::int64_t hidden_size = 0;
  std::int64_t ffn_hidden_size = 0;  // per expert for MoE
  std::int64_t num_attention_heads = 0;
  std::int64_t num_query_groups = 0;               // KV heads
  std::int64_t kv_channels = 0;                    // head dim
  std::int64_t vocab_size = 0;                     // unpadded
  std::int64_t num_experts = 0;                    // 0: dense MLP in every layer; else MoE in every layer
  std::int64_t shared_expert_ffn_hidden_size = 0;  // MoE: Megatron's moe_shared_expert_intermediate_size (0: none)
  bool shared_expert_gate = false;                 // the shared expert's output scaled by sigmoid(x · gate_weight)
  std::int64_t moe_router_topk = 2;                // experts per token
  bool moe_router_pre_softmax = false;  // softmax over all experts before the top-k (else after: renormalised)
  bool add_qkv_bias = false;
  bool qk_layernorm = false;
  bool tied_embeddings = false;  // no output_layer.weight: the last stage uses the word embeddings
  NormNaming norms = NormNaming::kTransformerEngine;
  double norm_epsilon = 1e-5;  // RMSNorm epsilon (Megatron's default)
  double rotary_base = 10000.0;
  // RoPE over the first rotary_percent of each head's dims, the rest passed through (Megatron's rotary_percent;
  // GLM-4.5's partial_rotary_factor 0.5).
  double rotary_percent = 1.0;
  RopeScaling rope_scaling;
  // Sliding window: a query sees the last window_size positions, itself included (Hugging Face's sliding_window;
  // Megatron's window_size (window_size - 1, 0)); 0 = every earlier position.
  std::int64_t window_size = 0;
  // Gemma 2 / 3: GeGLU (tanh GELU) instead of SwiGLU, norm weights w applied as (1 + w) (Megatron's
  // layernorm_zero_centered_gamma), norms after attention and after the MLP too (post_layernorm weights), soft-capped
  // attention and output logits (0: none), and sliding-window attention in some layers only (window_size then being
  // the local layers' window).
  bool geglu = false;
  bool zero_centered_norms = false;
  bool post_norms = false;
  double attn_logit_softcapping = 0.0;
  double final_logit_softcapping = 0.0;
  bool mixed_attention = false;
  // With mixed_attention, which layers have the window (Megatron's window_attn_skip_freq: N makes every Nth layer,
  // counting from 1, a full one; a list gives 1 for each windowed layer); one entry per layer.
  std::vector<bool> window_layers;
  // Gemma: attention scores scaled by query_pre_attn_scalar^-1/2 instead of kv_channels^-1/2 (0: kv_channels), the
  // embedding output multiplied by sqrt(hidden_size) in the model's dtype, and (Gemma 3) the windowed layers' RoPE
  // with a base of their own and no scaling (0: rotary_base and rope_scaling as every other layer).
  double query_pre_attn_scalar = 0.0;
  bool scale_embeddings = false;
  double rotary_base_local = 0.0;
  // OLMo 2: no norm before attention or the MLP (pre_norms false; post_norms carries the two after them), and q/k norms
  // over the whole query / key projection (weights [heads · kv_channels] and [groups · kv_channels], every rank holding
  // all of it, as Megatron-Bridge's OLMoE attention does) instead of over each head.
  bool pre_norms = true;
  bool qk_norm_full_projection = false;
  // DeepSeek-V3 / V2 multi-latent attention when kv_lora_rank > 0: queries through a low-rank down / up projection
  // with a norm between them (q_lora_rank > 0) or one linear_q_proj; keys and values from one down projection
  // [latent (kv_lora_rank); shared rotary key (qk_pos_emb_head_dim)], a norm on the latent and an up projection
  // [k (qk_head_dim); v (v_head_dim)] per head. The down projections are replicated under Transformer Engine's spec
  // and column-parallel under the local one.
  std::int64_t q_lora_rank = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t qk_head_dim = 0;
  std::int64_t qk_pos_emb_head_dim = 0;
  std::int64_t v_head_dim = 0;
  // An MoE model whose first layers are dense (DeepSeek's first_k_dense_replace; Megatron's moe_layer_freq
  // [0]*k + [1]*rest), with their own FFN size.
  std::int64_t moe_first_dense_layers = 0;
  std::int64_t dense_ffn_hidden_size = 0;
  bool moe_router_expert_bias = false;  // mlp.router.expert_bias [num_experts] (DeepSeek's e_score_correction_bias)
  // The router's scores (Megatron's moe_router_score_function: "softmax" or "sigmoid"), group-limited top-k (experts
  // in num_groups groups of which a token may use group_topk; 0: not limited) and the routed experts' weights scaled
  // by topk_scaling_factor (0: not scaled).
  std::string moe_router_score_function = "softmax";
  std::int64_t moe_router_num_groups = 0;
  std::int64_t moe_router_group_topk = 0;
  double moe_router_topk_scaling_factor = 0.0;
  // Multi-token-prediction layers after the decoder (DeepSeek-V3's), on the last pipeline stage:
  // mtp.layers.<k>.{enorm, hnorm, eh_proj, transformer_layer.<a decoder layer's tensors>, final_layernorm}.
  std::int64_t mtp_num_layers = 0;
  // GPT-OSS: biases on every linear layer (Megatron's add_bias_linear: linear_proj, the MLPs' and experts' fc1 / fc2,
  // the router), and a learnable softmax offset per attention head (softmax_type "learnable": the attention sinks).
  bool add_bias_linear = false;
  bool softmax_offset = false;
  bool quick_geglu = false;  // experts x · sigmoid(1.702 x) · (up + 1), both halves clamped (activation "quick_geglu")
  double activation_clamp = 0.0;   // quick_geglu: the gate clamped at most this, the linear half to ± it (0: none)
  double glu_linear_offset = 0.0;  // quick_geglu: added to the linear half (GPT-OSS's + 1)
  // Qwen3-Next / Qwen3.5: the full-attention layers' query projection also makes a sigmoid gate on the attention output
  // (Megatron's attention_output_gate: linear_qkv per group [queries; gates; key; value]).
  bool attention_output_gate = false;
  // Qwen3-Next / Qwen3.5: Gated DeltaNet (Megatron's experimental_attention_variant "gated_delta_net") in the layers
  // marked here, one entry per layer (empty: none). Its in_proj makes [query; key; value; z; beta; alpha] and conv1d
  // runs over [query; key; value]; Megatron-Core saves both split into those parts (in_proj.weight.query, ...), each
  // split over the tp ranks by heads.
  std::vector<bool> linear_attention_layers;
  std::int64_t linear_conv_kernel_dim = 0;
  std::int64_t linear_key_head_dim = 0;
  std::int64_t linear_value_head_dim = 0;
  std::int64_t linear_num_key_heads = 0;
  std::int64_t linear_num_value_heads = 0;
  // How the Hugging Face model splits in_proj: Qwen3.5's four projections (in_proj_qkv, _z, _b, _a) when set, else
  // Qwen3-Next's two (in_proj_qkvz, in_proj_ba); the canonical LoRA puts one adapter on each (lora_spec.h).
  bool linear_in_proj_split = false;
  bool has_linear_attention() const {
    for (const bool linear : linear_attention_layers)
      if (linear) return true;
    return false;
  }
  bool layer_is_linear_attention(std::int64_t layer) const {
    return layer >= 0 && layer < static_cast<std::int64_t>(linear_attention_layers.size()) &&
           linear_attention_layers[static_cast<std::size_t>(layer)];
  }
  // Nemotron-H (Megatron-Core's MambaModel) when hybrid_layers is set: one mixer per layer, as Megatron's
  // hybrid_override_pattern says ('M' a Mamba-2 mixer, '*' self-attention alone, '-' an MLP alone of
  // dense_ffn_hidden_size in an MoE model, 'E' a mixture of experts alone), no position embedding, MLPs and experts
  // fc2(relu(fc1 x)^2) (squared_relu, not gated), the final norm decoder.final_norm. A Mamba mixer's
  // in_proj makes [z; x; B; C; dt] and its conv1d runs over [x; B; C]; Megatron-Core saves both split into those parts
  // (mixer.in_proj.weight.z, ...), each split over the tp ranks (z, x by heads, B, C by groups).
  std::string hybrid_layers;
  std::int64_t mamba_num_heads = 0;
  std::int64_t mamba_head_dim = 0;
  std::int64_t mamba_state_dim = 0;
  std::int64_t mamba_num_groups = 0;
  std::int64_t mamba_conv_kernel = 4;
  bool squared_relu = false;
  // Nemotron-H's latent MoE: the routed experts work in a space of this width, entered through mlp.fc1_latent_proj and
  // left through mlp.fc2_latent_proj (0: the experts take the hidden state itself).
  std::int64_t moe_latent_size = 0;
  // Gemma 4: attention whose head size and KV heads differ by layer (layer_kv_channels / layer_query_groups, one entry
  // per layer; empty: kv_channels and num_query_groups everywhere), the keys serving as the values in the
  // full-attention layers (attention_k_eq_v: there linear_qkv holds per group [queries; key], no value rows), the last
  // kv_shared_layers layers reusing earlier layers' keys and values (their attention has linear_q_proj alone and its
  // norm input_layernorm; with double_wide_mlp their MLP is twice as wide), a scalar scaling each layer's output
  // (layer_scalar [1]), and per-layer input embeddings of per_layer_input_size per layer: per_layer_embedding
  // [per_layer_vocab_size, num_layers x per_layer_input_size], per_layer_model_proj from the hidden state and
  // per_layer_proj_norm, and in each layer per_layer_input_gate, per_layer_projection and post_per_layer_input_norm. All
  // of them replicated over tp.
  std::vector<std::int64_t> layer_kv_channels;
  std::vector<std::int64_t> layer_query_groups;
  bool attention_k_eq_v = false;
  std::int64_t kv_shared_layers = 0;
  bool double_wide_mlp = false;
  bool layer_scalar = false;
  std::int64_t per_layer_input_size = 0;
  std::int64_t per_layer_vocab_size = 0;
  // Gemma 4's MoE: every layer holds its dense MLP as shared experts (with a pre-norm of its own,
  // pre_shared_expert_layernorm, and the post-norm mlp.post_shared_expert_layernorm) beside the routed
  // experts (pre_mlp_layernorm before them), whose router scales its normed input by mlp.router.scale and each
  // chosen expert's weight by mlp.router.per_expert_scale; the experts' sum has its post-norm mlp.post_moe_layernorm,
  // and the two outputs' sum post_ffn_layernorm.
  bool moe_beside_mlp = false;
  // Gemma 4's attention: scores scaled by softmax_scale (0: query_pre_attn_scalar^-1/2, else kv_channels^-1/2), the
  // values RMS-normed per head without a weight (value_norm), and the full-attention layers' "proportional" RoPE
  // (global_rope_fraction > 0): of a head of d dims, the first global_rope_fraction · d / 2 frequency pairs rotate
  // (rotate-half over the whole head, frequencies base^(-2i/d)) and the rest pass through; the windowed layers' RoPE is
  // plain, of base rotary_base_local.
  double softmax_scale = 0.0;
  bool value_norm = false;
  double global_rope_fraction = 0.0;
  std::int64_t layer_kv_channels_of(std::int64_t layer) const {
    return layer >= 0 && layer < static_cast<std::int64_t>(layer_kv_channels.size())
               ? layer_kv_channels[static_cast<std::size_t>(layer)]
               : kv_channels;
  }
  std::int64_t layer_query_groups_of(std::int64_t layer) const {
    return layer >= 0 && layer < static_cast<std::int64_t>(layer_query_groups.size())
               ? layer_query_groups[static_cast<std::size_t>(layer)]
               : num_query_groups;
  }
  // A Gemma 4 layer that reuses an earlier layer's keys and values (one of the last kv_shared_layers).
  bool layer_kv_shared(std::int64_t layer) const { return kv_shared_layers > 0 && layer >= num_layers - kv_shared_layers; }
  // The layer whose keys and values a KV-sharing layer reuses: the last one before the sharing layers that has its
  // window (or lack of one); -1 for other layers or where there is none.
  std::int64_t kv_source_layer(std::int64_t layer) const {
    if (!layer_kv_shared(layer)) return -1;
    for (std::int64_t i = num_layers - kv_shared_layers - 1; i >= 0; --i)
      if (layer_has_window(i) == layer_has_window(layer)) return i;
    return -1;
  }
  // A layer whose keys are its values (a full-attention layer of a model with attention_k_eq_v).
  bool layer_k_eq_v(std::int64_t layer) const {
    return attention_k_eq_v && !layer_kv_shared(layer) && !layer_has_window(layer);
  }
  // Tensors outside the language model that travel with it unchanged: a vision-language model's vision tower and
  // projector (Qwen3-VL's vision_model.*, Megatron-Bridge's names), replicated over tp, held by the first pipeline
  // stage, listed after the output layer.
  struct CarriedTensor {
    std::string name;
    Shape shape;
    bool operator==(const CarriedTensor&) const = default;
  };
  std::vector<CarriedTensor> carried_tensors;
  bool hybrid() const { return !hybrid_layers.empty(); }
  // A hybrid layer's mixer ('M', '*', '-' or 'E'); 0 for a GPT model.
  char hybrid_layer(std::int64_t layer) const {
    return layer >= 0 && layer < static_cast<std::int64_t>(hybrid_layers.size())
               ? hybrid_layers[static_cast<std::size_t>(layer)]
               : '\0';
  }
  bool multi_latent_attention() const { return kv_lora_rank > 0; }
  // The dims RoPE rotates in each query / key head: multi-latent attention's decoupled RoPE dims, else the first
  // floor(kv_channels · rotary_percent) of the head (as Megatron-Core's RotaryEmbedding and transformers count them).
  std::int64_t rotary_dim() const {
    if (multi_latent_attention()) return qk_pos_emb_head_dim;
    return static_cast<std::int64_t>(static_cast<double>(kv_channels) * rotary_percent);
  }
  // Whether decoder layer `layer` (0-based) attends through the sliding window.
  bool layer_has_window(std::int64_t layer) const {
    if (window_size <= 0) return false;
    if (!mixed_attention) return true;
    return layer >= 0 && layer < static_cast<std::int64_t>(window_layers.size()) &&
           window_layers[static_cast<std::size_t>(layer)];
  }
  bool layer_is_moe(std::int64_t layer) const {
    if (hybrid()) return hybrid_layer(layer) == 'E';
    return num_experts > 0 && layer >= moe_first_dense_layers;
  }
  bool is_moe() const { return num_experts > 0; }
};

// The spec a converted checkpoint's manifest describes: `model` is the manifest's model JSON, whose "megatron" block
// holds Megatron's sizes (and "parallel".norm_naming the norm names). Missing optional values take Megatron's defaults;
// errors name `source` and the field.
Result<GptModelSpec> gpt_spec_from_json(const nlohmann::json& model, const std::string& source);

// Where a tensor lives in the pipeline: the first stage (embedding), the last (final norm, output layer) or the stage
// owning its layer.
enum class Placement { kFirstStage, kLastStage, kLayer };

struct CanonicalTensor {
  std::string name;
  Shape shape;  // canonical global shape
  TpSplit split = TpSplit::kReplicated;
  Placement placement = Placement::kLayer;
  std::int64_t layer = -1;   // global layer, for kLayer
  std::int64_t expert = -1;  // global expert, or -1 for dense tensors
};

// Every canonical tensor of the model, in Megatron's module order (embedding, each layer, final norm, output layer).
// Errors name the size that is missing or inconsistent.
Result<std::vector<CanonicalTensor>> canonical_tensors(const GptModelSpec& spec);

// The MLPs' hidden sizes against the tensor-parallel sizes that split them: the dense MLP's (Megatron's
// ffn_hidden_size, an MoE model's dense layers' too) and the shared experts' over `tp`, the routed experts' over
// `expert_tp`. Errors name the size by Megatron's argument before any tensor is placed.
Status check_mlp_split(const GptModelSpec& spec, int tp, int expert_tp);

}  // namespace trestle
