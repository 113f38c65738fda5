#include "train/model/transformer_layer.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <optional>

#include "kernels/grouped_attention.h"
#include "train/model/blockwise_attention.h"
#include "train/model/fused_kernels.h"
#include "train/model/gated_delta_rule.h"
#include "train/model/mamba_scan.h"
#include "train/model/moe_dispatch.h"
#include "train/model/moe_router.h"
#include "train/model/tp_regions.h"

namespace trestle::train {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double epsilon) {
  at::Tensor x32 = x.to(at::kFloat);
  at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + epsilon);
  return weight * normed.to(x.scalar_type());
}

at::Tensor model_norm(const at::Tensor& x, const at::Tensor& weight, const GptModelSpec& spec, bool fused) {
  if (fused && supports(x) && weight.scalar_type() == x.scalar_type() && weight.device() == x.device())
    return fused_rms_norm(x, weight, spec.norm_epsilon, spec.zero_centered_norms);
  if (!spec.zero_centered_norms) return rms_norm(x, weight, spec.norm_epsilon);
  at::Tensor x32 = x.to(at::kFloat);
  at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + spec.norm_epsilon);
  return (normed * (1 + weight.to(at::kFloat))).to(x.scalar_type());
}

NormedResidual add_then_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                             const GptModelSpec& spec, bool fused) {
  if (!delta.defined()) return {x, model_norm(x, weight, spec, fused)};
  if (fused && supports(x) && delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() &&
      delta.device() == x.device() && weight.scalar_type() == x.scalar_type() && weight.device() == x.device()) {
    std::vector<at::Tensor> parts = fused_add_rms_norm(x, delta, weight, spec.norm_epsilon, spec.zero_centered_norms);
    return {parts[0], parts[1]};
  }
  at::Tensor sum = x + delta;
  at::Tensor normed = model_norm(sum, weight, spec, fused);
  return {std::move(sum), std::move(normed)};
}

at::Tensor mlp_activation(const at::Tensor& fc1_output, const GptModelSpec& spec, bool fused) {
  if (spec.squared_relu) return at::relu(fc1_output).square();
  if (fused && !spec.quick_geglu && supports(fc1_output))
    return fused_glu(fc1_output, spec.geglu ? Glu::kGeGlu : Glu::kSwiGlu);
  auto gate_up = fc1_output.chunk(2, -1);
  at::Tensor gate = gate_up[0], up = gate_up[1];
  if (spec.geglu) return at::gelu(gate, "tanh") * up;
  if (!spec.quick_geglu) return at::silu(gate) * up;
  if (spec.activation_clamp > 0) {
    gate = gate.clamp_max(spec.activation_clamp);
    up = up.clamp(-spec.activation_clamp, spec.activation_clamp);
  }
  return gate * at::sigmoid(gate * 1.702) * (up + spec.glu_linear_offset);
}

at::Tensor softcap(const at::Tensor& x, double cap, bool fused) {
  if (fused && supports(x)) return fused_softcap(x, cap);
  return at::tanh(x / cap) * cap;
}

at::Tensor enter_tp_region(const at::Tensor& x, const LayerContext& c) {
  return c.sequence_parallel ? gather_from_sequence(x, *c.group) : copy_to_tp(x, *c.group);
}

at::Tensor leave_tp_region(const at::Tensor& partial, const LayerContext& c) {
  return c.sequence_parallel ? reduce_scatter_to_sequence(partial, *c.group) : reduce_from_tp(partial, *c.group);
}

namespace {

// Binds a layer's MLP: a mixture of experts ([first_expert, first_expert + experts) of them; all when experts is 0),
// its router, shared experts and latent projections, or a dense MLP.
template <typename Get>
void bind_mlp(TransformerLayer& l, Get&& get, const GptModelSpec& spec, bool moe, std::int64_t first_expert,
              std::int64_t experts) {
  const bool bias = spec.add_bias_linear;
  if (!moe) {
    l.fc1_weight = get("mlp.linear_fc1.weight");
    l.fc2_weight = get("mlp.linear_fc2.weight");
    if (bias) {
      l.fc1_bias = get("mlp.linear_fc1.bias");
      l.fc2_bias = get("mlp.linear_fc2.bias");
    }
    return;
  }
  l.router_weight = get("mlp.router.weight");
  if (bias) l.router_bias = get("mlp.router.bias");
  if (l.router_weight.defined())
    l.router_loss_log =
        std::make_shared<at::Tensor>(at::zeros({kRouterLosses}, l.router_weight.options().dtype(at::kFloat)));
  if (spec.moe_router_expert_bias) {
    l.expert_bias = get("mlp.router.expert_bias");
    if (l.expert_bias.defined()) {
      l.expert_load =
          std::make_shared<at::Tensor>(at::zeros({spec.num_experts}, l.expert_bias.options().dtype(at::kFloat)));
      l.expert_bias_state =
          std::make_shared<at::Tensor>(at::zeros({spec.num_experts}, l.expert_bias.options().dtype(at::kFloat)));
    }
  }
  if (experts == 0) experts = spec.num_experts;
  for (std::int64_t e = first_expert; e < first_expert + experts; ++e) {
    const std::string x = "mlp.experts.local_experts." + std::to_string(e) + ".";
    l.expert_fc1.push_back(get(x + "linear_fc1.weight"));
    l.expert_fc2.push_back(get(x + "linear_fc2.weight"));
    if (bias) {
      l.expert_fc1_bias.push_back(get(x + "linear_fc1.bias"));
      l.expert_fc2_bias.push_back(get(x + "linear_fc2.bias"));
    }
  }
  if (spec.shared_expert_ffn_hidden_size > 0) {
    l.shared_fc1 = get("mlp.shared_experts.linear_fc1.weight");
    l.shared_fc2 = get("mlp.shared_experts.linear_fc2.weight");
    if (bias) {
      l.shared_fc1_bias = get("mlp.shared_experts.linear_fc1.bias");
      l.shared_fc2_bias = get("mlp.shared_experts.linear_fc2.bias");
    }
    if (spec.shared_expert_gate) l.shared_gate = get("mlp.shared_experts.gate_weight");
  }
  if (spec.moe_latent_size > 0) {
    l.fc1_latent = get("mlp.fc1_latent_proj.weight");
    l.fc2_latent = get("mlp.fc2_latent_proj.weight");
  }
}

// A hybrid model's layer (the names of model_spec.cc's add_hybrid_layer_tensors).
template <typename Get>
void bind_hybrid(TransformerLayer& l, Get&& get, const GptModelSpec& spec, std::int64_t layer,
                 std::int64_t first_expert, std::int64_t experts) {
  l.mixer = spec.hybrid_layer(layer);
  if (l.mixer == 'M') {
    const std::string m = "mixer.";
    l.input_norm = get(spec.norms == NormNaming::kTransformerEngine ? m + "in_proj.layer_norm_weight" : "norm.weight");
    for (const char* part : {"z", "x", "B", "C", "dt"}) l.mamba_in_proj.push_back(get(m + "in_proj.weight." + part));
    for (const char* part : {"x", "B", "C"}) {
      l.mamba_conv_weight.push_back(get(m + "conv1d.weight." + part));
      l.mamba_conv_bias.push_back(get(m + "conv1d.bias." + part));
    }
    l.a_log = get(m + "A_log");
    l.mamba_d = get(m + "D");
    l.dt_bias = get(m + "dt_bias");
    l.out_norm = get(m + "norm.weight");
    l.proj_weight = get(m + "out_proj.weight");
  } else if (l.mixer == '*') {
    l.input_norm = get(input_norm_name(spec.norms));
    l.qkv_weight = get("self_attention.linear_qkv.weight");
    l.proj_weight = get("self_attention.linear_proj.weight");
  } else {
    const bool moe = l.mixer == 'E';
    l.mlp_norm = get(pre_mlp_norm_name(spec.norms, moe));
    bind_mlp(l, get, spec, moe, first_expert, experts);
  }
}

}  // namespace

