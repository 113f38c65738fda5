// Architecture bridges between Hugging Face and Megatron-Core: one small declarative table per architecture saying
// which Megatron tensor is made from which Hugging Face tensors, by which shared transformation (the Megatron tensors
// themselves, with their shapes and TP splits, are the layout library's: parallel/layout/model_spec.h). Also reads
// config.json into a BridgeModel, refusing architectures and options we do not support.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "convert/bridge/hf_config.h"
#include "convert/bridge/qkv.h"
#include "parallel/layout/model_spec.h"

namespace trestle {

// The transformations, each written once (bridge_plan.cc turns them into element copies).
enum class Fusion {
  kCopy,         // one HF tensor is the Megatron tensor
  kQkv,          // q, k, v → Megatron per-group QKV order (weights and biases)
  kQk,           // q, k → per group [queries; key]: Gemma 4's layers whose keys are their values
  kFusedQkv,     // one [q; k; v] tensor (Phi-3's qkv_proj) → Megatron per-group QKV order
  kGated,        // gate, up → [gate; up]
  kExpertSlice,  // slice {e} of a fused HF expert tensor [E, ...] (transformers 5 layout; gate_up_proj is [gate; up])
  // GPT-OSS's fused experts, stored [in, out] and with gate / up interleaved (gate j at 2j, up j at 2j + 1):
  kExpertSliceTransposed,             // down_proj [E, I, H] -> [H, I]
  kExpertSliceTransposedInterleaved,  // gate_up_proj [E, H, 2I] (interleaved columns) -> [gate; up] [2I, H]
  kExpertSliceInterleaved,            // gate_up_proj_bias [E, 2I] (interleaved) -> [gate; up]
  // Qwen3-Next / Qwen3.5 (TensorRule::part picks the Megatron tensor's part):
  kGatedQkv,  // q_proj (each head's query rows, then its gate rows), k, v -> per group [queries; gates; key; value]
  kGdnQkvz,   // in_proj_qkvz (per key head [q; k; v; z]) -> in_proj.weight.{query, key, value, z} (parts 0-3)
  kGdnBa,     // in_proj_ba (per key head [beta; alpha]) -> in_proj.weight.{beta, alpha} (parts 0-1)
  kGdnQkv,    // [all q; all k; all v] (in_proj_qkv, conv1d.weight) -> {query, key, value} (parts 0-2)
  // Nemotron-H's Mamba-2 mixer (TensorRule::part picks the part):
  kMambaInProj,  // in_proj [z; x; B; C; dt] -> in_proj.weight.{z, x, B, C, dt} (parts 0-4)
  kMambaConv,    // conv1d weight / bias over [x; B; C] -> conv1d.{weight,bias}.{x, B, C} (parts 0-2)
  kTransposed,   // a 2-D tensor stored [in, out] (Gemma 3's mm_input_projection_weight) -> [out, in]
};

// kLayer / kExpert rules apply to every decoder layer and to each multi-token-prediction layer (there named
// mtp.layers.{k}.transformer_layer.* on the Megatron side, model.layers.{num_layers + k}.* on the Hugging Face side,
// mtp.layers.{k}.* in Qwen3-Next's and Qwen3.5's checkpoints);
// kMtp rules to the multi-token-prediction layers only.
enum class Scope { kModel, kLayer, kExpert, kMtp };

// When a rule applies.
enum class Condition {
  kAlways,
  kUntied,
  kOriginalExperts,  // (in MoE layers) per-expert Hugging Face tensors
  kFusedExperts,     // (in MoE layers) transformers 5's fused expert tensors
  kFusedTransposedExperts,  // (in MoE layers) the same stored transposed (Qwen3-VL-MoE's gate_up_proj [E, H, 2I])
  kSharedExpert,  // (in MoE layers) the shared experts, where the model has them
  kDenseLayer,  // a dense layer of an MoE model (DeepSeek's first_k_dense_replace)
  kMoeLayer,
  kQLora,  // multi-latent attention with a low-rank query (q_lora_rank > 0)
  kNoQLora,
  kQkvBias,  // q / k / v biases where the config chooses them (GLM-4.5's attention_bias)
  kQkNorm,   // q / k norms where the config chooses them (GLM-4.5's use_qk_norm)
  kLinearAttentionLayer,  // a Gated DeltaNet layer (Qwen3-Next / Qwen3.5's linear_attention)
  kFullAttentionLayer,    // a softmax-attention layer of a model that also has Gated DeltaNet ones
  kMambaLayer,            // Nemotron-H: a layer whose mixer is Mamba-2 ('M')
  kAttentionOnlyLayer,    // Nemotron-H: a layer of self-attention alone ('*')
  kMlpOnlyLayer,          // Nemotron-H: a layer of an MLP alone ('-')
  kLatentMoe,             // Nemotron-H: an MoE layer whose experts work in a latent space (moe_latent_size)
  // Gemma 4's attention: a layer with its own keys and values, one of the last layers reusing earlier ones (queries
  // alone), one with values of their own or one whose keys are its values (attention_k_eq_v's full-attention layers);
  // and the per-layer inputs, where the model has them.
  kKvLayer,
  kKvSharedLayer,
  kValueLayer,
  kKEqVLayer,
  kPerLayerInputs,
};

// Names are templates: {i} the global layer, {e} the global expert, {k} the multi-token-prediction layer,
// {input_norm} / {pre_mlp_norm} the layer-norm names of the layout's naming (megatron_layout.h), {q_norm} / {kv_norm}
// multi-latent attention's norms (Transformer Engine: fused into linear_q_up_proj / linear_kv_up_proj),
// {linear_input_norm} a Gated DeltaNet layer's input norm (Transformer Engine: fused into in_proj), {mamba_norm} a
// Mamba layer's (Transformer Engine: fused into mixer.in_proj; local: norm.weight).
struct TensorRule {
  Scope scope;
  std::string megatron;
  std::vector<std::string> hf;
  Fusion fusion;
  Condition when = Condition::kAlways;
  int part = 0;        // which part of the sources kGdnQkvz / kGdnBa / kGdnQkv take
  double shift = 0.0;  // the Megatron value is the Hugging Face one plus this (Qwen3-Next's gated norm: -1)
};

enum class MoeStyle { kNone, kMixtral, kQwen3Moe, kQwen2Moe, kDeepSeek, kGptOss, kGlm4Moe, kNemotronH, kGemma4 };

struct BridgeModel {
  HfModelConfig hf;
  std::string architecture;  // e.g. "LlamaForCausalLM"
  MoeStyle moe = MoeStyle::kNone;
  bool qkv_bias = false;
  bool qk_norm = false;
  std::int64_t ffn_hidden_size = 0;                // per expert for MoE
  std::int64_t shared_expert_ffn_hidden_size = 0;  // Qwen2-MoE's shared expert (0: none); it has a sigmoid gate
  std::string family;                              // "Llama", "Qwen2-MoE", "Gemma 2", ...
  bool gemma = false;  // Gemma 2 / 3: GeGLU, (1 + w) norms, post-norms, soft-capping, alternating windows
  bool olmo2 = false;  // OLMo 2: norms after attention and the MLP only, q/k norms over the whole projection
  // DeepSeek-V3: multi-latent attention, dense layers before the MoE ones, the router's expert bias, shared experts
  // without a gate, multi-token-prediction layers (mtp_layers: those the checkpoint holds).
  std::int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  std::int64_t first_dense_layers = 0;
  std::int64_t dense_ffn_hidden_size = 0;
  std::int64_t mtp_layers = 0;
  bool deepseek() const { return moe == MoeStyle::kDeepSeek; }
  // GLM-4.5 / 4.7: DeepSeek-V3's MoE (dense first layers, sigmoid router with expert bias and groups, ungated shared
  // experts, multi-token-prediction layers) under grouped-query attention with optional q/k/v biases and q/k norms,
  // and RoPE over part of each head (rotary_percent: partial_rotary_factor).
  bool glm4_moe() const { return moe == MoeStyle::kGlm4Moe; }
  // The MoE DeepSeek-V3 and GLM-4.5 share.
  bool deepseek_moe() const { return deepseek() || glm4_moe(); }
  // DeepSeek-V3's sigmoid router with its expert bias, groups and scaling: theirs and Nemotron-H's MoE layers'.
  bool sigmoid_router() const { return deepseek_moe() || moe == MoeStyle::kNemotronH; }
  double rotary_percent = 1.0;
  // GPT-OSS: biases everywhere, attention sinks, clamped SwiGLU experts, alternating sliding-window layers.
  bool gpt_oss() const { return moe == MoeStyle::kGptOss; }
  // Qwen3-Next / Qwen3.5: Gated DeltaNet layers where layer_types says linear_attention (linear_layers, one per
  // layer), softmax attention with an output gate and (1 + w) q/k norms in the others, partial rotary, RMSNorms
  // applied as (1 + w) everywhere but the Gated DeltaNet's own gated norm.
  bool gated_delta_net = false;
  // Whether the model can hold multi-token-prediction layers (DeepSeek-V3's and GLM-4.5's model.layers.<L + k>.*,
  // Qwen3-Next's and Qwen3.5's mtp.*).
  bool has_mtp() const { return deepseek_moe() || gated_delta_net; }
  std::vector<bool> linear_layers;
  // Nemotron-H: one mixer per layer (Megatron's hybrid_override_pattern: M Mamba-2, * attention, - MLP, E MoE), the Mamba-2
  // sizes (heads, head dim, state, groups, conv kernel), MLPs with squared ReLU, no position embedding.
  std::string hybrid_layers;
  std::int64_t mamba_num_heads = 0, mamba_head_dim = 0, mamba_state_dim = 0, mamba_num_groups = 0,
               mamba_conv_kernel = 0;
  // Nemotron-H's MoE layers ('E'): DeepSeek-V3's sigmoid router with its expert bias, squared-ReLU experts and shared
  // experts, the routed experts in a latent space of this width where the config has one (0: none).
  std::int64_t moe_latent_size = 0;
  bool nemotron_h() const { return !hybrid_layers.empty(); }
  std::int64_t linear_conv_kernel_dim = 0, linear_key_head_dim = 0, linear_value_head_dim = 0,
               linear_num_key_heads = 0, linear_num_value_heads = 0;
  // A vision-language model: its vision tower and projector under Megatron-Bridge's names, their shapes from
  // vision_config; empty for text models. Qwen3-VL's tower is Megatron-Core's modules there (vision_model.decoder.layers.N.*
  // for model.visual.blocks.N.*, its fused QKV per head [q; k; v] where Hugging Face stacks [all q; all k; all v]);
  // Gemma 3's is transformers' own (vision_tower.X and multi_modal_projector.*, whose projection Megatron holds
  // transposed). Not trained: carried as they are, but for `fusion`.
  struct VisionTensor {
    std::string megatron, hf;
    Shape shape;                   // Megatron's
    Fusion fusion = Fusion::kCopy;  // kCopy, kTransposed or kFusedQkv (by `qkv`)
    QkvLayout qkv{};
  };
  std::vector<VisionTensor> vision_tensors;
  bool vision_language() const { return !vision_tensors.empty(); }
  // Gemma 3's vision tower named as Google publishes it, vision_tower.vision_model.X, rather than vision_tower.X as
  // transformers 5 saves it (both load): set by name_vision_tower, kept on the way back.
  bool vision_tower_nested = false;
  // Gemma 4 (text): Gemma's layers (GeGLU, four norms per layer, soft-capped logits) with plain norms, q/k norms and
  // attention of layer_head_dim / layer_kv_heads per layer (per_layer_config, else global_head_dim and
  // num_global_key_value_heads in the full-attention layers), keys as values in the full-attention layers
  // (attention_k_eq_v), the last kv_shared_layers layers reusing earlier keys and values (their MLP twice as wide with
  // use_double_wide_mlp), a scalar per layer, per-layer input embeddings (per_layer_input_size wide,
  // per_layer_vocab_size rows; 0: none), and with enable_moe_block experts beside every layer's MLP (MoeStyle::kGemma4).
  bool gemma4 = false;
  std::vector<std::int64_t> layer_head_dim, layer_kv_heads;
  bool k_eq_v = false, double_wide_mlp = false;
  std::int64_t kv_shared_layers = 0, per_layer_input_size = 0, per_layer_vocab_size = 0;
  bool tied() const { return hf.tie_word_embeddings; }
  bool is_moe() const { return moe != MoeStyle::kNone; }
};

// Names Gemma 3's vision tower on the Hugging Face side vision_tower.vision_model.X (nested) or vision_tower.X; a
// no-op for other models.
void name_vision_tower(BridgeModel& model, bool nested);
// Whether a Hugging Face checkpoint's tensor names are of that nested form: some start with vision_tower.vision_model.
bool has_nested_vision_tower(const std::vector<std::string>& hf_names);

// Gemma 4's multimodal model carries its vision and audio towers (model.vision_tower.*, model.audio_tower.*,
// model.embed_vision.*, model.embed_audio.*) as its checkpoint holds them, under the names without "model.": which
// tensors and their shapes come from the checkpoint (carry_towers_found), or from a Trestle checkpoint's description
// (carry_towers_described: an error for a name outside those towers). No-ops for other models.
bool carries_towers_as_found(const BridgeModel& model);
void carry_towers_found(BridgeModel& model, const std::map<std::string, Shape>& hf_tensors);
Status carry_towers_described(BridgeModel& model, const std::vector<GptModelSpec::CarriedTensor>& described);

// The architectures[0] values we convert, in the order error messages list them.
const std::vector<std::string>& supported_architectures();

// Validates the config for conversion: a supported architecture, and no option that would change behaviour in a way
// Megatron-Core's GPT model does not reproduce (sliding window, biases beyond QKV, non-uniform MoE layers, ...).
Result<BridgeModel> bridge_model_from_config(const HfModelConfig& config);

// The architecture's table.
const std::vector<TensorRule>& architecture_rules(const BridgeModel& model);

// How many multi-token-prediction layers a DeepSeek-V3 or GLM-4.5 checkpoint holds (model.layers.{num_layers + k}.eh_proj), at
// most the config's num_nextn_predict_layers; Qwen3-Next's and Qwen3.5's one (mtp.fc); 0 for other models and for
// checkpoints without them (transformers does not save them).
std::int64_t count_mtp_layers(const BridgeModel& model, const std::vector<std::string>& hf_names);
// Hugging Face tensors of a multi-token-prediction layer that repeat the model's own (its embed_tokens and
// shared_head.head are copies of the embedding and lm_head): checked equal to them on import, not converted.

// Gemma 3's RoPE parameters of one kind of layer ("full_attention" or "sliding_attention": transformers 5 keeps one
// block for each in rope_parameters); null when the config has none (earlier configs keep them at the top level).
const nlohmann::json* gemma3_rope_block(const nlohmann::json& raw, const char* layer_type);

// The Megatron side of the model: its sizes as Megatron-Core names them, with the given layer-norm naming.
GptModelSpec megatron_spec(const BridgeModel& model, NormNaming norms);

// Megatron-Core splits a Gated DeltaNet's heads over the tp ranks, and a Mamba mixer's heads and groups, and Gemma 4's
// every layer's KV heads: an error naming the counts unless tp divides them (OK for models without such layers).
Status check_linear_attention_tp(const BridgeModel& model, int tp);

}  // namespace trestle
