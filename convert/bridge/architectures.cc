#include "convert/bridge/architectures.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace trestle {
namespace {

using json = nlohmann::json;

std::vector<TensorRule> join(std::initializer_list<std::vector<TensorRule>> parts) {
  std::vector<TensorRule> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

const std::string kLayer = "decoder.layers.{i}.";
const std::string kHfLayer = "model.layers.{i}.";
const std::string kExpert = "decoder.layers.{i}.mlp.experts.local_experts.{e}.";

std::vector<TensorRule> embedding_rules() {
  return {
      {Scope::kModel,
       "embedding.word_embeddings.weight",
       {"model.embed_tokens.weight"},
       Fusion::kCopy,
       Condition::kAlways},
      {Scope::kModel, "decoder.final_layernorm.weight", {"model.norm.weight"}, Fusion::kCopy, Condition::kAlways},
      {Scope::kModel, "output_layer.weight", {"lm_head.weight"}, Fusion::kCopy, Condition::kUntied},
  };
}

std::vector<TensorRule> attention_rules() {
  const std::string a = kHfLayer + "self_attn.";
  return {
      {Scope::kLayer, kLayer + "{input_norm}", {kHfLayer + "input_layernorm.weight"}, Fusion::kCopy},
      {Scope::kLayer,
       kLayer + "self_attention.linear_qkv.weight",
       {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
       Fusion::kQkv},
      {Scope::kLayer, kLayer + "self_attention.linear_proj.weight", {a + "o_proj.weight"}, Fusion::kCopy},
      {Scope::kLayer, kLayer + "{pre_mlp_norm}", {kHfLayer + "post_attention_layernorm.weight"}, Fusion::kCopy},
  };
}

std::vector<TensorRule> qkv_bias_rules() {
  const std::string a = kHfLayer + "self_attn.";
  return {{Scope::kLayer,
           kLayer + "self_attention.linear_qkv.bias",
           {a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"},
           Fusion::kQkv}};
}

std::vector<TensorRule> qk_norm_rules() {
  return {
      {Scope::kLayer,
       kLayer + "self_attention.q_layernorm.weight",
       {kHfLayer + "self_attn.q_norm.weight"},
       Fusion::kCopy},
      {Scope::kLayer,
       kLayer + "self_attention.k_layernorm.weight",
       {kHfLayer + "self_attn.k_norm.weight"},
       Fusion::kCopy},
  };
}

std::vector<TensorRule> dense_mlp_rules() {
  const std::string m = kHfLayer + "mlp.";
  return {
      {Scope::kLayer, kLayer + "mlp.linear_fc1.weight", {m + "gate_proj.weight", m + "up_proj.weight"}, Fusion::kGated},
      {Scope::kLayer, kLayer + "mlp.linear_fc2.weight", {m + "down_proj.weight"}, Fusion::kCopy},
  };
}

// Phi-3: q, k and v in one qkv_proj ([q; k; v]), gate and up in one gate_up_proj ([gate; up], which is already the
// canonical linear_fc1: all gate rows, then all up rows).
std::vector<TensorRule> phi3_rules() {
  const std::string a = kHfLayer + "self_attn.";
  const std::string m = kHfLayer + "mlp.";
  return {
      {Scope::kLayer, kLayer + "{input_norm}", {kHfLayer + "input_layernorm.weight"}, Fusion::kCopy},
      {Scope::kLayer, kLayer + "self_attention.linear_qkv.weight", {a + "qkv_proj.weight"}, Fusion::kFusedQkv},
      {Scope::kLayer, kLayer + "self_attention.linear_proj.weight", {a + "o_proj.weight"}, Fusion::kCopy},
      {Scope::kLayer, kLayer + "{pre_mlp_norm}", {kHfLayer + "post_attention_layernorm.weight"}, Fusion::kCopy},
      {Scope::kLayer, kLayer + "mlp.linear_fc1.weight", {m + "gate_up_proj.weight"}, Fusion::kCopy},
      {Scope::kLayer, kLayer + "mlp.linear_fc2.weight", {m + "down_proj.weight"}, Fusion::kCopy},
  };
}

// Gemma 2 / 3: norms before and after attention and the MLP (Megatron-Bridge's names: linear_proj.post_layernorm,
// linear_fc2.post_layernorm), weights stored as Hugging Face keeps them (applied as 1 + w on both sides).
std::vector<TensorRule> gemma_rules() {
  const std::string a = kHfLayer + "self_attn.";
  const std::string m = kHfLayer + "mlp.";
  return {
      {Scope::kLayer, kLayer + "{input_norm}", {kHfLayer + "input_layernorm.weight"}, Fusion::kCopy},
      {Scope::kLayer,
       kLayer + "self_attention.linear_qkv.weight",
       {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
       Fusion::kQkv},
      {Scope::kLayer, kLayer + "self_attention.linear_proj.weight", {a + "o_proj.weight"}, Fusion::kCopy},
      {Scope::kLayer,
       kLayer + "self_attention.linear_proj.post_layernorm.weight",
       {kHfLayer + "post_attention_layernorm.weight"},
       Fusion::kCopy},
      {Scope::kLayer, kLayer + "{pre_mlp_norm}", {kHfLayer + "pre_feedforward_layernorm.weight"}, Fusion::kCopy},
      {Scope::kLayer, kLayer + "mlp.linear_fc1.weight", {m + "gate_proj.weight", m + "up_proj.weight"}, Fusion::kGated},
      {Scope::kLayer, kLayer + "mlp.linear_fc2.weight", {m + "down_proj.weight"}, Fusion::kCopy},
      {Scope::kLayer,
       kLayer + "mlp.linear_fc2.post_layernorm.weight",
       {kHfLayer + "post_feedforward_layernorm.weight"},
       Fusion::kCopy},
  };
}

// OLMo 2: no norm before attention or the MLP, one after each (the Gemma post-norms' names), q/k norms over the
// whole projection (Megatron-Bridge's OLMoE keeps those under q_layernorm / k_layernorm).
std::vector<TensorRule> olmo2_rules() {
  const std::string a = kHfLayer + "self_attn.";
  const std::string m = kHfLayer + "mlp.";
  return join({{
                   {Scope::kLayer,
                    kLayer + "self_attention.linear_qkv.weight",
                    {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
                    Fusion::kQkv},
                   {Scope::kLayer, kLayer + "self_attention.linear_proj.weight", {a + "o_proj.weight"}, Fusion::kCopy},
                   {Scope::kLayer,
                    kLayer + "self_attention.linear_proj.post_layernorm.weight",
                    {kHfLayer + "post_attention_layernorm.weight"},
                    Fusion::kCopy},
                   {Scope::kLayer,
                    kLayer + "mlp.linear_fc1.weight",
                    {m + "gate_proj.weight", m + "up_proj.weight"},
                    Fusion::kGated},
                   {Scope::kLayer, kLayer + "mlp.linear_fc2.weight", {m + "down_proj.weight"}, Fusion::kCopy},
                   {Scope::kLayer,
                    kLayer + "mlp.linear_fc2.post_layernorm.weight",
                    {kHfLayer + "post_feedforward_layernorm.weight"},
                    Fusion::kCopy},
               },
               qk_norm_rules()});
}

// transformers 5's fused experts, shared by every MoE architecture.
std::vector<TensorRule> fused_expert_rules() {
  const std::string m = kHfLayer + "mlp.experts.";
  return {
      {Scope::kExpert,
       kExpert + "linear_fc1.weight",
       {m + "gate_up_proj"},
       Fusion::kExpertSlice,
       Condition::kFusedExperts},
      {Scope::kExpert,
       kExpert + "linear_fc2.weight",
       {m + "down_proj"},
       Fusion::kExpertSlice,
       Condition::kFusedExperts},
      {Scope::kExpert,
       kExpert + "linear_fc1.weight",
       {m + "gate_up_proj"},
       Fusion::kExpertSliceTransposed,
       Condition::kFusedTransposedExperts},
      {Scope::kExpert,
       kExpert + "linear_fc2.weight",
       {m + "down_proj"},
       Fusion::kExpertSliceTransposed,
       Condition::kFusedTransposedExperts},
  };
}

// Mixtral: Megatron-LM's loader maps block_sparse_moe.gate → router, cat(w1, w3) → fc1, w2 → fc2.
std::vector<TensorRule> mixtral_moe_rules() {
  const std::string b = kHfLayer + "block_sparse_moe.";
  return join({{
                   {Scope::kLayer,
                    kLayer + "mlp.router.weight",
                    {b + "gate.weight"},
                    Fusion::kCopy,
                    Condition::kOriginalExperts},
                   {Scope::kLayer,
                    kLayer + "mlp.router.weight",
                    {kHfLayer + "mlp.gate.weight"},
                    Fusion::kCopy,
                    Condition::kFusedExperts},
                   {Scope::kLayer,
                    kLayer + "mlp.router.weight",
                    {kHfLayer + "mlp.gate.weight"},
                    Fusion::kCopy,
                    Condition::kFusedTransposedExperts},
                   {Scope::kExpert,
                    kExpert + "linear_fc1.weight",
                    {b + "experts.{e}.w1.weight", b + "experts.{e}.w3.weight"},
                    Fusion::kGated,
                    Condition::kOriginalExperts},
                   {Scope::kExpert,
                    kExpert + "linear_fc2.weight",
                    {b + "experts.{e}.w2.weight"},
                    Fusion::kCopy,
                    Condition::kOriginalExperts},
               },
               fused_expert_rules()});
}

// Experts named like Qwen's (and DeepSeek's): mlp.experts.{e}.{gate,up,down}_proj, or transformers 5's fused ones.
std::vector<TensorRule> expert_rules() {
  const std::string m = kHfLayer + "mlp.";
  return join({{
                   {Scope::kExpert,
                    kExpert + "linear_fc1.weight",
                    {m + "experts.{e}.gate_proj.weight", m + "experts.{e}.up_proj.weight"},
                    Fusion::kGated,
                    Condition::kOriginalExperts},
                   {Scope::kExpert,
                    kExpert + "linear_fc2.weight",
                    {m + "experts.{e}.down_proj.weight"},
                    Fusion::kCopy,
                    Condition::kOriginalExperts},
               },
               fused_expert_rules()});
}

std::vector<TensorRule> qwen3_moe_rules() {
  const std::string m = kHfLayer + "mlp.";
  return join({{{Scope::kLayer, kLayer + "mlp.router.weight", {m + "gate.weight"}, Fusion::kCopy}}, expert_rules()});
}

// Qwen2-MoE / Qwen1.5-MoE: Qwen3-MoE's experts plus a shared expert whose output is scaled by a sigmoid gate.
std::vector<TensorRule> qwen2_moe_rules() {
  const std::string m = kHfLayer + "mlp.";
  const std::string shared = kLayer + "mlp.shared_experts.";
  return join({qwen3_moe_rules(),
               {
                   {Scope::kLayer,
                    shared + "linear_fc1.weight",
                    {m + "shared_expert.gate_proj.weight", m + "shared_expert.up_proj.weight"},
                    Fusion::kGated,
                    Condition::kSharedExpert},
                   {Scope::kLayer,
                    shared + "linear_fc2.weight",
                    {m + "shared_expert.down_proj.weight"},
                    Fusion::kCopy,
                    Condition::kSharedExpert},
                   {Scope::kLayer,
                    shared + "gate_weight",
                    {m + "shared_expert_gate.weight"},
                    Fusion::kCopy,
                    Condition::kSharedExpert},
               }});
}

// The MoE of DeepSeek-V3 and GLM-4.5 (Megatron-Bridge's names): dense MLPs in the first layers, then a sigmoid router
// with its score-correction bias (Megatron's expert_bias), routed experts (expert_rules) and ungated shared experts.
std::vector<TensorRule> deepseek_moe_rules() {
  const std::string m = kHfLayer + "mlp.";
  const std::string shared = kLayer + "mlp.shared_experts.";
  return {
      {Scope::kLayer,
       kLayer + "mlp.linear_fc1.weight",
       {m + "gate_proj.weight", m + "up_proj.weight"},
       Fusion::kGated,
       Condition::kDenseLayer},
      {Scope::kLayer,
       kLayer + "mlp.linear_fc2.weight",
       {m + "down_proj.weight"},
       Fusion::kCopy,
       Condition::kDenseLayer},
      {Scope::kLayer, kLayer + "mlp.router.weight", {m + "gate.weight"}, Fusion::kCopy, Condition::kMoeLayer},
      {Scope::kLayer,
       kLayer + "mlp.router.expert_bias",
       {m + "gate.e_score_correction_bias"},
       Fusion::kCopy,
       Condition::kMoeLayer},
      {Scope::kLayer,
       shared + "linear_fc1.weight",
       {m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight"},
       Fusion::kGated,
       Condition::kMoeLayer},
      {Scope::kLayer,
       shared + "linear_fc2.weight",
       {m + "shared_experts.down_proj.weight"},
       Fusion::kCopy,
       Condition::kMoeLayer},
  };
}

// A multi-token-prediction layer's own tensors beyond its decoder layer: two norms, the projection joining them and
// the final norm (DeepSeek-V3's and GLM-4.5's releases: model.layers.{num_layers + k}.*).
std::vector<TensorRule> mtp_rules() {
  const std::string mtp = "mtp.layers.{k}.";
  return {
      {Scope::kMtp, mtp + "enorm.weight", {kHfLayer + "enorm.weight"}, Fusion::kCopy},
      {Scope::kMtp, mtp + "hnorm.weight", {kHfLayer + "hnorm.weight"}, Fusion::kCopy},
      {Scope::kMtp, mtp + "eh_proj.weight", {kHfLayer + "eh_proj.weight"}, Fusion::kCopy},
      {Scope::kMtp, mtp + "final_layernorm.weight", {kHfLayer + "shared_head.norm.weight"}, Fusion::kCopy},
  };
}

// DeepSeek-V3 (Megatron-Bridge's names): multi-latent attention, then the MoE and multi-token prediction above.
std::vector<TensorRule> deepseek_rules() {
  const std::string a = kHfLayer + "self_attn.";
  const std::string sa = kLayer + "self_attention.";
  return join({{
                   {Scope::kLayer,
                    kLayer + "input_layernorm.weight",
                    {kHfLayer + "input_layernorm.weight"},
                    Fusion::kCopy},
                   {Scope::kLayer,
                    sa + "linear_q_down_proj.weight",
                    {a + "q_a_proj.weight"},
                    Fusion::kCopy,
                    Condition::kQLora},
                   {Scope::kLayer, kLayer + "{q_norm}", {a + "q_a_layernorm.weight"}, Fusion::kCopy, Condition::kQLora},
                   {Scope::kLayer,
                    sa + "linear_q_up_proj.weight",
                    {a + "q_b_proj.weight"},
                    Fusion::kCopy,
                    Condition::kQLora},
                   {Scope::kLayer,
                    sa + "linear_q_proj.weight",
                    {a + "q_proj.weight"},
                    Fusion::kCopy,
                    Condition::kNoQLora},
                   {Scope::kLayer, sa + "linear_kv_down_proj.weight", {a + "kv_a_proj_with_mqa.weight"}, Fusion::kCopy},
                   {Scope::kLayer, kLayer + "{kv_norm}", {a + "kv_a_layernorm.weight"}, Fusion::kCopy},
                   {Scope::kLayer, sa + "linear_kv_up_proj.weight", {a + "kv_b_proj.weight"}, Fusion::kCopy},
                   {Scope::kLayer, sa + "linear_proj.weight", {a + "o_proj.weight"}, Fusion::kCopy},
                   {Scope::kLayer,
                    kLayer + "{pre_mlp_norm}",
                    {kHfLayer + "post_attention_layernorm.weight"},
                    Fusion::kCopy},
               },
               deepseek_moe_rules(), mtp_rules()});
}

// GLM-4.5 / 4.7 (Megatron-Bridge's glm45_bridge.py names): Llama's attention with q/k/v biases (attention_bias) and
// per-head q/k norms (use_qk_norm) where the config has them, then DeepSeek-V3's MoE and multi-token prediction.
std::vector<TensorRule> glm4_moe_rules() {
  std::vector<TensorRule> bias = qkv_bias_rules(), norms = qk_norm_rules();
  for (auto& r : bias) r.when = Condition::kQkvBias;
  for (auto& r : norms) r.when = Condition::kQkNorm;
  return join({attention_rules(), bias, norms, deepseek_moe_rules(), mtp_rules()});
}

// GPT-OSS (Megatron-Bridge's names), beyond the biased attention: the output projection's bias, the attention sinks
// as the learnable softmax offset, a biased router, and transformers' fused experts, stored [in, out] with gate / up
// interleaved.
std::vector<TensorRule> gpt_oss_rules() {
  const std::string a = kHfLayer + "self_attn.";
  const std::string x = kHfLayer + "mlp.experts.";
  const std::string sa = kLayer + "self_attention.";
  return {
      {Scope::kLayer, sa + "core_attention.softmax_offset", {a + "sinks"}, Fusion::kCopy},
      {Scope::kLayer, sa + "linear_proj.bias", {a + "o_proj.bias"}, Fusion::kCopy},
      {Scope::kLayer, kLayer + "mlp.router.weight", {kHfLayer + "mlp.router.weight"}, Fusion::kCopy},
      {Scope::kLayer, kLayer + "mlp.router.bias", {kHfLayer + "mlp.router.bias"}, Fusion::kCopy},
      {Scope::kExpert, kExpert + "linear_fc1.weight", {x + "gate_up_proj"}, Fusion::kExpertSliceTransposedInterleaved},
      {Scope::kExpert, kExpert + "linear_fc1.bias", {x + "gate_up_proj_bias"}, Fusion::kExpertSliceInterleaved},
      {Scope::kExpert, kExpert + "linear_fc2.weight", {x + "down_proj"}, Fusion::kExpertSliceTransposed},
      {Scope::kExpert, kExpert + "linear_fc2.bias", {x + "down_proj_bias"}, Fusion::kExpertSlice},
  };
}

// Qwen3-Next / Qwen3.5 (Megatron-Bridge's qwen3_next_bridge.py names): in the full-attention layers Qwen3's attention
// with the output gate folded into q_proj; in the others a Gated DeltaNet, whose in_proj Megatron-Core saves split
// into its parts (in_proj.weight.query, ...): Qwen3-Next's fused in_proj_qkvz / in_proj_ba (per key head), or
// Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (split_projections). The gated norm is a plain RMSNorm
// in Hugging Face (weights near 1) and a (1 + w) one in Megatron: its weight is shifted by -1.
std::vector<TensorRule> qwen3_next_attention_rules(bool split_projections) {
  const std::string a = kHfLayer + "self_attn.";
  const std::string g = kHfLayer + "linear_attn.";
  const std::string sa = kLayer + "self_attention.";
  constexpr Condition full = Condition::kFullAttentionLayer, linear = Condition::kLinearAttentionLayer;
  std::vector<TensorRule> rules = {
      {Scope::kLayer, kLayer + "{input_norm}", {kHfLayer + "input_layernorm.weight"}, Fusion::kCopy, full},
      {Scope::kLayer,
       sa + "linear_qkv.weight",
       {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
       Fusion::kGatedQkv,
       full},
      {Scope::kLayer, sa + "q_layernorm.weight", {a + "q_norm.weight"}, Fusion::kCopy, full},
      {Scope::kLayer, sa + "k_layernorm.weight", {a + "k_norm.weight"}, Fusion::kCopy, full},
      {Scope::kLayer, sa + "linear_proj.weight", {a + "o_proj.weight"}, Fusion::kCopy, full},
      {Scope::kLayer, kLayer + "{linear_input_norm}", {kHfLayer + "input_layernorm.weight"}, Fusion::kCopy, linear},
      {Scope::kLayer, sa + "dt_bias", {g + "dt_bias"}, Fusion::kCopy, linear},
      {Scope::kLayer, sa + "A_log", {g + "A_log"}, Fusion::kCopy, linear},
      {Scope::kLayer, sa + "out_norm.weight", {g + "norm.weight"}, Fusion::kCopy, linear, 0, -1.0},
      {Scope::kLayer, sa + "out_proj.weight", {g + "out_proj.weight"}, Fusion::kCopy, linear},
      {Scope::kLayer, kLayer + "{pre_mlp_norm}", {kHfLayer + "post_attention_layernorm.weight"}, Fusion::kCopy},
  };
  const char* qkv[] = {"query", "key", "value"};
  for (int part = 0; part < 3; ++part)
    rules.push_back({Scope::kLayer, sa + "conv1d.weight." + qkv[part], {g + "conv1d.weight"}, Fusion::kGdnQkv, linear,
                     part});
  const std::string in = sa + "in_proj.weight.";
  if (split_projections) {
    for (int part = 0; part < 3; ++part)
      rules.push_back({Scope::kLayer, in + qkv[part], {g + "in_proj_qkv.weight"}, Fusion::kGdnQkv, linear, part});
    rules.push_back({Scope::kLayer, in + "z", {g + "in_proj_z.weight"}, Fusion::kCopy, linear});
    rules.push_back({Scope::kLayer, in + "beta", {g + "in_proj_b.weight"}, Fusion::kCopy, linear});
    rules.push_back({Scope::kLayer, in + "alpha", {g + "in_proj_a.weight"}, Fusion::kCopy, linear});
  } else {
    const char* qkvz[] = {"query", "key", "value", "z"};
    for (int part = 0; part < 4; ++part)
      rules.push_back({Scope::kLayer, in + qkvz[part], {g + "in_proj_qkvz.weight"}, Fusion::kGdnQkvz, linear, part});
    const char* ba[] = {"beta", "alpha"};
    for (int part = 0; part < 2; ++part)
      rules.push_back({Scope::kLayer, in + ba[part], {g + "in_proj_ba.weight"}, Fusion::kGdnBa, linear, part});
  }
  return rules;
}

// Qwen3-Next's and Qwen3.5's multi-token-prediction layer (Megatron-Bridge's names): mtp.fc joins the two norms'
// outputs, mtp.norm ends it; its decoder layer (mtp.layers.0.*) takes the layer rules as a full-attention layer.
std::vector<TensorRule> qwen3_next_mtp_rules() {
  const std::string mtp = "mtp.layers.{k}.";
  return {
      {Scope::kMtp, mtp + "enorm.weight", {"mtp.pre_fc_norm_embedding.weight"}, Fusion::kCopy},
      {Scope::kMtp, mtp + "hnorm.weight", {"mtp.pre_fc_norm_hidden.weight"}, Fusion::kCopy},
      {Scope::kMtp, mtp + "eh_proj.weight", {"mtp.fc.weight"}, Fusion::kCopy},
      {Scope::kMtp, mtp + "final_layernorm.weight", {"mtp.norm.weight"}, Fusion::kCopy},
  };
}

// Nemotron-H (Megatron-Bridge's nemotron_h_bridge.py names; Megatron-Core's MambaModel): each layer one mixer with
// its pre-norm backbone.layers.{i}.norm (fused into the mixer's first linear under Transformer Engine's spec): a
// Mamba-2 mixer, whose in_proj [z; x; B; C; dt] and conv1d over [x; B; C] Megatron-Core saves in parts, self-attention
// alone, or a squared-ReLU MLP alone (up_proj, down_proj).
std::vector<TensorRule> nemotron_h_rules() {
  const std::string b = "backbone.layers.{i}.";
  const std::string x = b + "mixer.";
  const std::string mx = kLayer + "mixer.";
  constexpr Condition mamba = Condition::kMambaLayer, attention = Condition::kAttentionOnlyLayer,
                      mlp = Condition::kMlpOnlyLayer;
  std::vector<TensorRule> rules = {
      {Scope::kModel, "embedding.word_embeddings.weight", {"backbone.embeddings.weight"}, Fusion::kCopy},
      {Scope::kModel, "decoder.final_norm.weight", {"backbone.norm_f.weight"}, Fusion::kCopy},
      {Scope::kModel, "output_layer.weight", {"lm_head.weight"}, Fusion::kCopy, Condition::kUntied},
      {Scope::kLayer, kLayer + "{mamba_norm}", {b + "norm.weight"}, Fusion::kCopy, mamba},
      {Scope::kLayer, mx + "A_log", {x + "A_log"}, Fusion::kCopy, mamba},
      {Scope::kLayer, mx + "D", {x + "D"}, Fusion::kCopy, mamba},
      {Scope::kLayer, mx + "dt_bias", {x + "dt_bias"}, Fusion::kCopy, mamba},
      {Scope::kLayer, mx + "norm.weight", {x + "norm.weight"}, Fusion::kCopy, mamba},
      {Scope::kLayer, mx + "out_proj.weight", {x + "out_proj.weight"}, Fusion::kCopy, mamba},
      {Scope::kLayer, kLayer + "{input_norm}", {b + "norm.weight"}, Fusion::kCopy, attention},
      {Scope::kLayer,
       kLayer + "self_attention.linear_qkv.weight",
       {x + "q_proj.weight", x + "k_proj.weight", x + "v_proj.weight"},
       Fusion::kQkv,
       attention},
      {Scope::kLayer, kLayer + "self_attention.linear_proj.weight", {x + "o_proj.weight"}, Fusion::kCopy, attention},
      {Scope::kLayer, kLayer + "{pre_mlp_norm}", {b + "norm.weight"}, Fusion::kCopy, mlp},
      {Scope::kLayer, kLayer + "mlp.linear_fc1.weight", {x + "up_proj.weight"}, Fusion::kCopy, mlp},
      {Scope::kLayer, kLayer + "mlp.linear_fc2.weight", {x + "down_proj.weight"}, Fusion::kCopy, mlp},
  };
  // MoE layers: the router with DeepSeek's e_score_correction_bias, experts and shared experts of up / down only, the
  // latent projections around the routed experts where the config has them.
  const std::string e = x + "experts.{e}.";
  constexpr Condition moe = Condition::kMoeLayer, experts = Condition::kOriginalExperts;
  for (TensorRule rule : std::vector<TensorRule>{
           {Scope::kLayer, kLayer + "{pre_mlp_norm}", {b + "norm.weight"}, Fusion::kCopy, moe},
           {Scope::kLayer, kLayer + "mlp.router.weight", {x + "gate.weight"}, Fusion::kCopy, moe},
           {Scope::kLayer, kLayer + "mlp.router.expert_bias", {x + "gate.e_score_correction_bias"}, Fusion::kCopy, moe},
           {Scope::kExpert, kExpert + "linear_fc1.weight", {e + "up_proj.weight"}, Fusion::kCopy, experts},
           {Scope::kExpert, kExpert + "linear_fc2.weight", {e + "down_proj.weight"}, Fusion::kCopy, experts},
           {Scope::kLayer, kLayer + "mlp.shared_experts.linear_fc1.weight", {x + "shared_experts.up_proj.weight"},
            Fusion::kCopy, Condition::kSharedExpert},
           {Scope::kLayer, kLayer + "mlp.shared_experts.linear_fc2.weight", {x + "shared_experts.down_proj.weight"},
            Fusion::kCopy, Condition::kSharedExpert},
           {Scope::kLayer, kLayer + "mlp.fc1_latent_proj.weight", {x + "fc1_latent_proj.weight"}, Fusion::kCopy,
            Condition::kLatentMoe},
           {Scope::kLayer, kLayer + "mlp.fc2_latent_proj.weight", {x + "fc2_latent_proj.weight"}, Fusion::kCopy,
            Condition::kLatentMoe},
       })
    rules.push_back(std::move(rule));
  const char* in_parts[] = {"z", "x", "B", "C", "dt"};
  for (int part = 0; part < 5; ++part)
    rules.push_back({Scope::kLayer, mx + "in_proj.weight." + in_parts[part], {x + "in_proj.weight"},
                     Fusion::kMambaInProj, mamba, part});
  const char* conv_parts[] = {"x", "B", "C"};
  for (const char* tensor : {"weight", "bias"})
    for (int part = 0; part < 3; ++part)
      rules.push_back({Scope::kLayer, mx + "conv1d." + tensor + "." + conv_parts[part], {x + "conv1d." + tensor},
                       Fusion::kMambaConv, mamba, part});
  return rules;
}

// Gemma 4 (text; Megatron-Bridge 0.6.2's gemma4_bridge.py names, which differ between its dense and MoE models, where
// it keeps the Hugging Face values as they are): Gemma's four norms per layer, q/k norms, the full-attention layers'
// keys as values ([queries; key] per group: Fusion::kQk), the KV-sharing layers' queries alone (linear_q_proj), the
// layer scalar, the per-layer inputs, and with enable_moe_block the dense MLP as shared experts with its own pre-norm
// beside the routed experts (router.proj, router.scale and per_expert_scale as three tensors). Where Megatron-Bridge
// stores what the checkpoint does not hold (zero keys and values in the KV-sharing layers, values copied from the keys)
// Trestle keeps the checkpoint's tensors alone.
std::vector<TensorRule> gemma4_rules() {
  const std::string a = kHfLayer + "self_attn.", m = kHfLayer + "mlp.", sa = kLayer + "self_attention.";
  const std::string sh = kLayer + "mlp.shared_experts.";
  constexpr Condition kv = Condition::kKvLayer, shared = Condition::kKvSharedLayer, dense = Condition::kDenseLayer,
                      moe = Condition::kMoeLayer, ple = Condition::kPerLayerInputs;
  return {
      {Scope::kModel, "per_layer_embedding.weight", {"model.embed_tokens_per_layer.weight"}, Fusion::kCopy, ple},
      {Scope::kModel, "per_layer_model_proj.weight", {"model.per_layer_model_projection.weight"}, Fusion::kCopy, ple},
      {Scope::kModel, "per_layer_proj_norm.weight", {"model.per_layer_projection_norm.weight"}, Fusion::kCopy, ple},
      {Scope::kLayer, kLayer + "{input_norm}", {kHfLayer + "input_layernorm.weight"}, Fusion::kCopy, kv},
      {Scope::kLayer, kLayer + "input_layernorm.weight", {kHfLayer + "input_layernorm.weight"}, Fusion::kCopy, shared},
      {Scope::kLayer, sa + "linear_qkv.weight", {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
       Fusion::kQkv, Condition::kValueLayer},
      {Scope::kLayer, sa + "linear_qkv.weight", {a + "q_proj.weight", a + "k_proj.weight"}, Fusion::kQk,
       Condition::kKEqVLayer},
      {Scope::kLayer, sa + "linear_q_proj.weight", {a + "q_proj.weight"}, Fusion::kCopy, shared},
      {Scope::kLayer, sa + "q_layernorm.weight", {a + "q_norm.weight"}, Fusion::kCopy},
      {Scope::kLayer, sa + "k_layernorm.weight", {a + "k_norm.weight"}, Fusion::kCopy, kv},
      {Scope::kLayer, sa + "linear_proj.weight", {a + "o_proj.weight"}, Fusion::kCopy},
      // Megatron-Bridge names the norm after attention by the model's kind: post_self_attn_layernorm in a dense one.
      {Scope::kLayer, kLayer + "post_self_attn_layernorm.weight", {kHfLayer + "post_attention_layernorm.weight"},
       Fusion::kCopy, dense},
      {Scope::kLayer, sa + "linear_proj.post_layernorm.weight", {kHfLayer + "post_attention_layernorm.weight"},
       Fusion::kCopy, moe},
      // Without experts: Gemma's MLP.
      {Scope::kLayer, kLayer + "{pre_mlp_norm}", {kHfLayer + "pre_feedforward_layernorm.weight"}, Fusion::kCopy, dense},
      {Scope::kLayer, kLayer + "mlp.linear_fc1.weight", {m + "gate_proj.weight", m + "up_proj.weight"}, Fusion::kGated,
       dense},
      {Scope::kLayer, kLayer + "mlp.linear_fc2.weight", {m + "down_proj.weight"}, Fusion::kCopy, dense},
      {Scope::kLayer, kLayer + "post_mlp_layernorm.weight", {kHfLayer + "post_feedforward_layernorm.weight"},
       Fusion::kCopy, dense},
      // With experts: the MLP as shared experts beside them.
      {Scope::kLayer, kLayer + "{pre_mlp_norm}", {kHfLayer + "pre_feedforward_layernorm_2.weight"}, Fusion::kCopy, moe},
      {Scope::kLayer, kLayer + "pre_shared_expert_layernorm.weight", {kHfLayer + "pre_feedforward_layernorm.weight"},
       Fusion::kCopy, moe},
      {Scope::kLayer, sh + "linear_fc1.weight", {m + "gate_proj.weight", m + "up_proj.weight"}, Fusion::kGated, moe},
      {Scope::kLayer, sh + "linear_fc2.weight", {m + "down_proj.weight"}, Fusion::kCopy, moe},
      {Scope::kLayer, kLayer + "mlp.post_shared_expert_layernorm.weight",
       {kHfLayer + "post_feedforward_layernorm_1.weight"}, Fusion::kCopy, moe},
      {Scope::kLayer, kLayer + "mlp.router.weight", {kHfLayer + "router.proj.weight"}, Fusion::kCopy, moe},
      {Scope::kLayer, kLayer + "mlp.router.scale", {kHfLayer + "router.scale"}, Fusion::kCopy, moe},
      {Scope::kLayer, kLayer + "mlp.router.per_expert_scale", {kHfLayer + "router.per_expert_scale"}, Fusion::kCopy,
       moe},
      {Scope::kExpert, kExpert + "linear_fc1.weight", {kHfLayer + "experts.gate_up_proj"}, Fusion::kExpertSlice, moe},
      {Scope::kExpert, kExpert + "linear_fc2.weight", {kHfLayer + "experts.down_proj"}, Fusion::kExpertSlice, moe},
      {Scope::kLayer, kLayer + "mlp.post_moe_layernorm.weight", {kHfLayer + "post_feedforward_layernorm_2.weight"},
       Fusion::kCopy, moe},
      {Scope::kLayer, kLayer + "post_ffn_layernorm.weight", {kHfLayer + "post_feedforward_layernorm.weight"},
       Fusion::kCopy, moe},
      {Scope::kLayer, kLayer + "per_layer_input_gate.weight", {kHfLayer + "per_layer_input_gate.weight"}, Fusion::kCopy,
       ple},
      {Scope::kLayer, kLayer + "per_layer_projection.weight", {kHfLayer + "per_layer_projection.weight"}, Fusion::kCopy,
       ple},
      {Scope::kLayer, kLayer + "post_per_layer_input_norm.weight", {kHfLayer + "post_per_layer_input_norm.weight"},
       Fusion::kCopy, ple},
      {Scope::kLayer, kLayer + "layer_scalar", {kHfLayer + "layer_scalar"}, Fusion::kCopy},
  };
}

// The rules with the language model's Hugging Face names moved under `prefix` (model.X -> prefix + X): a
// vision-language model's language model (Qwen3-VL's model.language_model.*; its lm_head stays where it is).
std::vector<TensorRule> with_hf_prefix(std::vector<TensorRule> rules, const std::string& prefix) {
  for (auto& rule : rules)
    for (auto& name : rule.hf)
      if (name.starts_with("model.")) name = prefix + name.substr(std::string_view("model.").size());
  return rules;
}

// The rules with the Hugging Face name `from` read and written as `to` (Gemma 3 with vision's untied head, which
// transformers saves as language_model.lm_head.weight beside language_model.model.*).
std::vector<TensorRule> with_hf_name(std::vector<TensorRule> rules, const std::string& from, const std::string& to) {
  for (auto& rule : rules)
    for (auto& name : rule.hf)
      if (name == from) name = to;
  return rules;
}

struct ArchitectureEntry {
  std::string name;
  MoeStyle moe;
  bool qkv_bias;
  bool qk_norm;
  std::vector<TensorRule> rules;
  bool gemma = false;
  std::string family;  // for people: "Llama", "Qwen2-MoE", ...
  bool olmo2 = false;
  bool gated_delta_net = false;
  bool nemotron_h = false;
};

const std::vector<ArchitectureEntry>& entries() {
  static const std::vector<ArchitectureEntry> kEntries = {
      {"LlamaForCausalLM", MoeStyle::kNone, false, false,
       join({embedding_rules(), attention_rules(), dense_mlp_rules()}), false, "Llama"},
      {"MistralForCausalLM", MoeStyle::kNone, false, false,
       join({embedding_rules(), attention_rules(), dense_mlp_rules()}), false, "Mistral"},
      {"Qwen2ForCausalLM", MoeStyle::kNone, true, false,
       join({embedding_rules(), attention_rules(), qkv_bias_rules(), dense_mlp_rules()}), false, "Qwen2"},
      {"Qwen3ForCausalLM", MoeStyle::kNone, false, true,
       join({embedding_rules(), attention_rules(), qk_norm_rules(), dense_mlp_rules()}), false, "Qwen3"},
      {"MixtralForCausalLM", MoeStyle::kMixtral, false, false,
       join({embedding_rules(), attention_rules(), mixtral_moe_rules()}), false, "Mixtral (MoE)"},
      {"Qwen3MoeForCausalLM", MoeStyle::kQwen3Moe, false, true,
       join({embedding_rules(), attention_rules(), qk_norm_rules(), qwen3_moe_rules()}), false, "Qwen3-MoE"},
      {"Phi3ForCausalLM", MoeStyle::kNone, false, false, join({embedding_rules(), phi3_rules()}), false, "Phi-3"},
      {"Qwen2MoeForCausalLM", MoeStyle::kQwen2Moe, true, false,
       join({embedding_rules(), attention_rules(), qkv_bias_rules(), qwen2_moe_rules()}), false, "Qwen2-MoE"},
      {"Gemma2ForCausalLM", MoeStyle::kNone, false, false, join({embedding_rules(), gemma_rules()}), true, "Gemma 2"},
      {"Gemma3ForCausalLM", MoeStyle::kNone, false, true, join({embedding_rules(), gemma_rules(), qk_norm_rules()}),
       true, "Gemma 3"},
      {"Olmo2ForCausalLM", MoeStyle::kNone, false, true, join({embedding_rules(), olmo2_rules()}), false, "OLMo 2",
       true},
      {"DeepseekV3ForCausalLM", MoeStyle::kDeepSeek, false, false,
       join({embedding_rules(), deepseek_rules(), expert_rules()}), false, "DeepSeek-V3"},
      {"GptOssForCausalLM", MoeStyle::kGptOss, true, false,
       join({embedding_rules(), attention_rules(), qkv_bias_rules(), gpt_oss_rules()}), false, "GPT-OSS"},
      {"Glm4MoeForCausalLM", MoeStyle::kGlm4Moe, false, false,
       join({embedding_rules(), glm4_moe_rules(), expert_rules()}), false, "GLM-4.5 (MoE)"},
      {"Qwen3NextForCausalLM", MoeStyle::kQwen2Moe, false, true,
       join({embedding_rules(), qwen3_next_attention_rules(false), qwen2_moe_rules(), qwen3_next_mtp_rules()}), false,
       "Qwen3-Next", false, true},
      {"Qwen3_5ForCausalLM", MoeStyle::kNone, false, true,
       join({embedding_rules(), qwen3_next_attention_rules(true), dense_mlp_rules(), qwen3_next_mtp_rules()}), false,
       "Qwen3.5", false, true},
      {"Qwen3_5MoeForCausalLM", MoeStyle::kQwen2Moe, false, true,
       join({embedding_rules(), qwen3_next_attention_rules(true), qwen2_moe_rules(), qwen3_next_mtp_rules()}), false,
       "Qwen3.5 (MoE)", false, true},
      {"NemotronHForCausalLM", MoeStyle::kNone, false, false, nemotron_h_rules(), false, "Nemotron-H", false, false,
       true},
      {"Gemma4ForCausalLM", MoeStyle::kNone, false, true, join({embedding_rules(), gemma4_rules()}), false, "Gemma 4"},
      {"Gemma4ForConditionalGeneration", MoeStyle::kNone, false, true,
       with_hf_prefix(join({embedding_rules(), gemma4_rules()}), "model.language_model."), false,
       "Gemma 4 (vision, audio)"},
      {"Qwen3VLForConditionalGeneration", MoeStyle::kNone, false, true,
       with_hf_prefix(join({embedding_rules(), attention_rules(), qk_norm_rules(), dense_mlp_rules()}),
                      "model.language_model."),
       false, "Qwen3-VL"},
      {"Qwen3VLMoeForConditionalGeneration", MoeStyle::kQwen3Moe, false, true,
       with_hf_prefix(join({embedding_rules(), attention_rules(), qk_norm_rules(), qwen3_moe_rules()}),
                      "model.language_model."),
       false, "Qwen3-VL (MoE)"},
      {"Gemma3ForConditionalGeneration", MoeStyle::kNone, false, true,
       with_hf_name(with_hf_prefix(join({embedding_rules(), gemma_rules(), qk_norm_rules()}), "language_model.model."),
                    "lm_head.weight", "language_model.lm_head.weight"),
       true, "Gemma 3 (vision)"},
  };
  return kEntries;
}

const ArchitectureEntry* find_entry(const std::string& name) {
  for (const auto& e : entries())
    if (e.name == name) return &e;
  return nullptr;
}

bool truthy(const json& raw, const char* key) {
  return raw.contains(key) && raw[key].is_boolean() && raw[key].get<bool>();
}

std::string rope_type(const json& raw) {
  for (const char* key : {"rope_scaling", "rope_parameters"})
    if (raw.contains(key) && raw[key].is_object()) {
      const auto& r = raw[key];
      for (const char* field : {"rope_type", "type"})
        if (r.contains(field) && r[field].is_string()) return r[field].get<std::string>();
    }
  return "default";
}

// partial_rotary_factor as transformers 5 reads it: from rope_parameters, else the top level (older config.json
// files), else `fallback` (the family's default: GLM-4.5's 0.5, 1 for the others).
double partial_rotary_factor(const json& raw, double fallback) {
  if (const auto r = raw.find("rope_parameters"); r != raw.end() && r->is_object())
    if (const auto f = r->find("partial_rotary_factor"); f != r->end() && f->is_number()) return f->get<double>();
  if (const auto f = raw.find("partial_rotary_factor"); f != raw.end() && f->is_number()) return f->get<double>();
  return fallback;
}

// Which layers have the sliding window in a model that has it in some layers only: transformers' layer_types, else
// the family's fixed pattern (Gemma 3's sliding_window_pattern, 6 by default; Gemma 4's 6 whatever its config says,
// as transformers' Gemma4TextConfig; Gemma 2 and GPT-OSS every other layer, from the first). Gemma 4's last layer is
// always a full one (transformers forces it).
std::vector<bool> hf_window_layers(const BridgeModel& m) {
  const json& raw = m.hf.raw;
  std::vector<bool> layers;
  if (const auto t = raw.find("layer_types");
      t != raw.end() && t->is_array() && static_cast<std::int64_t>(t->size()) == m.hf.num_layers) {
    for (const auto& type : *t) layers.push_back(type == "sliding_attention");
  } else {
    std::int64_t every = 2;
    if (m.gemma4) {
      every = 6;
    } else if (m.gemma && m.qk_norm) {  // Gemma 3
      const auto p = raw.find("sliding_window_pattern");
      every = p != raw.end() && p->is_number_integer() && p->get<std::int64_t>() > 0 ? p->get<std::int64_t>() : 6;
    }
    for (std::int64_t i = 1; i <= m.hf.num_layers; ++i) layers.push_back(i % every != 0);
  }
  if (m.gemma4 && !layers.empty()) layers.back() = false;
  return layers;
}

}  // namespace

const json* gemma3_rope_block(const json& raw, const char* layer_type) {
  const auto r = raw.find("rope_parameters");
  if (r == raw.end() || !r->is_object()) return nullptr;
  const auto b = r->find(layer_type);
  return b != r->end() && b->is_object() ? &*b : nullptr;
}

namespace {

std::string rope_block_type(const json* block) {
  if (!block) return "default";
  for (const char* field : {"rope_type", "type"})
    if (block->contains(field) && (*block)[field].is_string()) return (*block)[field].get<std::string>();
  return "default";
}

// The sigmoid router DeepSeek-V3 and GLM-4.5 share, as far as Megatron-Core's reproduces it: it always renormalises
// the top-k weights, and scores a group by its top (topk / group_topk) experts where transformers takes the top two.
Status check_sigmoid_router(const BridgeModel& m) {
  const json& raw = m.hf.raw;
  auto unsupported = [&](const std::string& what) {
    return Status::Error(m.architecture + ": " + what + " is not supported by the Megatron bridge");
  };
  if (m.hf.experts_per_token > 1 && raw.contains("norm_topk_prob") && raw["norm_topk_prob"].is_boolean() &&
      !raw["norm_topk_prob"].get<bool>())
    return unsupported("norm_topk_prob = false (Megatron-Core's sigmoid router renormalises the top-k weights)");
  // One expert per token: transformers' renormalisation weighs it 1, Megatron-Core's router (renormalising top-k > 1
  // only) keeps its sigmoid score.
  if (const auto norm = raw.find("norm_topk_prob");
      m.hf.experts_per_token == 1 && (norm == raw.end() || !norm->is_boolean() || norm->get<bool>()))
    return unsupported(
        "one expert per token with norm_topk_prob = true (transformers weighs it 1, Megatron-Core's "
        "sigmoid router keeps its score; norm_topk_prob = false is that model)");
  auto integer = [&](const char* key, std::int64_t fallback) {
    const auto it = raw.find(key);
    return it != raw.end() && it->is_number_integer() ? it->get<std::int64_t>() : fallback;
  };
  const std::int64_t groups = integer("n_group", 1), group_topk = integer("topk_group", groups);
  if (groups > 1 && (group_topk <= 0 || m.hf.experts_per_token != 2 * group_topk || m.hf.num_experts % groups))
    return unsupported("group-limited routing with n_group " + std::to_string(groups) + ", topk_group " +
                       std::to_string(group_topk) + " and " + std::to_string(m.hf.experts_per_token) +
                       " experts per token (Megatron-Core scores a group by its top num_experts_per_tok / topk_group "
                       "experts, transformers by its top 2: they agree only when that is 2)");
  return OkStatus();
}

Status unsupported_option(const BridgeModel& m, const std::string& what) {
  return Status::Error(m.architecture + ": " + what + " is not supported by the Megatron bridge");
}

// Plain RoPE (rotate-half, as Megatron-Core's default) over the first rotary_percent of each head: a whole, even
// number of dims.
Status check_partial_rotary(const BridgeModel& m, const std::string& rope) {
  if (rope != "default") return unsupported_option(m, "rope type '" + rope + "' (supported: default)");
  const double rotary_dim = m.rotary_percent * static_cast<double>(m.hf.head_dim);
  if (!(m.rotary_percent > 0 && m.rotary_percent <= 1) || rotary_dim != std::floor(rotary_dim) ||
      static_cast<std::int64_t>(rotary_dim) % 2 != 0)
    return unsupported_option(m, "partial_rotary_factor " + std::to_string(m.rotary_percent) + " with head_dim " +
                                     std::to_string(m.hf.head_dim) +
                                     " (the rotary part of a head must be a positive even number of dims, at most "
                                     "the head)");
  return OkStatus();
}

// GLM-4.5: partial RoPE, no bias on the output projection or the MLPs.
Status check_glm4_moe_options(const BridgeModel& m, const std::string& rope) {
  TRESTLE_RETURN_IF_ERROR(check_partial_rotary(m, rope));
  if (truthy(m.hf.raw, "mlp_bias")) return unsupported_option(m, "mlp_bias = true");
  return check_sigmoid_router(m);
}

// Qwen's MoE models: every layer MoE, a shared expert only where the family has one.
Status check_qwen_moe_layers(const BridgeModel& m) {
  const json& raw = m.hf.raw;
  auto unsupported = [&](const std::string& what) { return unsupported_option(m, what); };
  if (m.moe == MoeStyle::kQwen3Moe || m.moe == MoeStyle::kQwen2Moe) {
    if (raw.contains("decoder_sparse_step") && raw["decoder_sparse_step"] != 1)
      return unsupported("decoder_sparse_step " + raw["decoder_sparse_step"].dump() + " (every layer must be MoE)");
    if (raw.contains("mlp_only_layers") && raw["mlp_only_layers"].is_array() && !raw["mlp_only_layers"].empty())
      return unsupported("mlp_only_layers " + raw["mlp_only_layers"].dump() + " (every layer must be MoE)");
    if (m.moe == MoeStyle::kQwen3Moe && raw.contains("shared_expert_intermediate_size") &&
        raw["shared_expert_intermediate_size"].is_number() && raw["shared_expert_intermediate_size"].get<double>() > 0)
      return unsupported("a shared expert (Qwen3-MoE has none; Qwen2MoeForCausalLM does)");
  }
  return OkStatus();
}

// Qwen3-Next / Qwen3.5: plain RoPE (Qwen3.5's multimodal sections coincide with it on text) over the first
// partial_rotary_factor of each head, no attention biases; the Gated DeltaNet's SiLU gate and L2-normalised q/k are
// what Megatron-Core's GatedDeltaNet computes.
Status check_gated_delta_net_options(const BridgeModel& m, const std::string& rope) {
  TRESTLE_RETURN_IF_ERROR(check_partial_rotary(m, rope));
  // (transformers' Qwen3-Next and Qwen3.5 read attention_bias, never mlp_bias)
  if (truthy(m.hf.raw, "attention_bias")) return unsupported_option(m, "attention_bias = true");
  return OkStatus();
}

// Qwen3-Next / Qwen3.5's Gated DeltaNet sizes and layer pattern: layer_types (linear_attention or full_attention per
// layer), else every full_attention_interval-th layer full (transformers' default 4).
Status read_gated_delta_net(BridgeModel& m) {
  const json& raw = m.hf.raw;
  auto bad = [&](const std::string& what) { return Status::Error(m.architecture + ": " + what); };
  for (auto [key, field, fallback] : {std::tuple{"linear_conv_kernel_dim", &m.linear_conv_kernel_dim, 4},
                                      {"linear_key_head_dim", &m.linear_key_head_dim, 128},
                                      {"linear_value_head_dim", &m.linear_value_head_dim, 128},
                                      {"linear_num_key_heads", &m.linear_num_key_heads, 16},
                                      {"linear_num_value_heads", &m.linear_num_value_heads, 32}}) {
    const auto it = raw.find(key);
    *field = fallback;  // transformers' defaults
    if (it == raw.end() || it->is_null()) continue;
    if (!it->is_number_integer() || it->get<std::int64_t>() <= 0)
      return bad(std::string("'") + key + "' must be a positive integer, got " + it->dump());
    *field = it->get<std::int64_t>();
  }
  if (m.linear_num_value_heads % m.linear_num_key_heads != 0)
    return bad("linear_num_value_heads (" + std::to_string(m.linear_num_value_heads) +
               ") is not a multiple of linear_num_key_heads (" + std::to_string(m.linear_num_key_heads) + ")");
  m.linear_layers.clear();
  if (const auto t = raw.find("layer_types"); t != raw.end() && !t->is_null()) {
    if (!t->is_array() || static_cast<std::int64_t>(t->size()) != m.hf.num_layers)
      return bad("layer_types must name one type per layer (" + std::to_string(m.hf.num_layers) +
                 "): " + t->dump().substr(0, 120));
    for (const auto& type : *t) {
      if (type != "linear_attention" && type != "full_attention")
        return bad("layer type " + type.dump() + " is not supported by the Megatron bridge (supported: "
                   "linear_attention, full_attention)");
      m.linear_layers.push_back(type == "linear_attention");
    }
  } else {
    std::int64_t every = 4;
    if (const auto f = raw.find("full_attention_interval"); f != raw.end() && !f->is_null()) {
      if (!f->is_number_integer() || f->get<std::int64_t>() <= 0)
        return bad("'full_attention_interval' must be a positive integer, got " + f->dump());
      every = f->get<std::int64_t>();
    }
    for (std::int64_t i = 1; i <= m.hf.num_layers; ++i) m.linear_layers.push_back(i % every != 0);
  }
  m.rotary_percent = partial_rotary_factor(raw, 0.25);
  return OkStatus();
}

// Nemotron-H's layer pattern (transformers 5's layers_block_type: linear_attention (Mamba-2), full_attention, mlp or
// moe per layer; earlier configs' hybrid_override_pattern: M, *, - or E), its Mamba-2 sizes (transformers' defaults
// where absent) and, with MoE layers, their experts' sizes.
Status read_nemotron_h(BridgeModel& m) {
  const json& raw = m.hf.raw;
  auto bad = [&](const std::string& what) { return Status::Error(m.architecture + ": " + what); };
  std::string pattern;
  if (const auto t = raw.find("layers_block_type"); t != raw.end() && !t->is_null()) {
    if (!t->is_array()) return bad("layers_block_type must be a list of layer types: " + t->dump().substr(0, 120));
    for (const auto& type : *t) {
      const char kind = type == "linear_attention" || type == "mamba"       ? 'M'
                        : type == "full_attention" || type == "attention" ? '*'
                        : type == "mlp"                                    ? '-'
                        : type == "moe"                                    ? 'E'
                                                                           : '?';
      if (kind == '?')
        return bad("layer type " + type.dump() + " is not a Nemotron-H layer (linear_attention, full_attention, mlp, moe)");
      pattern += kind;
    }
  } else if (const auto p = raw.find("hybrid_override_pattern"); p != raw.end() && p->is_string()) {
    pattern = p->get<std::string>();
  } else {
    return bad("the config has neither layers_block_type nor hybrid_override_pattern (which layer is which)");
  }
  if (pattern.empty() || static_cast<std::int64_t>(pattern.size()) > 100'000)
    return bad("the layer pattern must name between 1 and 100000 layers");
  if (m.hf.num_layers > 0 && m.hf.num_layers != static_cast<std::int64_t>(pattern.size()))
    return bad("num_hidden_layers " + std::to_string(m.hf.num_layers) + " but the layer pattern names " +
               std::to_string(pattern.size()) + " layers");
  m.hf.num_layers = static_cast<std::int64_t>(pattern.size());
  for (const char kind : pattern)
    if (kind != 'M' && kind != '*' && kind != '-' && kind != 'E')
      return bad(std::string("layer pattern character '") + kind + "' (M: Mamba, *: attention, -: MLP, E: MoE)");
  m.hybrid_layers = pattern;
  if (pattern.find('E') != std::string::npos) {
    // Mixture-of-experts layers: n_routed_experts of moe_intermediate_size, the shared experts' MLP of
    // moe_shared_expert_intermediate_size, the MLP layers of intermediate_size.
    m.moe = MoeStyle::kNemotronH;
    m.ffn_hidden_size = m.hf.moe_intermediate_size;
    m.dense_ffn_hidden_size = m.hf.intermediate_size;
    for (auto [key, field] : {std::pair{"moe_shared_expert_intermediate_size", &m.shared_expert_ffn_hidden_size},
                              {"moe_latent_size", &m.moe_latent_size}}) {
      const auto it = raw.find(key);
      if (it == raw.end() || it->is_null()) continue;
      if (!it->is_number_integer() || it->get<std::int64_t>() < 0)
        return bad(std::string("'") + key + "' must be a non-negative integer, got " + it->dump());
      *field = it->get<std::int64_t>();
    }
    if (pattern.find('-') != std::string::npos && m.dense_ffn_hidden_size <= 0)
      return bad("intermediate_size (the MLP layers') must be positive");
  }
  // transformers' NemotronH never ties lm_head to the embedding (its _tied_weights_keys is empty), whatever
  // tie_word_embeddings says: the checkpoint holds both, and Megatron gets its own output layer.
  m.hf.tie_word_embeddings = false;
  for (auto [key, field, fallback] : {std::tuple{"mamba_num_heads", &m.mamba_num_heads, 128},
                                      {"mamba_head_dim", &m.mamba_head_dim, 64},
                                      {"ssm_state_size", &m.mamba_state_dim, 128},
                                      {"n_groups", &m.mamba_num_groups, 8},
                                      {"conv_kernel", &m.mamba_conv_kernel, 4}}) {
    const auto it = raw.find(key);
    *field = fallback;
    if (it == raw.end() || it->is_null()) continue;
    if (!it->is_number_integer() || it->get<std::int64_t>() <= 0)
      return bad(std::string("'") + key + "' must be a positive integer, got " + it->dump());
    *field = it->get<std::int64_t>();
  }
  if (m.mamba_num_heads % m.mamba_num_groups != 0)
    return bad("mamba_num_heads (" + std::to_string(m.mamba_num_heads) + ") is not a multiple of n_groups (" +
               std::to_string(m.mamba_num_groups) + ")");
  return OkStatus();
}

// Nemotron-H as Megatron-Core's MambaModel computes it: Mamba-2 with SiLU, a conv1d with bias and kernel 4 (its
// MambaMixer's d_conv), no in / out projection biases, its gated norm's epsilon 1e-5 (fixed in Megatron-Core); the
// MLPs squared ReLU without bias; no multi-token prediction (MambaModel has none).
Status check_nemotron_h_options(const BridgeModel& m) {
  const json& raw = m.hf.raw;
  auto text = [&](const char* key, const char* fallback) {
    const auto it = raw.find(key);
    return it != raw.end() && it->is_string() ? it->get<std::string>() : std::string(fallback);
  };
  if (text("mamba_hidden_act", "silu") != "silu")
    return unsupported_option(m, "mamba_hidden_act '" + text("mamba_hidden_act", "") + "' (supported: silu)");
  if (text("mlp_hidden_act", "relu2") != "relu2")
    return unsupported_option(m, "mlp_hidden_act '" + text("mlp_hidden_act", "") + "' (supported: relu2)");
  if (raw.contains("use_conv_bias") && raw["use_conv_bias"].is_boolean() && !raw["use_conv_bias"].get<bool>())
    return unsupported_option(m, "use_conv_bias = false (Megatron-Core's Mamba conv1d has a bias)");
  if (truthy(raw, "use_bias")) return unsupported_option(m, "use_bias = true (Mamba in_proj / out_proj biases)");
  if (truthy(raw, "mlp_bias")) return unsupported_option(m, "mlp_bias = true");
  if (m.mamba_conv_kernel != 4)
    return unsupported_option(m, "conv_kernel " + std::to_string(m.mamba_conv_kernel) +
                                     " (Megatron-Core's MambaMixer convolves over 4 positions)");
  if (m.hf.norm_eps && std::abs(*m.hf.norm_eps - 1e-5) > 1e-12)
    return unsupported_option(m, "layer_norm_epsilon " + json(*m.hf.norm_eps).dump() +
                                     " (Megatron-Core's Mamba gated norm uses 1e-5)");
  if (const auto n = raw.find("num_nextn_predict_layers"); n != raw.end() && n->is_number_integer() &&
                                                            n->get<std::int64_t>() > 0)
    return unsupported_option(m, "num_nextn_predict_layers " + n->dump() +
                                     " (multi-token prediction: Megatron-Core 0.16's MambaModel has none)");
  return m.is_moe() ? check_sigmoid_router(m) : OkStatus();
}

// Gemma 4's text model: its per-layer attention sizes (transformers 5.23's per_layer_config {layer: {head_dim,
// num_key_value_heads}}, else the config's global_head_dim (512) and, with attention_k_eq_v, num_global_key_value_heads
// in the full-attention layers), KV sharing, per-layer inputs and MoE block; what it computes that Trestle's
// checkpoint does not hold (RoPE, windows, soft-capping) travels in config.json.
Status read_gemma4(BridgeModel& m) {
  const json& raw = m.hf.raw;
  auto bad = [&](const std::string& what) { return Status::Error(m.architecture + ": " + what); };
  auto integer = [&](const char* key, std::int64_t fallback, std::int64_t low) -> Result<std::int64_t> {
    const auto it = raw.find(key);
    if (it == raw.end() || it->is_null()) return fallback;
    if (!it->is_number_integer() || it->get<std::int64_t>() < low || it->get<std::int64_t>() > (std::int64_t{1} << 40))
      return bad(std::string("'") + key + "' must be an integer of at least " + std::to_string(low) + ", got " +
                 it->dump().substr(0, 80));
    return it->get<std::int64_t>();
  };
  m.gemma4 = true;
  const std::int64_t layers = m.hf.num_layers;
  if (layers <= 0 || layers > 100'000) return bad("num_hidden_layers must be between 1 and 100000");
  const std::vector<bool> windowed = hf_window_layers(m);
  m.k_eq_v = truthy(raw, "attention_k_eq_v");
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t global_head_dim, integer("global_head_dim", 512, 1));
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t global_kv_heads,
                           integer("num_global_key_value_heads", m.hf.num_kv_heads, 1));
  m.layer_head_dim.assign(static_cast<std::size_t>(layers), m.hf.head_dim);
  m.layer_kv_heads.assign(static_cast<std::size_t>(layers), m.hf.num_kv_heads);
  const auto overrides = raw.find("per_layer_config");
  const bool listed = overrides != raw.end() && !overrides->is_null();
  if (listed && !overrides->is_object())
    return bad("per_layer_config must map layer indexes to {head_dim, num_key_value_heads}: " +
               overrides->dump().substr(0, 120));
  for (std::int64_t i = 0; i < layers; ++i) {
    const auto u = static_cast<std::size_t>(i);
    if (!listed) {  // transformers' defaults for the full-attention layers
      if (!windowed[u]) {
        m.layer_head_dim[u] = global_head_dim;
        if (m.k_eq_v) m.layer_kv_heads[u] = global_kv_heads;
      }
      continue;
    }
    const auto entry = overrides->find(std::to_string(i));
    if (entry == overrides->end()) continue;
    if (!entry->is_object()) return bad("per_layer_config[" + std::to_string(i) + "] is not an object");
    for (auto [key, field] : {std::pair{"head_dim", &m.layer_head_dim[u]}, {"num_key_value_heads", &m.layer_kv_heads[u]}}) {
      const auto v = entry->find(key);
      if (v == entry->end()) continue;
      if (!v->is_number_integer() || v->get<std::int64_t>() <= 0 || v->get<std::int64_t>() > (std::int64_t{1} << 20))
        return bad("per_layer_config[" + std::to_string(i) + "]." + key + " must be a positive integer, got " +
                   v->dump().substr(0, 80));
      *field = v->get<std::int64_t>();
    }
    for (const auto& [key, value] : entry->items())
      if (key != "head_dim" && key != "num_key_value_heads")
        return bad("per_layer_config[" + std::to_string(i) + "]." + key +
                   " is not supported by the Megatron bridge (supported: head_dim, num_key_value_heads)");
  }
  for (std::int64_t i = 0; i < layers; ++i) {
    const std::int64_t groups = m.layer_kv_heads[static_cast<std::size_t>(i)];
    if (m.hf.num_attention_heads % groups != 0)
      return bad("layer " + std::to_string(i) + "'s " + std::to_string(groups) +
                 " KV heads do not divide the attention heads (" + std::to_string(m.hf.num_attention_heads) + ")");
  }
  TRESTLE_ASSIGN_OR_RETURN(m.kv_shared_layers, integer("num_kv_shared_layers", 0, 0));
  if (m.kv_shared_layers >= layers)
    return bad("num_kv_shared_layers " + std::to_string(m.kv_shared_layers) + " leaves no layer making keys and values");
  m.double_wide_mlp = truthy(raw, "use_double_wide_mlp");
  TRESTLE_ASSIGN_OR_RETURN(m.per_layer_input_size, integer("hidden_size_per_layer_input", 256, 0));
  TRESTLE_ASSIGN_OR_RETURN(m.per_layer_vocab_size, integer("vocab_size_per_layer_input", 262'144, 1));
  if (m.per_layer_input_size == 0) m.per_layer_vocab_size = 0;
  if (m.per_layer_input_size > (std::int64_t{1} << 20))
    return bad("hidden_size_per_layer_input " + std::to_string(m.per_layer_input_size) + " (at most 2^20)");
  if (truthy(raw, "enable_moe_block")) {
    m.moe = MoeStyle::kGemma4;
    TRESTLE_ASSIGN_OR_RETURN(m.hf.experts_per_token, integer("top_k_experts", 0, 1));
    m.ffn_hidden_size = m.hf.moe_intermediate_size;
    m.shared_expert_ffn_hidden_size = m.hf.intermediate_size;
    if (m.shared_expert_ffn_hidden_size <= 0) return bad("intermediate_size (the MLP beside the experts) must be positive");
  }
  // What the checkpoint's tensors cannot express: the activation and bidirectional attention change which tensors a
  // layer has nowhere, but a model converted with them would be described wrongly.
  if (const auto a = raw.find("hidden_activation"); a != raw.end() && a->is_string() && *a != "gelu_pytorch_tanh")
    return unsupported_option(m, "hidden_activation '" + a->get<std::string>() + "' (supported: gelu_pytorch_tanh)");
  if (const auto b = raw.find("use_bidirectional_attention"); b != raw.end() && !b->is_null())
    return unsupported_option(m, "use_bidirectional_attention " + b->dump());
  if (truthy(raw, "attention_bias")) return unsupported_option(m, "attention_bias = true");
  // RoPE per kind of layer: the full-attention layers' plain or proportional (over partial_rotary_factor of each head),
  // unscaled; the windowed layers' plain.
  for (const char* kind : {"full_attention", "sliding_attention"}) {
    const json* block = gemma3_rope_block(raw, kind);
    const std::string type = rope_block_type(block);
    const bool full = std::string_view(kind) == "full_attention";
    if (type != "default" && !(full && type == "proportional"))
      return unsupported_option(m, std::string(kind) + " rope type '" + type + "' (supported: default" +
                                       (full ? ", proportional)" : ")"));
    if (block && block->contains("factor") && !((*block)["factor"].is_number() && (*block)["factor"] == 1.0))
      return unsupported_option(m, std::string(kind) + " rope factor " + (*block)["factor"].dump() + " (supported: 1)");
    const json p = block ? block->value("partial_rotary_factor", json(1.0)) : json(1.0);
    if (!(p.is_number() && p.get<double>() > 0 && p.get<double>() <= 1 && (full || p.get<double>() == 1.0)))
      return unsupported_option(m, std::string(kind) + " partial_rotary_factor " + p.dump() +
                                       (full ? " (must be in (0, 1])" : " (the windowed layers rotate whole heads)"));
  }
  if (const auto t = raw.find("layer_types"); t != raw.end() && t->is_array())
    for (const auto& type : *t)
      if (type != "sliding_attention" && type != "full_attention")
        return unsupported_option(m, "layer type " + type.dump() + " (supported: sliding_attention, full_attention)");
  return OkStatus();
}

// Options that change what the model computes and that this bridge does not carry over.
Status check_options(const BridgeModel& m) {
  if (m.nemotron_h()) return check_nemotron_h_options(m);
  if (m.gemma4) return OkStatus();  // read_gemma4 checks its options
  const json& raw = m.hf.raw;
  const std::string& arch = m.architecture;
  auto unsupported = [&](const std::string& what) {
    return Status::Error(arch + ": " + what + " is not supported by the Megatron bridge");
  };
  // Gemma's MLP is GeGLU with the tanh GELU (hidden_activation); every other family's is SwiGLU.
  const std::string expected_act = m.gemma ? "gelu_pytorch_tanh" : "silu";
  for (const char* key : {"hidden_act", "hidden_activation"})
    if (raw.contains(key) && raw[key].is_string() && raw[key].get<std::string>() != expected_act &&
        !(m.gemma && std::string(key) == "hidden_act" && raw.contains("hidden_activation")))
      return unsupported(std::string(key) + " '" + raw[key].get<std::string>() + "' (supported: " + expected_act + ")");
  if (m.gemma && raw.contains("use_bidirectional_attention") && truthy(raw, "use_bidirectional_attention"))
    return unsupported("use_bidirectional_attention = true");
  if (const auto t = raw.find("layer_types"); (m.gemma || m.gpt_oss()) && t != raw.end() && !t->is_null()) {
    if (!t->is_array() || static_cast<std::int64_t>(t->size()) != m.hf.num_layers)
      return unsupported("layer_types that do not name one type per layer (" + t->dump().substr(0, 120) + ")");
    for (const auto& type : *t)
      if (type != "sliding_attention" && type != "full_attention")
        return unsupported("layer type " + type.dump() + " (supported: sliding_attention, full_attention)");
  }
  if (m.gemma) {
    // Gemma 3 keeps RoPE per kind of layer: the full-attention layers' may be scaled linearly, the windowed ones' not.
    const std::string full = rope_block_type(gemma3_rope_block(raw, "full_attention"));
    const std::string local = rope_block_type(gemma3_rope_block(raw, "sliding_attention"));
    if (full != "default" && full != "linear")
      return unsupported("full-attention rope type '" + full + "' (supported: default, linear)");
    if (local != "default") return unsupported("sliding-attention rope type '" + local + "' (supported: default)");
  }
  const std::string rope = rope_type(raw);
  if (m.glm4_moe()) return check_glm4_moe_options(m, rope);
  if (m.gated_delta_net) TRESTLE_RETURN_IF_ERROR(check_gated_delta_net_options(m, rope));
  if (m.deepseek()) {
    // Megatron-Core's multi-latent attention applies RoPE to interleaved pairs, as transformers does with
    // rope_interleave; its sigmoid router always renormalises the top-k weights, and scores a group by its top
    // (topk / group_topk) experts where transformers takes the top two.
    if (rope != "default" && rope != "yarn") return unsupported("rope type '" + rope + "' (supported: default, yarn)");
    if (raw.contains("rope_interleave") && raw["rope_interleave"].is_boolean() && !raw["rope_interleave"].get<bool>())
      return unsupported("rope_interleave = false");
    if (truthy(raw, "attention_bias")) return unsupported("attention_bias = true");
    return check_sigmoid_router(m);
  }
  if (m.gpt_oss()) {
    // Megatron-Core's GPT-OSS: quick-GELU gated units (alpha 1.702) clamped at swiglu_limit, windows on every other
    // layer from the first (window_attn_skip_freq 2), YaRN or plain RoPE.
    if (rope != "default" && rope != "yarn") return unsupported("rope type '" + rope + "' (supported: default, yarn)");
    if (raw.contains("attention_bias") && raw["attention_bias"].is_boolean() && !raw["attention_bias"].get<bool>())
      return unsupported("attention_bias = false (Megatron's GPT-OSS has biased QKV and output projections)");
    if (raw.contains("swiglu_alpha") && raw["swiglu_alpha"].is_number() &&
        std::abs(raw["swiglu_alpha"].get<double>() - 1.702) > 1e-9)
      return unsupported("swiglu_alpha " + raw["swiglu_alpha"].dump() + " (Megatron's quick GELU uses 1.702)");
    if (const auto t = raw.find("layer_types"); t != raw.end() && t->is_array())
      for (std::size_t i = 0; i < t->size(); ++i) {
        const std::string expected = i % 2 == 0 ? "sliding_attention" : "full_attention";
        if ((*t)[i] != expected)
          return unsupported(
              "layer_types " + t->dump().substr(0, 120) +
              " (Megatron's window_attn_skip_freq 2 makes every even layer sliding, every odd one full)");
      }
    return OkStatus();
  }
  if (rope != "default" && rope != "llama3" && rope != "linear")
    return unsupported("rope type '" + rope + "' (supported: default, llama3, linear)");
  // The scaling's numbers, refused here naming the config rather than when a converter writes the description:
  // Llama 3's smoothing divides by high_freq_factor - low_freq_factor (defaults 4 and 1).
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (rope == "default") break;
    const auto block = raw.find(key);
    if (block == raw.end() || !block->is_object() ||
        !((block->contains("rope_type") && (*block)["rope_type"].is_string()) ||
          (block->contains("type") && (*block)["type"].is_string())))
      continue;
    auto number = [&](const char* field, double fallback) {
      const auto v = block->find(field);
      return v != block->end() && v->is_number() ? v->get<double>() : fallback;
    };
    if (!(number("factor", 1.0) > 0) ||
        (rope == "llama3" && !(number("high_freq_factor", 4.0) > number("low_freq_factor", 1.0))))
      return Status::Error(m.hf.source + ": " + key + " " + block->dump().substr(0, 200) +
                           ": factor must be positive and high_freq_factor above low_freq_factor");
    break;
  }
  if (m.gated_delta_net) return check_qwen_moe_layers(m);
  // The biases transformers builds where a config asks: attention_bias in these families' attention (Mistral's,
  // Mixtral's and Phi-3's have none whatever the config says), mlp_bias in Llama's MLP only.
  if (arch == "LlamaForCausalLM" || arch == "Qwen3ForCausalLM" || arch == "Qwen3MoeForCausalLM" || m.gemma || m.olmo2 ||
      m.vision_language()) {
    if (truthy(raw, "attention_bias")) return unsupported("attention_bias = true");
  }
  if (arch == "LlamaForCausalLM" && truthy(raw, "mlp_bias")) return unsupported("mlp_bias = true");
  // Rotary embedding over part of each head (Phi-3.5-MoE / Phi-4-mini's partial_rotary_factor < 1).
  if (const double factor = partial_rotary_factor(raw, 1.0); factor != 1.0)
    return unsupported("partial_rotary_factor " + json(factor).dump() + " (rotary over whole heads only)");
  // Mistral's and Mixtral's sliding_window applies to every layer, so it carries over (Megatron's window_size); so
  // does the Qwen families' use_sliding_window (and a Mistral config's layer_types) where it puts the window in every
  // layer or none.
  // In some layers only, Megatron's uniform window cannot express it.
  if (const auto windowed = hf_use_sliding_window_layers(raw);
      hf_sliding_window(raw) && std::find(windowed.begin(), windowed.end(), false) != windowed.end()) {
    std::int64_t count = 0;
    for (const bool w : windowed) count += w;
    return unsupported("the sliding window in " + std::to_string(count) + " of " + std::to_string(windowed.size()) +
                       " layers (use_sliding_window with layer_types / max_window_layers, or a Mistral config's "
                       "layer_types, which transformers loads as Ministral): sliding-window attention in some layers "
                       "only");
  }
  return check_qwen_moe_layers(m);
}

}  // namespace

namespace {

// A size of vision_config: `fallback` (transformers' default) when absent, else a positive integer up to 2^20.
Status vision_size(const BridgeModel& m, const char* key, std::int64_t fallback, std::int64_t& out) {
  const json& v = m.hf.outer["vision_config"];
  const auto it = v.find(key);
  out = fallback;
  if (it == v.end() || it->is_null()) return OkStatus();
  if (!it->is_number_integer() || it->get<std::int64_t>() <= 0 || it->get<std::int64_t>() > (std::int64_t{1} << 20))
    return Status::Error(m.architecture + ": vision_config." + key + " must be a positive integer (at most 2^20), got " +
                         it->dump().substr(0, 80));
  out = it->get<std::int64_t>();
  return OkStatus();
}

// Adds a carried linear's (or norm's) weight and bias: Megatron name `megatron` + ".weight", Hugging Face `hf` + ...
void add_vision_linear(BridgeModel& m, const std::string& megatron, const std::string& hf, Shape weight) {
  const std::int64_t out = weight.front();
  m.vision_tensors.push_back({megatron + ".weight", hf + ".weight", std::move(weight)});
  m.vision_tensors.push_back({megatron + ".bias", hf + ".bias", {out}});
}

// Qwen3-VL's vision tower (transformers' Qwen3VLVisionModel) from vision_config, transformers' defaults for what it
// leaves out: the Conv3d patch embedding, the learned position embedding, `depth` blocks of LayerNorms, fused qkv and
// a GELU MLP (all with biases), the merger (LayerNorm over each patch, then two linears over spatial_merge_size² patches)
// and one deepstack merger per deepstack_visual_indexes entry (LayerNorm over the merged patches).
Status read_qwen3_vl_vision(BridgeModel& m) {
  const json& v = m.hf.outer["vision_config"];
  const std::string where = m.architecture + ": vision_config.";
  auto size = [&](const char* key, std::int64_t fallback, std::int64_t& out) {
    return vision_size(m, key, fallback, out);
  };
  std::int64_t depth, hidden, inter, channels, patch, temporal, merge, out_hidden, positions, heads;
  TRESTLE_RETURN_IF_ERROR(size("depth", 27, depth));
  TRESTLE_RETURN_IF_ERROR(size("num_heads", 16, heads));
  TRESTLE_RETURN_IF_ERROR(size("hidden_size", 1152, hidden));
  TRESTLE_RETURN_IF_ERROR(size("intermediate_size", 4304, inter));
  TRESTLE_RETURN_IF_ERROR(size("in_channels", 3, channels));
  TRESTLE_RETURN_IF_ERROR(size("patch_size", 16, patch));
  TRESTLE_RETURN_IF_ERROR(size("temporal_patch_size", 2, temporal));
  TRESTLE_RETURN_IF_ERROR(size("spatial_merge_size", 2, merge));
  TRESTLE_RETURN_IF_ERROR(size("out_hidden_size", 3584, out_hidden));
  TRESTLE_RETURN_IF_ERROR(size("num_position_embeddings", 2304, positions));
  if (depth > 10'000) return Status::Error(where + "depth " + std::to_string(depth) + " (at most 10000)");
  std::vector<std::int64_t> deepstack{8, 16, 24};
  if (const auto d = v.find("deepstack_visual_indexes"); d != v.end() && !d->is_null()) {
    if (!d->is_array() || d->size() > static_cast<std::size_t>(depth))
      return Status::Error(where + "deepstack_visual_indexes must be a list of block indexes, got " +
                           d->dump().substr(0, 80));
    deepstack.clear();
    for (const json& i : *d) {
      if (!i.is_number_integer() || i.get<std::int64_t>() < 0 || i.get<std::int64_t>() >= depth)
        return Status::Error(where + "deepstack_visual_indexes holds " + i.dump() + ", not a block index below depth " +
                             std::to_string(depth));
      deepstack.push_back(i.get<std::int64_t>());
    }
  }
  if (hidden % heads != 0)
    return Status::Error(where + "hidden_size " + std::to_string(hidden) + " is not a multiple of num_heads " +
                         std::to_string(heads));
  // Megatron-Bridge's names (its Qwen3VLBridge): `megatron` under vision_model., `hf` under model.visual.
  auto add = [&](const std::string& megatron, const std::string& hf, Shape shape) {
    m.vision_tensors.push_back({"vision_model." + megatron, "model.visual." + hf, std::move(shape)});
  };
  auto linear = [&](const std::string& megatron, const std::string& hf, std::int64_t out, std::int64_t in) {
    add_vision_linear(m, "vision_model." + megatron, "model.visual." + hf, {out, in});
  };
  auto norm = [&](const std::string& megatron, const std::string& hf, std::int64_t width) {
    for (const char* part : {"weight", "bias"})
      add(megatron + (megatron.ends_with("_") ? "" : ".") + part, hf + "." + part, {width});
  };
  add("patch_embed.proj.weight", "patch_embed.proj.weight", {hidden, channels, temporal, patch, patch});
  add("patch_embed.proj.bias", "patch_embed.proj.bias", {hidden});
  add("pos_embed.weight", "pos_embed.weight", {positions, hidden});
  const QkvLayout qkv{heads, heads, hidden / heads};  // no GQA in the tower
  for (std::int64_t b = 0; b < depth; ++b) {
    const std::string layer = "decoder.layers." + std::to_string(b) + ".", block = "blocks." + std::to_string(b) + ".";
    norm(layer + "self_attention.linear_qkv.layer_norm_", block + "norm1", hidden);
    norm(layer + "mlp.linear_fc1.layer_norm_", block + "norm2", hidden);
    for (const char* part : {"weight", "bias"})
      m.vision_tensors.push_back({"vision_model." + layer + "self_attention.linear_qkv." + part,
                                  "model.visual." + block + "attn.qkv." + part,
                                  part == std::string_view("weight") ? Shape{3 * hidden, hidden} : Shape{3 * hidden},
                                  Fusion::kFusedQkv, qkv});
    linear(layer + "self_attention.linear_proj", block + "attn.proj", hidden, hidden);
    linear(layer + "mlp.linear_fc1", block + "mlp.linear_fc1", inter, hidden);
    linear(layer + "mlp.linear_fc2", block + "mlp.linear_fc2", hidden, inter);
  }
  const std::int64_t merged = hidden * merge * merge;
  norm("merger.patch_norm", "merger.norm", hidden);
  linear("merger.linear_fc1", "merger.linear_fc1", merged, merged);
  linear("merger.linear_fc2", "merger.linear_fc2", out_hidden, merged);
  for (std::size_t k = 0; k < deepstack.size(); ++k) {
    const std::string merger = "deepstack_merger_list." + std::to_string(k) + ".";
    norm("decoder." + merger + "patch_norm", merger + "norm", merged);
    linear("decoder." + merger + "linear_fc1", merger + "linear_fc1", merged, merged);
    linear("decoder." + merger + "linear_fc2", merger + "linear_fc2", out_hidden, merged);
  }
  if (out_hidden != m.hf.hidden_size)
    return Status::Error(where + "out_hidden_size " + std::to_string(out_hidden) +
                         " is not the language model's hidden_size " + std::to_string(m.hf.hidden_size));
  return OkStatus();
}

// Gemma 3's SigLIP vision tower (transformers' SiglipVisionModel, saved as vision_tower.X beside
// language_model.model.* and multi_modal_projector.*: the names Megatron-Bridge's mapping reads) from vision_config, transformers' defaults for what it leaves out: the patch embedding, the position
// embedding of (image_size / patch_size)² patches, `num_hidden_layers` encoder layers (LayerNorms, q/k/v/out
// projections and a GELU MLP, all with biases), the post LayerNorm and, with vision_use_head, the attention-pooling
// head; then the multi-modal projector: its (1 + w) RMSNorm (Megatron-Bridge's mm_soft_embed_norm) and its projection,
// which Hugging Face stores [vision hidden, text hidden] and Megatron as a linear's weight [text hidden, vision hidden].
Status read_gemma3_vision(BridgeModel& m) {
  const json& v = m.hf.outer["vision_config"];
  std::int64_t layers, hidden, inter, channels, image, patch;
  TRESTLE_RETURN_IF_ERROR(vision_size(m, "num_hidden_layers", 12, layers));
  TRESTLE_RETURN_IF_ERROR(vision_size(m, "hidden_size", 768, hidden));
  TRESTLE_RETURN_IF_ERROR(vision_size(m, "intermediate_size", 3072, inter));
  TRESTLE_RETURN_IF_ERROR(vision_size(m, "num_channels", 3, channels));
  TRESTLE_RETURN_IF_ERROR(vision_size(m, "image_size", 224, image));
  TRESTLE_RETURN_IF_ERROR(vision_size(m, "patch_size", 16, patch));
  const std::string where = m.architecture + ": vision_config.";
  if (layers > 10'000) return Status::Error(where + "num_hidden_layers " + std::to_string(layers) + " (at most 10000)");
  if (image % patch != 0)
    return Status::Error(where + "image_size " + std::to_string(image) + " is not a multiple of patch_size " +
                         std::to_string(patch));
  const bool head = !v.contains("vision_use_head") || !v["vision_use_head"].is_boolean() ||
                    v["vision_use_head"].get<bool>();
  const std::string t = "vision_tower.", h = "vision_tower.";
  auto add = [&](const std::string& name, Shape shape) { m.vision_tensors.push_back({t + name, h + name, shape}); };
  auto linear = [&](const std::string& name, Shape weight) { add_vision_linear(m, t + name, h + name, weight); };
  linear("embeddings.patch_embedding", {hidden, channels, patch, patch});
  add("embeddings.position_embedding.weight", {(image / patch) * (image / patch), hidden});
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string layer = "encoder.layers." + std::to_string(l) + ".";
    linear(layer + "layer_norm1", {hidden});
    for (const char* proj : {"k_proj", "v_proj", "q_proj", "out_proj"}) linear(layer + "self_attn." + proj, {hidden, hidden});
    linear(layer + "layer_norm2", {hidden});
    linear(layer + "mlp.fc1", {inter, hidden});
    linear(layer + "mlp.fc2", {hidden, inter});
  }
  linear("post_layernorm", {hidden});
  if (head) {
    add("head.probe", {1, 1, hidden});
    add("head.attention.in_proj_weight", {3 * hidden, hidden});
    add("head.attention.in_proj_bias", {3 * hidden});
    linear("head.attention.out_proj", {hidden, hidden});
    linear("head.layernorm", {hidden});
    linear("head.mlp.fc1", {inter, hidden});
    linear("head.mlp.fc2", {hidden, inter});
  }
  m.vision_tensors.push_back(
      {"multi_modal_projector.mm_soft_embed_norm.weight", "multi_modal_projector.mm_soft_emb_norm.weight", {hidden}});
  m.vision_tensors.push_back({"multi_modal_projector.proj.weight", "multi_modal_projector.mm_input_projection_weight",
                              {m.hf.hidden_size, hidden}, Fusion::kTransposed});
  return OkStatus();
}

}  // namespace

void name_vision_tower(BridgeModel& m, bool nested) {
  if (m.architecture != "Gemma3ForConditionalGeneration" || m.vision_tower_nested == nested) return;
  const std::string flat = "vision_tower.", deep = "vision_tower.vision_model.";
  for (auto& v : m.vision_tensors) {
    if (nested && v.hf.starts_with(flat)) v.hf = deep + v.hf.substr(flat.size());
    else if (!nested && v.hf.starts_with(deep)) v.hf = flat + v.hf.substr(deep.size());
  }
  m.vision_tower_nested = nested;
}

namespace {

// Gemma 4's multimodal towers and their embedders, carried as the checkpoint holds them (model.X <-> X).
constexpr std::string_view kGemma4Towers[] = {"vision_tower.", "audio_tower.", "embed_vision.", "embed_audio."};

bool is_gemma4_tower(std::string_view megatron_name) {
  return std::any_of(std::begin(kGemma4Towers), std::end(kGemma4Towers),
                     [&](std::string_view p) { return megatron_name.starts_with(p); });
}

}  // namespace

bool carries_towers_as_found(const BridgeModel& m) { return m.architecture == "Gemma4ForConditionalGeneration"; }

void carry_towers_found(BridgeModel& m, const std::map<std::string, Shape>& hf_tensors) {
  if (!carries_towers_as_found(m)) return;
  m.vision_tensors.clear();
  for (const auto& [name, shape] : hf_tensors)
    if (name.starts_with("model.") && is_gemma4_tower(std::string_view(name).substr(6)))
      m.vision_tensors.push_back({name.substr(6), name, shape});
}

Status carry_towers_described(BridgeModel& m, const std::vector<GptModelSpec::CarriedTensor>& described) {
  if (!carries_towers_as_found(m)) return OkStatus();
  m.vision_tensors.clear();
  for (const auto& c : described) {
    if (!is_gemma4_tower(c.name))
      return Status::Error(m.architecture + ": carried tensor '" + c.name.substr(0, 200) +
                           "' is not one of its towers' (vision_tower., audio_tower., embed_vision., embed_audio.)");
    m.vision_tensors.push_back({c.name, "model." + c.name, c.shape});
  }
  return OkStatus();
}

bool has_nested_vision_tower(const std::vector<std::string>& hf_names) {
  return std::any_of(hf_names.begin(), hf_names.end(),
                     [](const std::string& n) { return n.starts_with("vision_tower.vision_model."); });
}

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> kNames = [] {
    std::vector<std::string> names;
    for (const auto& e : entries()) names.push_back(e.name);
    return names;
  }();
  return kNames;
}

namespace {

Result<BridgeModel> bridge_model_of(const HfModelConfig& config) {
  const ArchitectureEntry* entry = find_entry(config.architecture);
  if (!entry) {
    std::string list;
    for (const auto& n : supported_architectures()) list += (list.empty() ? "" : ", ") + n;
    const std::string what = config.architecture.empty()
                                 ? "config.json names no architecture (\"architectures\": [...]); it"
                                 : "architecture '" + config.architecture + "'";
    return Status::Error(what + " is not supported by the Megatron bridge (supported: " + list + ")");
  }
  BridgeModel m;
  m.hf = config;
  m.architecture = entry->name;
  m.moe = entry->moe;
  m.qkv_bias = entry->qkv_bias;
  m.qk_norm = entry->qk_norm;
  m.gemma = entry->gemma;
  m.olmo2 = entry->olmo2;
  m.gated_delta_net = entry->gated_delta_net;
  m.family = entry->family;
  if (m.gated_delta_net) TRESTLE_RETURN_IF_ERROR(read_gated_delta_net(m));
  m.ffn_hidden_size = m.moe == MoeStyle::kQwen3Moe || m.moe == MoeStyle::kQwen2Moe ? config.moe_intermediate_size
                                                                                   : config.intermediate_size;
  if (entry->nemotron_h) TRESTLE_RETURN_IF_ERROR(read_nemotron_h(m));
  if (m.architecture == "Gemma4ForCausalLM" || m.architecture == "Gemma4ForConditionalGeneration")
    TRESTLE_RETURN_IF_ERROR(read_gemma4(m));
  if (m.architecture == "Qwen3VLForConditionalGeneration" || m.architecture == "Qwen3VLMoeForConditionalGeneration")
    TRESTLE_RETURN_IF_ERROR(read_qwen3_vl_vision(m));
  if (m.architecture == "Gemma3ForConditionalGeneration") TRESTLE_RETURN_IF_ERROR(read_gemma3_vision(m));
  if (m.moe == MoeStyle::kQwen2Moe) {
    const auto& raw = config.raw;
    if (raw.contains("shared_expert_intermediate_size") && raw["shared_expert_intermediate_size"].is_number_integer())
      m.shared_expert_ffn_hidden_size = raw["shared_expert_intermediate_size"].get<std::int64_t>();
    if (m.shared_expert_ffn_hidden_size < 0)
      return Status::Error(m.architecture + ": shared_expert_intermediate_size must not be negative");
    // transformers builds the shared expert whatever its size: at 0 an empty MLP beside a gate of its own, which
    // Megatron's MoE layer has no form for (its shared expert is there with a size, or not at all).
    if (m.shared_expert_ffn_hidden_size == 0)
      return Status::Error(m.architecture +
                           ": shared_expert_intermediate_size 0 (an empty shared-expert MLP, which transformers still "
                           "builds with its gate) is not supported by the Megatron bridge");
  }
  if (m.deepseek_moe()) {
    const auto& raw = config.raw;
    auto size = [&](const char* key, std::int64_t& out) -> Status {
      const auto it = raw.find(key);
      if (it == raw.end() || it->is_null()) return OkStatus();
      if (!it->is_number_integer() || it->get<std::int64_t>() < 0)
        return Status::Error(m.architecture + ": '" + key + "' must be a non-negative integer, got " + it->dump());
      out = it->get<std::int64_t>();
      return OkStatus();
    };
    // transformers' Glm4MoeConfig defaults: one dense layer, one shared expert.
    std::int64_t shared_experts = m.glm4_moe() ? 1 : 0;
    if (m.glm4_moe()) m.first_dense_layers = 1;
    TRESTLE_RETURN_IF_ERROR(size("first_k_dense_replace", m.first_dense_layers));
    TRESTLE_RETURN_IF_ERROR(size("n_shared_experts", shared_experts));
    if (m.deepseek()) {
      for (auto [key, field] : {std::pair{"q_lora_rank", &m.q_lora_rank},
                                {"kv_lora_rank", &m.kv_lora_rank},
                                {"qk_nope_head_dim", &m.qk_nope_head_dim},
                                {"qk_rope_head_dim", &m.qk_rope_head_dim},
                                {"v_head_dim", &m.v_head_dim}})
        TRESTLE_RETURN_IF_ERROR(size(key, *field));
      if (m.kv_lora_rank <= 0 || m.qk_nope_head_dim <= 0 || m.qk_rope_head_dim <= 0 || m.v_head_dim <= 0)
        return Status::Error(m.architecture +
                             ": kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim must be positive");
    } else {
      // GLM-4.5's MoE layers always have the shared experts' MLP (transformers builds an empty one for 0).
      if (shared_experts == 0)
        return Status::Error(m.architecture +
                             ": n_shared_experts 0 (an empty shared-expert MLP) is not supported by the Megatron "
                             "bridge; GLM-4.5's MoE layers have at least one shared expert");
      m.qkv_bias = truthy(raw, "attention_bias");
      m.qk_norm = truthy(raw, "use_qk_norm");
      m.rotary_percent = partial_rotary_factor(raw, 0.5);
    }
    m.ffn_hidden_size = config.moe_intermediate_size;
    m.dense_ffn_hidden_size = config.intermediate_size;
    m.first_dense_layers = std::min(m.first_dense_layers, config.num_layers);
    m.shared_expert_ffn_hidden_size = shared_experts * config.moe_intermediate_size;
    if (m.first_dense_layers > 0 && m.dense_ffn_hidden_size <= 0)
      return Status::Error(m.architecture + ": intermediate_size (the dense layers' MLP, first_k_dense_replace " +
                           std::to_string(m.first_dense_layers) + ") must be positive");
  }
  const auto& c = m.hf;  // (Nemotron-H's layer count comes from its pattern)
  for (const auto& [field, value] : {std::pair<const char*, std::int64_t>{"hidden_size", c.hidden_size},
                                     {"num_hidden_layers", c.num_layers},
                                     {"num_attention_heads", c.num_attention_heads},
                                     {"num_key_value_heads", c.num_kv_heads},
                                     {"head_dim", c.head_dim},
                                     {"vocab_size", c.vocab_size},
                                     {"intermediate_size (or moe_intermediate_size)", m.ffn_hidden_size}})
    if (value <= 0)
      return Status::Error(m.architecture + ": config's " + field + " is " +
                           (value == 0 ? "0 or missing" : std::to_string(value)) + "; it must be positive");
  if (m.is_moe() && (c.num_experts <= 0 || c.experts_per_token <= 0))
    return Status::Error(m.architecture + ": config lacks the number of experts or experts per token");
  TRESTLE_RETURN_IF_ERROR(check_options(m));
  return m;
}

}  // namespace

Result<BridgeModel> bridge_model_from_config(const HfModelConfig& config) {
  auto model = bridge_model_of(config);
  if (model.ok() || config.source.empty() || model.status().message().find(config.source) != std::string::npos)
    return model;
  return model.status().with_context(config.source);
}

const std::vector<TensorRule>& architecture_rules(const BridgeModel& model) {
  return find_entry(model.architecture)->rules;
}

std::int64_t count_mtp_layers(const BridgeModel& model, const std::vector<std::string>& hf_names) {
  // Qwen3-Next / Qwen3.5: one layer (its mtp.fc and norms are the layer's own, so more would need names it has not).
  if (model.gated_delta_net)
    return std::find(hf_names.begin(), hf_names.end(), "mtp.fc.weight") != hf_names.end() ? 1 : 0;
  if (!model.deepseek_moe()) return 0;
  const auto it = model.hf.raw.find("num_nextn_predict_layers");
  // Absent, transformers 5's default (Glm4MoeConfig's and DeepseekV3Config's num_mtp_layers): 1.
  const std::int64_t most = it != model.hf.raw.end() && it->is_number_integer() ? it->get<std::int64_t>() : 1;
  std::int64_t present = 0;
  while (present < most && std::find(hf_names.begin(), hf_names.end(),
                                     "model.layers." + std::to_string(model.hf.num_layers + present) +
                                         ".eh_proj.weight") != hf_names.end())
    ++present;
  return present;
}

namespace {

// GPT-OSS's and Gemma 4's windows: sliding_window wide in the layers layer_types marks sliding (none without one).
void set_sliding_windows(const BridgeModel& m, GptModelSpec& s) {
  const auto w = m.hf.raw.find("sliding_window");
  s.mixed_attention = w != m.hf.raw.end() && w->is_number_integer() && w->get<std::int64_t>() > 0;
  if (s.mixed_attention) {
    s.window_size = w->get<std::int64_t>();
    s.window_layers = hf_window_layers(m);
  }
}

}  // namespace

GptModelSpec megatron_spec(const BridgeModel& m, NormNaming norms) {
  GptModelSpec s;
  s.num_layers = m.hf.num_layers;
  s.hidden_size = m.hf.hidden_size;
  s.ffn_hidden_size = m.ffn_hidden_size;
  s.num_attention_heads = m.hf.num_attention_heads;
  s.num_query_groups = m.hf.num_kv_heads;
  s.kv_channels = m.hf.head_dim;
  s.vocab_size = m.hf.vocab_size;
  s.num_experts = m.is_moe() ? m.hf.num_experts : 0;
  s.shared_expert_ffn_hidden_size = m.shared_expert_ffn_hidden_size;
  s.shared_expert_gate = m.shared_expert_ffn_hidden_size > 0 && m.moe == MoeStyle::kQwen2Moe;  // DeepSeek's: ungated
  if (m.gemma) {
    auto number = [&](const char* key) {
      const auto it = m.hf.raw.find(key);
      return it != m.hf.raw.end() && it->is_number() ? it->get<double>() : 0.0;
    };
    s.geglu = s.zero_centered_norms = s.post_norms = true;
    // Gemma 2's attention soft-capping; Gemma 3's and 4's configs keep the field, which transformers never applies.
    if (!m.qk_norm && !m.gemma4) s.attn_logit_softcapping = number("attn_logit_softcapping");
    s.final_logit_softcapping = number("final_logit_softcapping");
    s.mixed_attention = number("sliding_window") > 0;
    if (s.mixed_attention) {
      s.window_size = static_cast<std::int64_t>(number("sliding_window"));
      s.window_layers = hf_window_layers(m);
    }
    s.query_pre_attn_scalar = number("query_pre_attn_scalar");
    if (s.query_pre_attn_scalar <= 0) s.query_pre_attn_scalar = 256;  // transformers' default for both
    s.scale_embeddings = true;
    if (m.qk_norm) {  // Gemma 3: the windowed layers' RoPE base (rope_local_base_freq before transformers 5)
      const json* local = gemma3_rope_block(m.hf.raw, "sliding_attention");
      s.rotary_base_local = local && local->contains("rope_theta") && (*local)["rope_theta"].is_number()
                                ? (*local)["rope_theta"].get<double>()
                                : number("rope_local_base_freq");
      if (s.rotary_base_local <= 0) s.rotary_base_local = 10000.0;
    }
  }
  if (m.gemma4) {
    const auto cap = m.hf.raw.find("final_logit_softcapping");
    s.geglu = s.post_norms = s.scale_embeddings = s.layer_scalar = true;
    s.final_logit_softcapping = cap != m.hf.raw.end() && cap->is_number() ? cap->get<double>() : 0.0;
    set_sliding_windows(m, s);
    s.layer_kv_channels = m.layer_head_dim;
    s.layer_query_groups = m.layer_kv_heads;
    s.attention_k_eq_v = m.k_eq_v;
    s.kv_shared_layers = m.kv_shared_layers;
    s.double_wide_mlp = m.double_wide_mlp;
    s.per_layer_input_size = m.per_layer_input_size;
    s.per_layer_vocab_size = m.per_layer_vocab_size;
    s.moe_beside_mlp = m.is_moe();
    s.softmax_scale = 1.0;  // the q / k norms stand in for 1 / sqrt(d)
    s.value_norm = true;
    // transformers' defaults: the windowed layers' RoPE plain of base 10000, the full-attention layers' proportional
    // over a quarter of each head of base 1000000 (plain RoPE being proportional over all of it).
    const json* full = gemma3_rope_block(m.hf.raw, "full_attention");
    const json* local = gemma3_rope_block(m.hf.raw, "sliding_attention");
    auto theta = [](const json* block, double fallback) {
      return block && block->contains("rope_theta") && (*block)["rope_theta"].is_number()
                 ? (*block)["rope_theta"].get<double>()
                 : fallback;
    };
    s.rotary_base = theta(full, 1'000'000.0);
    s.rotary_base_local = theta(local, 10'000.0);
    s.global_rope_fraction = 1.0;
    if (!full) {
      s.global_rope_fraction = 0.25;
    } else if (rope_block_type(full) == "proportional") {
      const auto p = full->find("partial_rotary_factor");
      s.global_rope_fraction = p != full->end() && p->is_number() ? p->get<double>() : 1.0;
    }
  }
  if (m.sigmoid_router()) {
    s.moe_first_dense_layers = m.first_dense_layers;
    s.dense_ffn_hidden_size = m.dense_ffn_hidden_size;
    s.moe_router_expert_bias = true;
    s.mtp_num_layers = m.mtp_layers;
  }
  s.rotary_percent = m.rotary_percent;
  if (m.deepseek()) {
    s.q_lora_rank = m.q_lora_rank;
    s.kv_lora_rank = m.kv_lora_rank;
    s.qk_head_dim = m.qk_nope_head_dim;
    s.qk_pos_emb_head_dim = m.qk_rope_head_dim;
    s.v_head_dim = m.v_head_dim;
    s.num_query_groups = m.hf.num_attention_heads;
    s.kv_channels = m.v_head_dim;
  }
  if (m.gpt_oss()) {
    s.add_bias_linear = s.softmax_offset = s.quick_geglu = true;
    set_sliding_windows(m, s);
  }
  if (m.olmo2) {
    s.pre_norms = false;
    s.post_norms = s.qk_norm_full_projection = true;
  }
  if (m.gated_delta_net) {
    s.mtp_num_layers = m.mtp_layers;
    s.zero_centered_norms = s.attention_output_gate = true;
    s.linear_attention_layers = m.linear_layers;
    s.linear_conv_kernel_dim = m.linear_conv_kernel_dim;
    s.linear_key_head_dim = m.linear_key_head_dim;
    s.linear_value_head_dim = m.linear_value_head_dim;
    s.linear_num_key_heads = m.linear_num_key_heads;
    s.linear_num_value_heads = m.linear_num_value_heads;
    s.linear_in_proj_split = m.architecture.starts_with("Qwen3_5");
  }
  if (m.nemotron_h()) {
    s.hybrid_layers = m.hybrid_layers;
    s.mamba_num_heads = m.mamba_num_heads;
    s.mamba_head_dim = m.mamba_head_dim;
    s.mamba_state_dim = m.mamba_state_dim;
    s.mamba_num_groups = m.mamba_num_groups;
    s.mamba_conv_kernel = m.mamba_conv_kernel;
    s.squared_relu = true;
    s.moe_latent_size = m.moe_latent_size;  // (its router is DeepSeek-V3's, above; the pattern says which layers)
  }
  s.add_qkv_bias = m.qkv_bias;
  s.qk_layernorm = m.qk_norm;
  s.tied_embeddings = m.tied();
  s.norms = norms;
  for (const auto& v : m.vision_tensors) s.carried_tensors.push_back({v.megatron, v.shape});
  return s;
}

Status check_linear_attention_tp(const BridgeModel& m, int tp) {
  static const std::string kTp = "the tensor-parallel size";
  for (std::size_t i = 0; i < m.layer_kv_heads.size(); ++i)
    TRESTLE_RETURN_IF_ERROR(
        check_divides(m.layer_kv_heads[i], tp, "number of KV heads of layer " + std::to_string(i), kTp));
  if (m.nemotron_h()) {
    TRESTLE_RETURN_IF_ERROR(check_divides(m.mamba_num_heads, tp, "number of Mamba heads", kTp));
    return check_divides(m.mamba_num_groups, tp, "number of Mamba groups (n_groups)", kTp);
  }
  if (!m.gated_delta_net) return OkStatus();
  TRESTLE_RETURN_IF_ERROR(check_divides(m.linear_num_key_heads, tp, "number of Gated DeltaNet key heads", kTp));
  return check_divides(m.linear_num_value_heads, tp, "number of Gated DeltaNet value heads", kTp);
}

}  // namespace trestle