Result<TransformerLayer> TransformerLayer::bind(const ModelParameters& parameters, const GptModelSpec& spec,
                                                std::int64_t layer, std::int64_t first_expert, std::int64_t experts,
                                                const std::string& layer_prefix) {
  const std::string prefix =
      layer_prefix.empty() ? "decoder.layers." + std::to_string(layer) + "." : layer_prefix;
  Status missing = OkStatus();
  auto get = [&](const std::string& name) {
    at::Tensor t = parameters.get(prefix + name);
    if (!t.defined() && missing.ok()) missing = Status::Error("the model has no parameter " + prefix + name);
    return t;
  };
  TransformerLayer l;
  l.index = layer;
  l.kv_channels = spec.layer_kv_channels_of(layer);
  l.query_groups = spec.layer_query_groups_of(layer);
  if (spec.hybrid()) {
    bind_hybrid(l, get, spec, layer, first_expert, experts);
    TRESTLE_RETURN_IF_ERROR(missing);
    return l;
  }
  l.windowed = spec.layer_has_window(layer);
  l.k_eq_v = spec.layer_k_eq_v(layer);
  l.kv_reuse = spec.layer_kv_shared(layer);
  for (std::int64_t j = layer + 1; j < spec.num_layers && !l.kv_store; ++j) l.kv_store = spec.kv_source_layer(j) == layer;
  if (l.kv_reuse) {
    // Gemma 4's KV-sharing layers: queries and their norm alone.
    l.input_norm = get("input_layernorm.weight");
    l.q_proj = get("self_attention.linear_q_proj.weight");
    l.q_norm = get("self_attention.q_layernorm.weight");
  } else if (spec.multi_latent_attention()) {
    const bool te = spec.norms == NormNaming::kTransformerEngine;
    const std::string a = "self_attention.";
    l.input_norm = get("input_layernorm.weight");
    if (spec.q_lora_rank > 0) {
      l.q_down = get(a + "linear_q_down_proj.weight");
      l.q_latent_norm = get(te ? a + "linear_q_up_proj.layer_norm_weight" : a + "q_layernorm.weight");
      l.q_up = get(a + "linear_q_up_proj.weight");
    } else {
      l.q_proj = get(a + "linear_q_proj.weight");
    }
    l.kv_down = get(a + "linear_kv_down_proj.weight");
    l.kv_latent_norm = get(te ? a + "linear_kv_up_proj.layer_norm_weight" : a + "kv_layernorm.weight");
    l.kv_up = get(a + "linear_kv_up_proj.weight");
  } else if (spec.layer_is_linear_attention(layer)) {
    const std::string a = "self_attention.";
    l.input_norm = get(linear_attention_input_norm_name(spec.norms));
    for (const char* part : {"query", "key", "value", "z", "beta", "alpha"})
      l.in_proj.push_back(get(a + "in_proj.weight." + part));
    for (const char* part : {"query", "key", "value"}) l.conv1d.push_back(get(a + "conv1d.weight." + part));
    l.dt_bias = get(a + "dt_bias");
    l.a_log = get(a + "A_log");
    l.out_norm = get(a + "out_norm.weight");
  } else {
    if (spec.pre_norms) l.input_norm = get(input_norm_name(spec.norms));
    l.qkv_weight = get("self_attention.linear_qkv.weight");
    if (spec.add_qkv_bias) l.qkv_bias = get("self_attention.linear_qkv.bias");
    if (spec.qk_layernorm) {
      l.q_norm = get("self_attention.q_layernorm.weight");
      l.k_norm = get("self_attention.k_layernorm.weight");
    }
  }
  if (spec.post_norms) l.post_attention_norm = get(post_attention_norm_name(spec));
  l.proj_weight = get(l.in_proj.empty() ? "self_attention.linear_proj.weight" : "self_attention.out_proj.weight");
  const bool moe = spec.layer_is_moe(layer);
  if (spec.add_bias_linear) l.proj_bias = get("self_attention.linear_proj.bias");
  if (spec.softmax_offset) l.sinks = get("self_attention.core_attention.softmax_offset");
  if (spec.pre_norms) l.mlp_norm = get(pre_mlp_norm_name(spec.norms, moe));
  if (spec.post_norms && !(moe && spec.moe_beside_mlp)) l.post_mlp_norm = get(post_mlp_norm_name(spec));
  bind_mlp(l, get, spec, moe, first_expert, experts);
  if (moe && spec.moe_beside_mlp) {
    // Gemma 4: the shared experts are the dense MLP beside the routed ones, run as a dense MLP with its own norms.
    l.fc1_weight = std::exchange(l.shared_fc1, at::Tensor());
    l.fc2_weight = std::exchange(l.shared_fc2, at::Tensor());
    l.dense_mlp_norm = get("pre_shared_expert_layernorm.weight");
    l.dense_post_norm = get("mlp.post_shared_expert_layernorm.weight");
    l.router_scale = get("mlp.router.scale");
    l.per_expert_scale = get("mlp.router.per_expert_scale");
    l.post_moe_norm = get("mlp.post_moe_layernorm.weight");
    l.post_ffn_norm = get("post_ffn_layernorm.weight");
  }
  if (spec.per_layer_input_size > 0) {
    l.per_layer_gate = get("per_layer_input_gate.weight");
    l.per_layer_projection = get("per_layer_projection.weight");
    l.per_layer_norm = get("post_per_layer_input_norm.weight");
  }
  if (spec.layer_scalar) l.layer_scalar = get("layer_scalar");
  TRESTLE_RETURN_IF_ERROR(missing);
  return l;
}

at::Tensor ResidualStream::whole() const { return delta.defined() ? base + delta : base; }

bool TransformerLayer::streams() const {
  return mixer == 0 && input_norm.defined() && mlp_norm.defined() && !router_scale.defined() &&
         !per_layer_gate.defined() && !layer_scalar.defined();
}

ResidualStream TransformerLayer::forward(const ResidualStream& in, const LayerContext& c) const {
  if (!streams()) return {forward(in.whole(), c), {}};
  const GptModelSpec& s = *c.spec;
  const NormedResidual x = add_then_norm(in.base, in.delta, input_norm, s, c.fused_kernels);
  const at::Tensor attended = attention(x.normed, c);
  const NormedResidual h = add_then_norm(
      x.sum, post_attention_norm.defined() ? model_norm(attended, post_attention_norm, s, c.fused_kernels) : attended,
      mlp_norm, s, c.fused_kernels);
  const at::Tensor out = mlp(h.normed, c);
  return {h.sum, post_mlp_norm.defined() ? model_norm(out, post_mlp_norm, s, c.fused_kernels) : out};
}

