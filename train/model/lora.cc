#include "train/model/lora.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "train/model/tp_regions.h"

namespace trestle::train {
namespace {

at::Tensor adapter_input(const at::Tensor& x, const LoraForward& options) {
  if (options.dropout <= 0.0 || !at::GradMode::is_enabled()) return x;
  return at::dropout(x, options.dropout, /*train=*/true);
}

// The adapter on `module` (with parts `parts`) when `adapters` holds one.
Result<LoraAdapter> bind_adapter(const ModelParameters& adapters, const std::string& module,
                                 const std::vector<LoraPart>& parts) {
  LoraAdapter adapter;
  std::vector<std::string> names;
  std::size_t present = 0;
  for (const LoraPart& part : parts) {
    names.push_back(lora_tensor_name(module, part.name, true));
    adapter.a.push_back(adapters.get(names.back()));
    present += adapter.a.back().defined();
    adapter.b.emplace_back();
    for (const std::string& piece : part.pieces) {
      names.push_back(lora_tensor_name(module, part.name, false, piece));
      adapter.b.back().push_back(adapters.get(names.back()));
      present += adapter.b.back().back().defined();
    }
  }
  if (present == 0) return LoraAdapter();
  for (const std::string& name : names)
    if (!adapters.get(name).defined()) return Status::Error("the adapters lack " + name);
  return adapter;
}

}  // namespace

Result<LayerAdapters> bind_layer_adapters(const ModelParameters& adapters, const GptModelSpec& spec, std::int64_t layer,
                                          LoraType type, std::int64_t first_expert, std::int64_t experts) {
  LayerAdapters out;
  const std::string prefix = "decoder.layers." + std::to_string(layer) + ".";
  auto bind = [&](const std::string& module, const std::string& target, bool routed_expert = false) {
    return bind_adapter(adapters, prefix + module,
                        lora_parts(spec, layer, target, module_lora_type(type, routed_expert)));
  };
  if (spec.layer_is_linear_attention(layer) || spec.hybrid_layer(layer) == 'M') {
    const std::string mixer = spec.hybrid() ? "mixer." : "self_attention.";
    TRESTLE_ASSIGN_OR_RETURN(out.qkv, bind(mixer + "in_proj", "in_proj"));
    TRESTLE_ASSIGN_OR_RETURN(out.proj, bind(mixer + "out_proj", "out_proj"));
  } else if (spec.multi_latent_attention()) {
    const std::string a = "self_attention.";
    TRESTLE_ASSIGN_OR_RETURN(out.q_proj, bind(a + "linear_q_proj", "linear_q_proj"));
    TRESTLE_ASSIGN_OR_RETURN(out.q_down, bind(a + "linear_q_down_proj", "linear_q_down_proj"));
    TRESTLE_ASSIGN_OR_RETURN(out.q_up, bind(a + "linear_q_up_proj", "linear_q_up_proj"));
    TRESTLE_ASSIGN_OR_RETURN(out.kv_down, bind(a + "linear_kv_down_proj", "linear_kv_down_proj"));
    TRESTLE_ASSIGN_OR_RETURN(out.kv_up, bind(a + "linear_kv_up_proj", "linear_kv_up_proj"));
    TRESTLE_ASSIGN_OR_RETURN(out.proj, bind(a + "linear_proj", "linear_proj"));
  } else {
    const char* qkv = spec.layer_kv_shared(layer) ? "self_attention.linear_q_proj" : "self_attention.linear_qkv";
    TRESTLE_ASSIGN_OR_RETURN(out.qkv, bind(qkv, "linear_qkv"));
    TRESTLE_ASSIGN_OR_RETURN(out.proj, bind("self_attention.linear_proj", "linear_proj"));
  }
  TRESTLE_ASSIGN_OR_RETURN(out.fc1, bind("mlp.linear_fc1", "linear_fc1"));
  TRESTLE_ASSIGN_OR_RETURN(out.fc2, bind("mlp.linear_fc2", "linear_fc2"));
  TRESTLE_ASSIGN_OR_RETURN(out.shared_fc1, bind("mlp.shared_experts.linear_fc1", "linear_fc1"));
  TRESTLE_ASSIGN_OR_RETURN(out.shared_fc2, bind("mlp.shared_experts.linear_fc2", "linear_fc2"));
  for (std::int64_t e = first_expert; e < first_expert + experts; ++e) {
    const std::string expert = "mlp.experts.local_experts." + std::to_string(e) + ".";
    TRESTLE_ASSIGN_OR_RETURN(auto fc1, bind(expert + "linear_fc1", "linear_fc1", true));
    TRESTLE_ASSIGN_OR_RETURN(auto fc2, bind(expert + "linear_fc2", "linear_fc2", true));
    if (!fc1.defined() && !fc2.defined()) continue;
    out.expert_fc1.push_back(std::move(fc1));
    out.expert_fc2.push_back(std::move(fc2));
  }
  if (!out.expert_fc1.empty() && static_cast<std::int64_t>(out.expert_fc1.size()) != experts)
    return Status::Error("layer " + std::to_string(layer) + ": some of its local experts lack adapters");
  return out;
}

at::Tensor LoraAdapter::out_weight(std::size_t p) const { return b[p].size() == 1 ? b[p][0] : at::cat(b[p]); }

at::Tensor lora_column_output(const LoraAdapter& adapter, const at::Tensor& x, const TpGroup& group,
                              const LoraForward& options, const QkvParts* qkv) {
  std::vector<at::Tensor> outputs;
  for (std::size_t p = 0; p < adapter.a.size(); ++p) {
    const at::Tensor low = gather_last_dim(at::linear(adapter_input(x, options), adapter.a[p]), group);
    outputs.push_back(at::linear(low, adapter.out_weight(p)));
  }
  at::Tensor out;
  if (outputs.size() == 1) {
    out = outputs[0];
  } else if (qkv) {
    // [.., groups · per_group · d], [.., groups · d] x 2 -> each group's q heads, k head, v head.
    auto sizes = outputs[0].sizes().vec();
    sizes.pop_back();
    auto grouped = [&](const at::Tensor& t, std::int64_t width) {
      auto shape = sizes;
      shape.push_back(qkv->groups);
      shape.push_back(width);
      return t.reshape(shape);
    };
    const std::int64_t d = qkv->head_dim;
    std::vector<at::Tensor> per_group{grouped(outputs[0], qkv->heads_per_group * d * (qkv->gated ? 2 : 1))};
    for (std::size_t p = 1; p < outputs.size(); ++p) per_group.push_back(grouped(outputs[p], d));
    out = at::cat(per_group, -1).flatten(-2);
  } else {
    out = at::cat(outputs, -1);
  }
  return out * options.scale;
}

at::Tensor lora_local_output(const LoraAdapter& adapter, const at::Tensor& x, const LoraForward& options) {
  return at::linear(at::linear(adapter_input(x, options), adapter.a[0]), adapter.out_weight(0)) * options.scale;
}

at::Tensor lora_row_output(const LoraAdapter& adapter, const at::Tensor& x, const TpGroup& group,
                           bool sequence_parallel, const LoraForward& options) {
  const at::Tensor partial = at::linear(adapter_input(x, options), adapter.a[0]);
  const at::Tensor low =
      sequence_parallel ? reduce_scatter_to_sequence(partial, group) : reduce_from_tp(partial, group);
  return at::linear(low, adapter.out_weight(0)) * options.scale;
}

}  // namespace trestle::train
