#include "train/model/transformer_layer.h"

#include <ATen/ATen.h>

#include <cmath>

#include "train/model/tp_regions.h"

namespace trestle::train {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double epsilon) {
  at::Tensor x32 = x.to(at::kFloat);
  at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + epsilon);
  return weight * normed.to(x.scalar_type());
}

at::Tensor enter_tp_region(const at::Tensor& x, const LayerContext& c) {
  return c.sequence_parallel ? gather_from_sequence(x, *c.group) : copy_to_tp(x, *c.group);
}

at::Tensor leave_tp_region(const at::Tensor& partial, const LayerContext& c) {
  return c.sequence_parallel ? reduce_scatter_to_sequence(partial, *c.group) : reduce_from_tp(partial, *c.group);
}

Result<TransformerLayer> TransformerLayer::bind(const ModelParameters& parameters, const GptModelSpec& spec,
                                                std::int64_t layer) {
  const std::string prefix = "decoder.layers." + std::to_string(layer) + ".";
  Status missing = OkStatus();
  auto get = [&](const std::string& name) {
    at::Tensor t = parameters.get(prefix + name);
    if (!t.defined() && missing.ok()) missing = Status::Error("the model has no parameter " + prefix + name);
    return t;
  };
  TransformerLayer l;
  l.input_norm = get(input_norm_name(spec.norms));
  l.qkv_weight = get("self_attention.linear_qkv.weight");
  if (spec.add_qkv_bias) l.qkv_bias = get("self_attention.linear_qkv.bias");
  if (spec.qk_layernorm) {
    l.q_norm = get("self_attention.q_layernorm.weight");
    l.k_norm = get("self_attention.k_layernorm.weight");
  }
  l.proj_weight = get("self_attention.linear_proj.weight");
  l.mlp_norm = get(pre_mlp_norm_name(spec.norms, false));
  l.fc1_weight = get("mlp.linear_fc1.weight");
  l.fc2_weight = get("mlp.linear_fc2.weight");
  TRESTLE_RETURN_IF_ERROR(missing);
  return l;
}

at::Tensor TransformerLayer::forward(const at::Tensor& x, const LayerContext& c) const {
  at::Tensor h = x + attention(rms_norm(x, input_norm, c.spec->norm_epsilon), c);
  return h + mlp(rms_norm(h, mlp_norm, c.spec->norm_epsilon), c);
}

at::Tensor TransformerLayer::attention(const at::Tensor& x, const LayerContext& c) const {
  const GptModelSpec& s = *c.spec;
  const std::int64_t d = s.kv_channels, per_group = s.num_attention_heads / s.num_query_groups;
  const std::int64_t groups = s.num_query_groups / c.group->size, heads = groups * per_group;
  at::Tensor qkv =
      fused_linear(enter_tp_region(x, c), qkv_weight, qkv_sink, qkv_bias);  // [s, b, groups·(per_group + 2)·d]
  const std::int64_t seq = qkv.size(0), batch = qkv.size(1);
  // Megatron's per-group order: each group's query heads, then its key head, then its value head.
  qkv = qkv.view({seq, batch, groups, per_group + 2, d});
  at::Tensor q = qkv.narrow(3, 0, per_group).reshape({seq, batch, heads, d});
  at::Tensor k = qkv.select(3, per_group);
  at::Tensor v = qkv.select(3, per_group + 1);
  if (q_norm.defined()) {
    q = rms_norm(q, q_norm, s.norm_epsilon);
    k = rms_norm(k, k_norm, s.norm_epsilon);
  }
  q = apply_rope(q, c.rope);
  k = apply_rope(k, c.rope);
  // [b, heads, s, d]; each group's key and value serve its per_group query heads.
  auto to_heads = [&](const at::Tensor& t) {
    return t.permute({1, 2, 0, 3})
        .unsqueeze(2)
        .expand({batch, groups, per_group, seq, d})
        .reshape({batch, heads, seq, d});
  };
  if (c.cp && c.cp->size > 1) {
    at::Tensor out = ring_attention(q.permute({1, 2, 0, 3}), k.permute({1, 2, 0, 3}), v.permute({1, 2, 0, 3}), *c.cp,
                                    1.0 / std::sqrt(static_cast<double>(d)), s.window_size);
    out = out.permute({2, 0, 1, 3}).reshape({seq, batch, heads * d});
    return leave_tp_region(fused_linear(out, proj_weight, proj_sink), c);
  }
  at::Tensor out =
      c.attention_mask
          ? at::scaled_dot_product_attention(q.permute({1, 2, 0, 3}), to_heads(k), to_heads(v), *c.attention_mask)
          : at::scaled_dot_product_attention(q.permute({1, 2, 0, 3}), to_heads(k), to_heads(v), {}, 0.0,
                                             /*is_causal=*/true);
  out = out.permute({2, 0, 1, 3}).reshape({seq, batch, heads * d});
  return leave_tp_region(fused_linear(out, proj_weight, proj_sink), c);
}

at::Tensor TransformerLayer::mlp(const at::Tensor& x, const LayerContext& c) const {
  at::Tensor fc1 = fused_linear(enter_tp_region(x, c), fc1_weight, fc1_sink);  // [gate_r; up_r] rows -> [.., 2·f/tp]
  auto gate_up = fc1.chunk(2, -1);
  return leave_tp_region(fused_linear(at::silu(gate_up[0]) * gate_up[1], fc2_weight, fc2_sink), c);
}

}  // namespace trestle::train