at::Tensor TransformerLayer::forward(const at::Tensor& x, const LayerContext& c) const {
  if (streams()) return forward(ResidualStream{x, {}}, c).whole();
  const GptModelSpec& s = *c.spec;
  auto norm = [&](const at::Tensor& t, const at::Tensor& weight) {
    return weight.defined() ? model_norm(t, weight, s, c.fused_kernels) : t;
  };
  switch (mixer) {
    case 'M':
      return x + mamba_mixer(norm(x, input_norm), c);
    case '*':
      return x + attention(norm(x, input_norm), c);
    case '-':
    case 'E':
      return x + mlp(norm(x, mlp_norm), c);
    default:
      break;
  }
  const at::Tensor attended = norm(attention(norm(x, input_norm), c), post_attention_norm);
  at::Tensor out;
  if (router_scale.defined()) {
    const at::Tensor h = x + attended;
    out = h + norm(mlp_beside_experts(h, c), post_ffn_norm);
  } else if (mlp_norm.defined()) {
    const NormedResidual h = add_then_norm(x, attended, mlp_norm, s, c.fused_kernels);
    out = h.sum + norm(mlp(h.normed, c), post_mlp_norm);
  } else {
    const at::Tensor h = x + attended;
    out = h + norm(mlp(h, c), post_mlp_norm);
  }
  if (per_layer_gate.defined()) out = add_per_layer_input(out, c);
  return layer_scalar.defined() ? out * layer_scalar.detach() : out;
}

// Gemma 4 (transformers' Gemma4TextDecoderLayer): the dense MLP of its own pre-norm, post-normed, plus the experts of
// the pre-MLP norm, routed by the layer's input itself, post-normed (the caller adds the post_ffn norm of the sum).
at::Tensor TransformerLayer::mlp_beside_experts(const at::Tensor& h, const LayerContext& c) const {
  const GptModelSpec& s = *c.spec;
  const bool fused = c.fused_kernels;
  const at::Tensor dense = model_norm(dense_mlp(model_norm(h, dense_mlp_norm, s, fused), c), dense_post_norm, s, fused);
  const at::Tensor routed = model_norm(moe(model_norm(h, mlp_norm, s, fused), c, h), post_moe_norm, s, fused);
  return dense + routed;
}

// Gemma 4's per-layer input (this layer's slice p of the model's per-layer inputs): h + norm(W_proj (gelu_tanh(W_gate
// h) · p)), the weights replicated over tp.
at::Tensor TransformerLayer::add_per_layer_input(const at::Tensor& h, const LayerContext& c) const {
  const at::Tensor input = c.per_layer_inputs.select(2, index);
  const at::Tensor gated = at::gelu(at::linear(h, per_layer_gate), "tanh") * input;
  return h + model_norm(at::linear(gated, per_layer_projection), per_layer_norm, *c.spec, c.fused_kernels);
}

namespace {

// RMS norm over a whole projection whose heads are split over the tensor-parallel ranks (OLMo 2's q/k norms):
// x [s, b, n, d] holds this rank's n heads, whose sums of squares are added up over the ranks, so each rank divides
// by the whole projection's root mean square; `weight` is the whole projection's [N · d], of which this rank's heads
// use rows [rank · n · d, (rank + 1) · n · d).
at::Tensor projection_rms_norm(const at::Tensor& x, const at::Tensor& weight, double epsilon, const TpGroup& group) {
  const std::int64_t width = x.size(2) * x.size(3);
  at::Tensor x32 = x.flatten(2).to(at::kFloat);
  at::Tensor squares = sum_over_tp(x32.pow(2).sum(-1, /*keepdim=*/true), group);
  at::Tensor normed = x32 * at::rsqrt(squares / static_cast<double>(width * group.size) + epsilon);
  return (weight.narrow(0, group.rank * width, width) * normed.to(x.scalar_type())).view_as(x);
}

at::Tensor plus_bias(const at::Tensor& x, const at::Tensor& bias) { return bias.defined() ? x + bias : x; }

}  // namespace

// Multi-latent attention (DeepSeek-V2/V3, Megatron-Core's MLASelfAttention): the latents come from the whole sequence
// on every rank (replicated down projections, or column-parallel ones gathered), each rank's heads from its pieces of
// the up projections; RoPE rotates the decoupled dims only, in interleaved pairs, the key's shared by every head.
// Attention through scaled_dot_product_attention (grouped_attention): queries and keys of nope + rope dims, values of
// v_head_dim (on a GPU a fused kernel takes the two widths; the test of the backends checks DeepSeek-V3's).
at::Tensor TransformerLayer::latent_attention(const at::Tensor& x, const LayerContext& c) const {
  const GptModelSpec& s = *c.spec;
  const bool split_down = s.norms == NormNaming::kLocal;
  const at::Tensor entered = enter_tp_region(x, c);
  // LoRA (lora.h): a down projection's adapter split as its base is, an up projection's column-parallel on the normed
  // latent.
  auto latent = [&](const at::Tensor& down, const LoraAdapter& adapter) {
    at::Tensor y = at::linear(entered, down);
    if (adapter.defined())
      y = y + (split_down ? lora_column_output(adapter, entered, *c.group, c.lora)
                          : lora_local_output(adapter, entered, c.lora));
    return split_down ? gather_last_dim(y, *c.group) : y;
  };
  auto project = [&](const at::Tensor& input, const at::Tensor& weight, const LoraAdapter& adapter) {
    const at::Tensor y = at::linear(input, weight);
    return adapter.defined() ? y + lora_column_output(adapter, input, *c.group, c.lora) : y;
  };
  const std::int64_t seq = entered.size(0), batch = entered.size(1);
  const std::int64_t nope = s.qk_head_dim, rope = s.qk_pos_emb_head_dim, dv = s.v_head_dim;
  const std::int64_t heads = s.num_attention_heads / c.group->size;
  const at::Tensor q_latent =
      q_down.defined() ? model_norm(latent(q_down, adapters.q_down), q_latent_norm, s, c.fused_kernels) : at::Tensor();
  const at::Tensor q =
      (q_down.defined() ? project(q_latent, q_up, adapters.q_up) : project(entered, q_proj, adapters.q_proj))
          .view({seq, batch, heads, nope + rope});
  const at::Tensor kv_latent = latent(kv_down, adapters.kv_down);  // [latent; shared rotary key]
  const at::Tensor kv = project(model_norm(kv_latent.narrow(-1, 0, s.kv_lora_rank), kv_latent_norm, s, c.fused_kernels),
                                kv_up, adapters.kv_up)
                            .view({seq, batch, heads, nope + dv});
  const RopeTables& tables = c.rope;
  const at::Tensor q_rope = apply_rope(deinterleave_pairs(q.narrow(-1, nope, rope)), tables, c.fused_kernels);
  const at::Tensor k_rope =
      apply_rope(deinterleave_pairs(kv_latent.narrow(-1, s.kv_lora_rank, rope)).unsqueeze(2), tables, c.fused_kernels);
  const at::Tensor query = at::cat({q.narrow(-1, 0, nope), q_rope}, -1).permute({1, 2, 0, 3});
  const at::Tensor key =
      at::cat({kv.narrow(-1, 0, nope), k_rope.expand({seq, batch, heads, rope})}, -1).permute({1, 2, 0, 3});
  const at::Tensor value = kv.narrow(-1, nope, dv).permute({1, 2, 0, 3});
  const double scale = yarn_softmax_scale_correction(s) / std::sqrt(static_cast<double>(nope + rope));
  const at::Tensor out = c.cp && c.cp->size > 1
                             ? ring_attention(query, key, value, *c.cp, scale, 0, 0.0, at::Tensor(), c.documents)
                             : kernels::grouped_attention(query, key, value, c.full_mask, scale);
  return attention_output(out.permute({2, 0, 1, 3}).reshape({seq, batch, heads * dv}), c);
}

// Gated DeltaNet (megatron-core's GatedDeltaNet, transformers' Qwen3NextGatedDeltaNet): in_proj on the whole
// sequence (this rank's heads), the depthwise causal conv1d with SiLU over [query; key; value], q and k L2-normalised
// per head (each key head serving value_heads / key_heads value heads), the gated delta rule with decay
// g = −exp(A_log) · softplus(alpha + dt_bias) and β = sigmoid(beta), then the gated norm (1 + w) · rmsnorm(o) · silu(z)
// per value head, and out_proj (row-parallel, as linear_proj).
at::Tensor TransformerLayer::gated_delta_net(const at::Tensor& x, const LayerContext& c) const {
  const GptModelSpec& s = *c.spec;
  const at::Tensor entered = enter_tp_region(x, c);
  const std::int64_t seq = entered.size(0), batch = entered.size(1);
  const std::int64_t key_heads = s.linear_num_key_heads / c.group->size,
                     value_heads = s.linear_num_value_heads / c.group->size;
  const std::int64_t dk = s.linear_key_head_dim, dv = s.linear_value_head_dim;
  const std::int64_t keys = key_heads * dk, values = value_heads * dv;
  at::Tensor fused = at::linear(entered, at::cat(in_proj));  // [s, b, q+k+v+z+beta+alpha]
  if (adapters.qkv.defined()) fused = fused + lora_column_output(adapters.qkv, entered, *c.group, c.lora);
  const at::Tensor projected = fused.transpose(0, 1);
  const at::Tensor mixed = projected.narrow(-1, 0, 2 * keys + values).transpose(1, 2);  // [b, channels, s]
  const at::Tensor kernel = at::cat(conv1d);                                              // [channels, 1, width]
  const at::Tensor convolved =
      at::silu(at::conv1d(mixed, kernel, {}, 1, kernel.size(-1) - 1, 1, kernel.size(0)).narrow(-1, 0, seq))
          .transpose(1, 2);  // [b, s, channels]
  auto l2_normalised = [](const at::Tensor& t) {  // transformers' and fla's l2norm, eps 1e-6, in fp32
    const at::Tensor t32 = t.to(at::kFloat);
    return t32 * at::rsqrt(t32.pow(2).sum(-1, /*keepdim=*/true) + 1e-6);
  };
  const std::int64_t repeat = value_heads / key_heads;
  auto heads_first = [&](const at::Tensor& t) {  // [b, s, heads, d] -> [b, value heads, s, d]
    return (repeat > 1 ? t.repeat_interleave(repeat, 2) : t).transpose(1, 2);
  };
  const at::Tensor q = heads_first(l2_normalised(convolved.narrow(-1, 0, keys).view({batch, seq, key_heads, dk})) /
                                   std::sqrt(static_cast<double>(dk)));
  const at::Tensor k = heads_first(l2_normalised(convolved.narrow(-1, keys, keys).view({batch, seq, key_heads, dk})));
  const at::Tensor v = convolved.narrow(-1, 2 * keys, values).view({batch, seq, value_heads, dv}).transpose(1, 2);
  const at::Tensor z = projected.narrow(-1, 2 * keys + values, values).view({batch, seq, value_heads, dv});
  const at::Tensor beta = at::sigmoid(projected.narrow(-1, 2 * keys + 2 * values, value_heads).to(at::kFloat));
  const at::Tensor alpha = projected.narrow(-1, 2 * keys + 2 * values + value_heads, value_heads).to(at::kFloat);
  const at::Tensor g = -a_log.to(at::kFloat).exp() * at::softplus(alpha + dt_bias.to(at::kFloat));  // [b, s, heads]
  const at::Tensor o = gated_delta_rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2)).transpose(1, 2);
  const at::Tensor o32 = o.to(at::kFloat);
  const at::Tensor normed = o32 * at::rsqrt(o32.pow(2).mean(-1, /*keepdim=*/true) + s.norm_epsilon);
  const at::Tensor gated = ((1 + out_norm.to(at::kFloat)) * normed * at::silu(z.to(at::kFloat))).to(x.scalar_type());
  return attention_output(gated.reshape({batch, seq, values}).transpose(0, 1), c);
}
namespace {

// Context parallelism for a Mamba mixer (megatron-core's MambaContextParallel): `t` [b, s, parts...] holds this rank's
// two chunks of the sequence (context_parallel.h) for every head; each of `widths`' parts of its last dim splits over
// the cp ranks by heads (or groups). to_heads returns the whole sequence, in order, for this rank's share of each part
// [b, cp·s, Σ widths / cp]; from_heads is its inverse for an output of this rank's heads [b, cp·s, w] -> [b, s, cp·w].
at::Tensor cp_to_heads(const at::Tensor& t, const std::vector<std::int64_t>& widths, const TpGroup& cp) {
  std::vector<at::Tensor> pieces;
  for (int j = 0; j < cp.size; ++j) {
    std::vector<at::Tensor> parts;
    std::int64_t offset = 0;
    for (const std::int64_t w : widths) {
      parts.push_back(t.narrow(-1, offset + j * (w / cp.size), w / cp.size));
      offset += w;
    }
    pieces.push_back(at::cat(parts, -1));
  }
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(cp.size), 1);
  const at::Tensor received = all_to_all(at::stack(pieces), cp, ones, ones);  // [cp, b, s, ·]: rank i's tokens
  const std::int64_t half = t.size(1) / 2;
  std::vector<at::Tensor> chunks;
  for (int k = 0; k < 2 * cp.size; ++k)
    chunks.push_back(received[k < cp.size ? k : 2 * cp.size - 1 - k].narrow(1, k < cp.size ? 0 : half, half));
  return at::cat(chunks, 1);
}

at::Tensor cp_from_heads(const at::Tensor& y, const TpGroup& cp) {
  const std::int64_t half = y.size(1) / (2 * cp.size);
  std::vector<at::Tensor> pieces;
  for (int i = 0; i < cp.size; ++i)
    pieces.push_back(at::cat({y.narrow(1, i * half, half), y.narrow(1, (2 * cp.size - 1 - i) * half, half)}, 1));
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(cp.size), 1);
  const at::Tensor received = all_to_all(at::stack(pieces), cp, ones, ones);  // [cp, b, s, w]: rank j's heads
  return received.permute({1, 2, 0, 3}).flatten(2);
}

}  // namespace

// A Mamba-2 mixer (megatron-core's MambaMixer, transformers' NemotronHMamba2Mixer): in_proj on the whole sequence
// (this rank's heads and groups), the depthwise causal conv1d with its bias and SiLU over [x; B; C], the step
// dt = softplus(dt + dt_bias) and A = −exp(A_log) per head, the scan (mamba_scan.h) plus D · x, then the gated norm
// w · rmsnorm(y · silu(z)) over each group's heads (epsilon 1e-5, megatron-core's), and out_proj (row-parallel). The
// step is not clamped below (megatron-core's dt_limit (0, inf); transformers clamps at time_step_min). Under context
// parallelism the conv1d, scan and norm run over the whole sequence for this cp rank's share of the heads and groups.
at::Tensor TransformerLayer::mamba_mixer(const at::Tensor& x, const LayerContext& c) const {
  const GptModelSpec& s = *c.spec;
  const at::Tensor entered = enter_tp_region(x, c);
  const int cp = c.cp_group ? c.cp_group->size : 1, cp_rank = c.cp_group ? c.cp_group->rank : 0;
  const std::int64_t tp_heads = s.mamba_num_heads / c.group->size, tp_groups = s.mamba_num_groups / c.group->size;
  const std::int64_t p = s.mamba_head_dim, n = s.mamba_state_dim;
  at::Tensor fused = at::linear(entered, at::cat(mamba_in_proj));  // [s, b, z+x+B+C+dt]
  if (adapters.qkv.defined()) fused = fused + lora_column_output(adapters.qkv, entered, *c.group, c.lora);
  at::Tensor projected = fused.transpose(0, 1);
  const std::vector<std::int64_t> widths{tp_heads * p, tp_heads * p, tp_groups * n, tp_groups * n, tp_heads};
  if (cp > 1) projected = cp_to_heads(projected, widths, *c.cp_group);
  const std::int64_t batch = projected.size(0), seq = projected.size(1);
  const std::int64_t heads = tp_heads / cp, groups = tp_groups / cp, inner = heads * p, bc = groups * n;
  // This cp rank's share of a parameter laid out head by head (or group by group) over the tp rank's heads: its
  // contiguous 1/cp of the rows.
  auto share = [&](const at::Tensor& t) { return cp > 1 ? t.narrow(0, cp_rank * (t.size(0) / cp), t.size(0) / cp) : t; };
  const at::Tensor z = projected.narrow(-1, 0, inner);
  const at::Tensor kernel = at::cat({share(mamba_conv_weight[0]), share(mamba_conv_weight[1]), share(mamba_conv_weight[2])});
  const at::Tensor bias = at::cat({share(mamba_conv_bias[0]), share(mamba_conv_bias[1]), share(mamba_conv_bias[2])});
  const at::Tensor convolved = at::silu(at::conv1d(projected.narrow(-1, inner, inner + 2 * bc).transpose(1, 2), kernel,
                                                   bias, 1, kernel.size(-1) - 1, 1, kernel.size(0))
                                            .narrow(-1, 0, seq))
                                   .transpose(1, 2);  // [b, s, x+B+C]
  const at::Tensor xs = convolved.narrow(-1, 0, inner).view({batch, seq, heads, p});
  const at::Tensor B = convolved.narrow(-1, inner, bc).view({batch, seq, groups, n});
  const at::Tensor C = convolved.narrow(-1, inner + bc, bc).view({batch, seq, groups, n});
  const at::Tensor dt = at::softplus(projected.narrow(-1, 2 * inner + 2 * bc, heads).to(at::kFloat) +
                                     share(dt_bias).to(at::kFloat));  // [b, s, heads]
  const at::Tensor A = -share(a_log).to(at::kFloat).exp();
  const at::Tensor y =
      (mamba_scan(xs, dt, A, B, C) + share(mamba_d).to(at::kFloat).view({heads, 1}) * xs.to(at::kFloat))
          .reshape({batch, seq, groups, inner / groups});
  const at::Tensor gated = y * at::silu(z.to(at::kFloat)).view_as(y);
  const at::Tensor normed =
      (gated * at::rsqrt(gated.pow(2).mean(-1, /*keepdim=*/true) + 1e-5)).reshape({batch, seq, inner});
  at::Tensor out = (normed * share(out_norm).to(at::kFloat)).to(x.scalar_type());
  if (cp > 1) out = cp_from_heads(out, *c.cp_group);
  const at::Tensor heads_out = out.transpose(0, 1);  // [s, b, this rank's inner]
  at::Tensor mixed = leave_tp_region(fused_linear(heads_out, proj_weight, proj_sink), c);
  if (adapters.proj.defined())
    mixed = mixed + lora_row_output(adapters.proj, heads_out, *c.group, c.sequence_parallel, c.lora);
  return mixed;
}

at::Tensor TransformerLayer::attention_output(const at::Tensor& heads, const LayerContext& c) const {
  at::Tensor y = plus_bias(leave_tp_region(fused_linear(heads, proj_weight, proj_sink), c), proj_bias);
  if (adapters.proj.defined()) y = y + lora_row_output(adapters.proj, heads, *c.group, c.sequence_parallel, c.lora);
  return y;
}

at::Tensor TransformerLayer::attention(const at::Tensor& x, const LayerContext& c) const {
  const GptModelSpec& s = *c.spec;
  if (kv_up.defined()) return latent_attention(x, c);
  if (!in_proj.empty()) return gated_delta_net(x, c);
  const std::int64_t d = kv_channels, per_group = s.num_attention_heads / query_groups;
  const std::int64_t groups = query_groups / c.group->size, heads = groups * per_group;
  const at::Tensor entered = enter_tp_region(x, c);
  const std::int64_t seq = entered.size(0), batch = entered.size(1);
  // Megatron's per-group order: each group's query heads, (gated attention) their gates, its key head, its value head
  // (none where the keys are the values).
  const std::int64_t queries = s.attention_output_gate ? 2 * per_group : per_group;
  const RopeTables& rope = !c.layer_rope.empty()                    ? c.layer_rope.at({windowed, d})
                           : windowed && c.local_rope.cos.defined() ? c.local_rope
                                                                    : c.rope;
  at::Tensor qkv, q, k, v;
  std::vector<at::Tensor> qkv_parts;  // qkv's: queries, (gated attention) gates, keys, (unless k_eq_v) values
  bool rotated = false;               // q and k came rotated out of the fused projection
  if (kv_reuse) {
    q = at::linear(entered, q_proj);
    if (adapters.qkv.defined()) q = q + lora_column_output(adapters.qkv, entered, *c.group, c.lora);
    q = q.view({seq, batch, heads, d});
  } else {
    qkv = fused_linear(entered, qkv_weight, qkv_sink, qkv_bias);  // [s, b, groups·(queries + 2)·d]
    if (adapters.qkv.defined()) {
      const QkvParts parts{groups, per_group, d, s.attention_output_gate};
      qkv = qkv + lora_column_output(adapters.qkv, entered, *c.group, c.lora, &parts);
    }
    qkv = qkv.view({seq, batch, groups, queries + (k_eq_v ? 1 : 2), d});
    // The plain projection with the fused kernels: queries and keys rotated where qkv holds them, whose backward writes
    // the three gradients into one qkv-sized tensor (no copy of the queries nor concatenation of the gradients).
    if (c.fused_kernels && !s.attention_output_gate && !k_eq_v && !q_norm.defined() && !s.hybrid() && !s.value_norm &&
        supports(qkv) && rope.cos.dim() == 4 && rope.cos.device() == qkv.device() && !rope.cos.requires_grad() &&
        !rope.sin.requires_grad()) {
      const std::vector<at::Tensor> parts = fused_qkv_rope(qkv, rope.cos, rope.sin);
      q = parts[0];
      k = parts[1];
      v = parts[2];
      rotated = true;
    }
  }
  if (!kv_reuse && !rotated) {
    // One split, whose backward concatenates the parts' gradients in one pass (a slice or select per part left a
    // zero-filled qkv-sized gradient each, copied into and then summed).
    std::vector<std::int64_t> sizes = {per_group};
    if (s.attention_output_gate) sizes.push_back(per_group);
    sizes.push_back(1);
    if (!k_eq_v) sizes.push_back(1);
    qkv_parts = qkv.split_with_sizes(sizes, 3);
    q = qkv_parts[0].reshape({seq, batch, heads, d});
    const std::size_t key = s.attention_output_gate ? 2 : 1;
    k = qkv_parts[key].squeeze(3);
    v = k_eq_v ? k : qkv_parts[key + 1].squeeze(3);
  }
  // Gated attention (Qwen3-Next): the heads' output times sigmoid(gate), before linear_proj.
  auto gated = [&](const at::Tensor& out) {  // out [s, b, heads · d]
    if (!s.attention_output_gate) return out;
    const at::Tensor gate = qkv_parts[1].reshape({seq, batch, heads * d});
    return out * at::sigmoid(gate);
  };
  if (q_norm.defined() && s.qk_norm_full_projection) {
    q = projection_rms_norm(q, q_norm, s.norm_epsilon, *c.group);
    k = projection_rms_norm(k, k_norm, s.norm_epsilon, *c.group);
  } else if (q_norm.defined()) {
    q = model_norm(q, q_norm, s, c.fused_kernels);
    if (k_norm.defined()) k = model_norm(k, k_norm, s, c.fused_kernels);
  }
  if (!s.hybrid() && !rotated) {  // Megatron's MambaModel has no position embedding
    q = apply_rope(q, rope, c.fused_kernels);
    if (!kv_reuse) k = apply_rope(k, rope, c.fused_kernels);
  }
  if (s.value_norm && !kv_reuse) {  // Gemma 4: each value head RMS-normed, without a weight
    const at::Tensor v32 = v.to(at::kFloat);
    v = (v32 * at::rsqrt(v32.pow(2).mean(-1, /*keepdim=*/true) + s.norm_epsilon)).to(v.scalar_type());
  }
  if (kv_store) (*c.shared_kv)[windowed] = {k, v};
  if (kv_reuse) std::tie(k, v) = c.shared_kv->at(windowed);
  const double scale =
      s.softmax_scale > 0
          ? s.softmax_scale
          : 1.0 / std::sqrt(s.query_pre_attn_scalar > 0 ? s.query_pre_attn_scalar : static_cast<double>(d));
  const std::optional<at::Tensor> allowed = windowed ? c.window_mask : c.full_mask;
  auto heads_first = [](const at::Tensor& t) { return t.permute({1, 2, 0, 3}); };  // [s, b, n, d] -> [b, n, s, d]
  if (c.cp && c.cp->size > 1) {
    at::Tensor out = ring_attention(heads_first(q), heads_first(k), heads_first(v), *c.cp, scale,
                                    windowed ? s.window_size : 0, s.attn_logit_softcapping, sinks, c.documents);
    return attention_output(gated(out.permute({2, 0, 1, 3}).reshape({seq, batch, heads * d})), c);
  }
  // Each group's key and value serve its per_group query heads. Soft-capped scores and sinks, which no fused kernel
  // takes, a block of queries at a time with the fused kernels, else as the composite of the whole score matrix.
  at::Tensor out;
  if (s.attn_logit_softcapping <= 0 && !sinks.defined()) {
    out = kernels::grouped_attention(heads_first(q), heads_first(k), heads_first(v), allowed, scale);
  } else {
    ScoresAttention scores;
    scores.scale = scale;
    scores.softcap = s.attn_logit_softcapping;
    scores.sinks = sinks;
    scores.allowed = allowed;
    scores.window = windowed ? s.window_size : 0;
    out = c.fused_kernels ? blockwise_attention(heads_first(q), heads_first(k), heads_first(v), scores)
                          : whole_matrix_attention(heads_first(q), heads_first(k), heads_first(v), scores);
  }
  return attention_output(gated(out.permute({2, 0, 1, 3}).reshape({seq, batch, heads * d})), c);
}

at::Tensor TransformerLayer::mlp(const at::Tensor& x, const LayerContext& c) const {
  return router_weight.defined() ? moe(x, c) : dense_mlp(x, c);
}

at::Tensor TransformerLayer::dense_mlp(const at::Tensor& x, const LayerContext& c) const {
  // [gate_r; up_r] rows -> [.., 2·f/tp]
  const at::Tensor entered = enter_tp_region(x, c);
  at::Tensor fc1 = fused_linear(entered, fc1_weight, fc1_sink, fc1_bias);
  if (adapters.fc1.defined()) fc1 = fc1 + lora_column_output(adapters.fc1, entered, *c.group, c.lora);
  const at::Tensor activated = mlp_activation(fc1, *c.spec, c.fused_kernels);
  at::Tensor y = plus_bias(leave_tp_region(fused_linear(activated, fc2_weight, fc2_sink), c), fc2_bias);
  if (adapters.fc2.defined()) y = y + lora_row_output(adapters.fc2, activated, *c.group, c.sequence_parallel, c.lora);
  return y;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Identity on the probabilities; backward also starts the aux loss's own backward with `scale`.
struct AttachAuxLoss : torch::autograd::Function<AttachAuxLoss> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& probs, const at::Tensor& aux, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({aux});
    return probs.view_as(probs);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor aux = ctx->get_saved_variables()[0];
    return {grad[0], at::full_like(aux, ctx->saved_data["scale"].toDouble()), at::Tensor()};
  }
};

at::Tensor attach_aux_loss(const at::Tensor& probs, const at::Tensor& aux, double scale) {
  return AttachAuxLoss::apply(probs, aux, scale);
}

// The gated MLP of rows [n, h] through a column-parallel fc1 piece ([gate_r; up_r], with its bias piece when defined)
// and a row-parallel fc2 piece: this tensor-parallel rank's partial sum (fc2's bias left to the caller).
// With LoRA adapters on fc1 / fc2 (lora.h; fc2's term is this rank's partial sum too).
struct MlpAdapters {
  const LoraAdapter* fc1 = nullptr;
  const LoraAdapter* fc2 = nullptr;
  const TpGroup* group = nullptr;
  LoraForward options;
};
at::Tensor mlp_partial(const at::Tensor& rows, const at::Tensor& fc1, const at::Tensor& fc2, const at::Tensor& fc1_bias,
                       const GptModelSpec& spec, bool fused, const MlpAdapters& adapters = {}) {
  at::Tensor up = at::linear(rows, fc1, fc1_bias);
  if (adapters.fc1 && adapters.fc1->defined())
    up = up + lora_column_output(*adapters.fc1, rows, *adapters.group, adapters.options);
  const at::Tensor activated = mlp_activation(up, spec, fused);
  at::Tensor out = at::linear(activated, fc2);
  if (adapters.fc2 && adapters.fc2->defined())
    out = out + lora_local_output(*adapters.fc2, activated, adapters.options);
  return out;
}

// The local experts' MLPs of rows grouped by expert (rows_per_expert[e] rows of expert e, in order): one GEMM per
// expert, or with `grouped` one grouped GEMM per projection over the experts' weights stacked [E, out, in] (a copy per
// call, whose backward hands each expert its own gradient). Biases (empty: none) are per expert; the fc2 biases count
// only where `add_output_bias` (one rank of the tensor-parallel group whose partial sums add up to the output): the
// other ranks add them times zero, so their (zero) gradients exist for the sum over the group. With no rows the
// (empty) rows themselves.
struct ExpertWeights {
  const std::vector<at::Tensor>& fc1;
  const std::vector<at::Tensor>& fc2;
  const std::vector<at::Tensor>& fc1_bias;
  const std::vector<at::Tensor>& fc2_bias;
  const LayerAdapters& adapters;  // expert_fc1 / expert_fc2: one per local expert, or none
  const TpGroup& group;
  LoraForward lora;
};
at::Tensor experts_mlp(const at::Tensor& rows, const std::vector<std::int64_t>& rows_per_expert, const ExpertWeights& w,
                       const GptModelSpec& spec, bool grouped, bool add_output_bias, bool fused) {
  const bool biased = !w.fc1_bias.empty();
  if (grouped && rows.size(0) > 0) {
    std::vector<std::int32_t> ends;
    std::int64_t end = 0;
    for (std::size_t e = 0; e < w.fc1.size(); ++e)
      ends.push_back(static_cast<std::int32_t>(end += rows_per_expert.at(e)));
    const at::Tensor offs = at::tensor(ends, at::kInt).to(rows.device(), /*non_blocking=*/true);
    const at::Tensor counts =
        biased ? at::tensor(rows_per_expert, at::kLong).to(rows.device(), /*non_blocking=*/true) : at::Tensor();
    auto per_row = [&](const std::vector<at::Tensor>& biases) {
      return at::stack(biases).repeat_interleave(counts, 0);
    };
    at::Tensor fc1 = at::_grouped_mm(rows, at::stack(w.fc1).transpose(1, 2), offs);
    if (biased) fc1 = fc1 + per_row(w.fc1_bias);
    at::Tensor out = at::_grouped_mm(mlp_activation(fc1, spec, fused), at::stack(w.fc2).transpose(1, 2), offs);
    return biased ? out + per_row(w.fc2_bias) * (add_output_bias ? 1.0 : 0.0) : out;
  }
  std::vector<at::Tensor> outputs;
  std::int64_t row = 0;
  for (std::size_t e = 0; e < w.fc1.size(); ++e) {
    const std::int64_t n = rows_per_expert.at(e);
    if (n == 0) continue;
    const bool adapted = !w.adapters.expert_fc1.empty();
    const MlpAdapters adapters{adapted ? &w.adapters.expert_fc1[e] : nullptr,
                               adapted ? &w.adapters.expert_fc2[e] : nullptr, &w.group, w.lora};
    at::Tensor out = mlp_partial(rows.narrow(0, row, n), w.fc1[e], w.fc2[e], biased ? w.fc1_bias[e] : at::Tensor(),
                                 spec, fused, adapters);
    outputs.push_back(biased ? out + w.fc2_bias[e] * (add_output_bias ? 1.0 : 0.0) : out);
    row += n;
  }
  return outputs.empty() ? rows : at::cat(outputs);
}

}  // namespace

// Megatron's MoE layer without token dropping: every token's router logits, its top-k experts and weights
// (moe_router.h), the tokens grouped by expert and run through each expert's SwiGLU, weighted and summed back, plus the
// shared expert. Two ways of reaching the experts:
// - every tensor-parallel rank holds all the tokens (no sequence parallelism) and every expert (ep 1): each rank routes
//   them alike and runs its pieces of every expert; the partial outputs are reduced over tp before the routing weights
//   apply, so the probabilities' gradient is whole on every rank;
// - otherwise (expert parallelism, or sequence parallelism leaving each rank its own tokens) Megatron's all-to-all
//   dispatcher (moe_dispatch.h): each rank routes its own tokens, the rows travel to their experts' ranks and back.
at::Tensor TransformerLayer::moe(const at::Tensor& x, const LayerContext& c, const at::Tensor& router_input) const {
  static const TpGroup kSingle;
  const GptModelSpec& s = *c.spec;
  const TpGroup& tp = *c.group;
  const TpGroup& ep = c.ep ? *c.ep : kSingle;
  const TpGroup& etp = c.expert_tp ? *c.expert_tp : tp;
  const bool split_sequence = c.sequence_parallel && tp.size > 1;
  // Experts split over a group of their own get their rows by dispatch (GptModel::create refuses it where tp > 1
  // without sequence parallelism: the tp ranks would hold the same tokens).
  const bool dispatched = ep.size > 1 || split_sequence || &etp != &tp;
  const std::int64_t seq = x.size(0), batch = x.size(1), h = x.size(2);
  // The router and the shared expert's gate read this rank's tokens themselves (replicated weights: under sequence
  // parallelism their gradients are summed over tp like the norms'; otherwise they are the same on every tp rank).
  const at::Tensor local = x.reshape({seq * batch, h});
  RouterOptions options;
  options.topk = static_cast<int>(s.moe_router_topk);
  options.pre_softmax = s.moe_router_pre_softmax;
  options.score_function = s.moe_router_score_function;
  options.num_groups = static_cast<int>(s.moe_router_num_groups);
  options.group_topk = static_cast<int>(s.moe_router_group_topk);
  if (s.moe_router_topk_scaling_factor > 0) options.scaling_factor = s.moe_router_topk_scaling_factor;
  if (expert_bias_state) options.expert_bias = *expert_bias_state;
  // --moe-router-dtype: the router's GEMM takes its input and weights in that dtype (megatron-core's
  // router_gating_linear), so the logits, top-k, probabilities and losses are computed in it.
  const bool promoted = c.router_dtype != at::ScalarType::Undefined && c.router_dtype != x.scalar_type();
  auto in_router = [&](const at::Tensor& t) { return promoted && t.defined() ? t.to(c.router_dtype) : t; };
  at::Tensor logits;
  if (router_scale.defined()) {
    // Gemma 4's router: its input RMS-normed without a weight, times scale / sqrt(hidden).
    const at::Tensor r32 = router_input.reshape({seq * batch, h}).to(at::kFloat);
    const at::Tensor normed = (r32 * at::rsqrt(r32.pow(2).mean(-1, /*keepdim=*/true) + s.norm_epsilon)).to(x.scalar_type());
    logits =
        at::linear(in_router(normed * router_scale * std::pow(static_cast<double>(h), -0.5)), in_router(router_weight));
  } else {
    logits = at::linear(in_router(local), in_router(router_weight), in_router(router_bias));
  }
  const bool training = at::GradMode::is_enabled();
  // The ranks that hold parts of the same sequences (tensor parallel under sequence parallelism, context parallel):
  // each rank's share of a loss covers its own tokens.
  const int sequence_shares = (split_sequence ? tp.size : 1) * (c.cp ? c.cp->size : 1);
  const double aux_scale =
      c.aux_loss_backward_scale * (c.aux_loss_times_tokens ? static_cast<double>(logits.size(0)) : 1.0);
  // What the training log reports of a loss: `loss` without its coefficient, counted once over tp ranks that each
  // compute it whole (no sequence parallelism).
  auto log_router_loss = [&](RouterLoss kind, const at::Tensor& loss, double coeff) {
    if (!router_loss_log) return;
    const double replicas = split_sequence ? 1.0 : static_cast<double>(tp.size);
    router_loss_log->select(0, kind).add_(loss.detach().to(at::kFloat) / (coeff * replicas));
  };
  if (c.z_loss_coeff > 0 && training) {  // ST-MoE's z-loss on the router logits, Megatron's coefficient / shares
    const at::Tensor z = z_loss(logits, c.z_loss_coeff / sequence_shares);
    // (Megatron logs each rank's own z-loss, not a sum over its tp ranks: log_router_loss's count does not apply.)
    if (router_loss_log)
      router_loss_log->select(0, kZLoss).add_(z.detach().to(at::kFloat) / (c.z_loss_coeff / sequence_shares));
    logits = attach_aux_loss(logits, z, aux_scale);
  }
  // Megatron drops the tokens over each expert's capacity before the losses ride on the probabilities and before the
  // experts' loads are counted; the load-balancing losses read the undropped scores.
  Routing routing = drop_over_capacity(topk_routing(logits, options), options.topk, c.capacity);
  if (per_expert_scale.defined()) routing.probs = routing.probs * per_expert_scale;  // Gemma 4
  if (expert_load && training) {
    at::NoGradGuard no_grad;
    *expert_load += routing.map.sum(0).to(at::kFloat);
  }
  if (c.load_balancing.any() && training) {
    // Megatron's load-balancing losses ride on the routing probabilities, adding their gradients. aux_loss: where the
    // sequence is split (sequence and context parallelism) the expert counts and the token total are the whole
    // sequence's, and each rank's term sums its own tokens' probabilities: the terms add up to the whole loss.
    // seq_aux_loss: the same per sequence (megatron-core's _apply_seq_aux_loss: the rows of [seq, batch · experts],
    // each sequence's experts a column block), summed and divided by the sequences; under --calculate-per-token-loss
    // its gradient is scaled by the rows, seq, as megatron-core counts them. global_aux_loss: the counts and the token
    // total over the data-parallel ranks too, the counts averaged over the iteration's micro-batches so far. Several
    // types each add their own loss (megatron-core's _apply_aux_loss, _apply_seq_aux_loss, _apply_global_aux_loss).
    const Routing scores = routing_scores_for_aux_loss(logits, options.topk, options.score_function);
    const std::int64_t experts = logits.size(1);
    auto attach_load_balancing_loss = [&](RouterLoss kind, double coeff, bool per_sequence, bool global) {
      const std::int64_t rows = per_sequence ? seq : logits.size(0);
      const at::Tensor probs = per_sequence ? scores.probs.reshape({seq, batch * experts}) : scores.probs;
      at::Tensor counts = (per_sequence ? scores.map.reshape({seq, batch * experts}) : scores.map).sum(0);
      std::int64_t total_tokens = rows;
      if (split_sequence) {
        tp.all_reduce_sum(counts);
        total_tokens *= tp.size;
      }
      if (c.cp && c.cp->size > 1) {
        TpGroup{c.cp->backend, c.cp->rank, c.cp->size}.all_reduce_sum(counts);
        total_tokens *= c.cp->size;
      }
      if (global) {
        if (c.dp && c.dp->size > 1) {
          c.dp->all_reduce_sum(counts);
          total_tokens *= c.dp->size;
        }
        if (!global_counts)
          throw std::logic_error("global_aux_loss: layer " + std::to_string(index) + " holds no running expert counts");
        RunningExpertCounts& running = *global_counts;
        running.sum = running.sum.defined() ? running.sum + counts.to(at::kFloat) : counts.to(at::kFloat);
        running.micro_batches += 1;
        counts = running.sum / static_cast<float>(running.micro_batches);
      }
      at::Tensor aux = load_balancing_loss(probs, counts, total_tokens, options.topk, coeff, experts);
      if (per_sequence) aux = aux / static_cast<double>(batch);
      log_router_loss(kind, aux, coeff);
      const double scale = c.aux_loss_backward_scale * (c.aux_loss_times_tokens ? static_cast<double>(rows) : 1.0);
      routing.probs = attach_aux_loss(routing.probs, aux, scale);
    };
    const LoadBalancingCoefficients& lb = c.load_balancing;
    if (lb.micro_batch > 0)
      attach_load_balancing_loss(kLoadBalancingLoss, lb.micro_batch, /*per_sequence=*/false, /*global=*/false);
    if (lb.sequence > 0)
      attach_load_balancing_loss(kSeqLoadBalancingLoss, lb.sequence, /*per_sequence=*/true, /*global=*/false);
    if (lb.global_batch > 0)
      attach_load_balancing_loss(kGlobalLoadBalancingLoss, lb.global_batch, /*per_sequence=*/false, /*global=*/true);
  }
  // The experts' (and the shared expert's) input: all of the sequence on every tp rank, unless dispatched. Latent MoE:
  // the routed experts' rows are the tokens projected into the latent space before they enter the tp region, so the
  // replicated projection's gradient is whole on every rank (or, dispatched under sequence parallelism, this rank's
  // share, summed over tp as the router's).
  const at::Tensor entered = (!dispatched || shared_fc1.defined()) ? enter_tp_region(x, c) : at::Tensor();
  const at::Tensor latent = fc1_latent.defined() ? at::linear(x, fc1_latent) : at::Tensor();
  const std::int64_t width = latent.defined() ? latent.size(2) : h;
  const at::Tensor rows_in = dispatched         ? (latent.defined() ? latent : x).reshape({seq * batch, width})
                             : latent.defined() ? enter_tp_region(latent, c).reshape({-1, width})
                                                : entered.reshape({-1, h});
  const PermutedTokens permuted = permute_tokens(rows_in, routing);
  std::optional<TokenDispatcher> dispatcher;
  at::Tensor rows = permuted.tokens;
  std::vector<std::int64_t> rows_per_expert;
  if (dispatched) {
    // The experts' tensor-parallel ranks each see every row of their experts: gathered over that group, unless
    // every rank of it already holds the same tokens (tp = etp without sequence parallelism).
    dispatcher.emplace(permuted.tokens_per_expert, ep, split_sequence || &etp != &tp ? etp : kSingle);
    rows = dispatcher->dispatch(rows);
    rows_per_expert = dispatcher->rows_per_local_expert();
  } else {
    const at::Tensor counts = permuted.tokens_per_expert.cpu();
    for (std::int64_t e = 0; e < counts.numel(); ++e) rows_per_expert.push_back(counts[e].item<std::int64_t>());
  }
  // With no rows here the (empty) rows themselves go back, so every rank's graph holds the same exchanges.
  const at::Tensor expert_out = experts_mlp(
      rows, rows_per_expert, {expert_fc1, expert_fc2, expert_fc1_bias, expert_fc2_bias, adapters, etp, c.lora}, s,
      c.grouped_experts && adapters.expert_fc1.empty(), /*add_output_bias=*/etp.rank == 0, c.fused_kernels);
  const at::Tensor summed = dispatched ? dispatcher->combine(expert_out) : reduce_from_tp(expert_out, tp);
  // Weighted and summed in the probabilities' dtype (the router's), back in the model's.
  at::Tensor out = unpermute_tokens(summed, permuted, seq * batch).view({seq, batch, width});
  if (fc2_latent.defined()) out = at::linear(out, fc2_latent);
  if (shared_fc1.defined()) {
    const MlpAdapters shared_adapters{&adapters.shared_fc1, &adapters.shared_fc2, &tp, c.lora};
    at::Tensor shared = plus_bias(
        leave_tp_region(
            mlp_partial(entered, shared_fc1, shared_fc2, shared_fc1_bias, s, c.fused_kernels, shared_adapters), c),
        shared_fc2_bias);
    if (shared_gate.defined()) shared = shared * at::sigmoid(at::linear(x, shared_gate));
    out = out + shared;
  }
  return out;
}

}  // namespace trestle::train
