#include "train/model/lora.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "train/model/tp_regions.h"

namespace trestle::train {
namespace {

// The parts of a target's adapter for `type` ("" when one adapter covers the fused linear).
std::vector<std::string> parts_of(const std::string& target, LoraType type) {
  if (type == LoraType::kCanonical && target == "linear_qkv") return {"adapter_q", "adapter_k", "adapter_v"};
  if (type == LoraType::kCanonical && target == "linear_fc1") return {"adapter_gate", "adapter_up"};
  return {""};
}

at::Tensor adapter_input(const at::Tensor& x, const LoraForward& options) {
  if (options.dropout <= 0.0 || !at::GradMode::is_enabled()) return x;
  return at::dropout(x, options.dropout, /*train=*/true);
}

}  // namespace

Result<LayerAdapters> bind_layer_adapters(const ModelParameters& adapters, std::int64_t layer, LoraType type) {
  LayerAdapters out;
  const std::string prefix = "decoder.layers." + std::to_string(layer) + ".";
  for (const auto& [target, adapter] :
       {std::pair{"linear_qkv", &out.qkv}, {"linear_proj", &out.proj}, {"linear_fc1", &out.fc1},
        {"linear_fc2", &out.fc2}}) {
    const std::string module =
        prefix + (std::string(target) == "linear_qkv" || std::string(target) == "linear_proj" ? "self_attention."
                                                                                              : "mlp.") +
        target;
    std::vector<at::Tensor> a, b;
    for (const std::string& part : parts_of(target, type)) {
      a.push_back(adapters.get(lora_tensor_name(module, part, true)));
      b.push_back(adapters.get(lora_tensor_name(module, part, false)));
    }
    std::size_t present = 0;
    for (std::size_t i = 0; i < a.size(); ++i) present += a[i].defined() + b[i].defined();
    if (present == 0) continue;
    if (present != 2 * a.size()) {
      for (const std::string& part : parts_of(target, type))
        for (const bool in : {true, false})
          if (!adapters.get(lora_tensor_name(module, part, in)).defined())
            return Status::Error("the adapters lack " + lora_tensor_name(module, part, in));
    }
    adapter->a = std::move(a);
    adapter->b = std::move(b);
  }
  return out;
}

at::Tensor lora_column_output(const LoraAdapter& adapter, const at::Tensor& x, const TpGroup& group,
                              const LoraForward& options, const QkvParts* qkv) {
  std::vector<at::Tensor> outputs;
  for (std::size_t p = 0; p < adapter.a.size(); ++p) {
    const at::Tensor low = gather_last_dim(at::linear(adapter_input(x, options), adapter.a[p]), group);
    outputs.push_back(at::linear(low, adapter.b[p]));
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
    out = at::cat({grouped(outputs[0], qkv->heads_per_group * d), grouped(outputs[1], d), grouped(outputs[2], d)}, -1)
              .flatten(-2);
  } else {
    out = at::cat(outputs, -1);
  }
  return out * options.scale;
}

at::Tensor lora_row_output(const LoraAdapter& adapter, const at::Tensor& x, const TpGroup& group,
                           bool sequence_parallel, const LoraForward& options) {
  const at::Tensor partial = at::linear(adapter_input(x, options), adapter.a[0]);
  const at::Tensor low =
      sequence_parallel ? reduce_scatter_to_sequence(partial, group) : reduce_from_tp(partial, group);
  return at::linear(low, adapter.b[0]) * options.scale;
}

}  // namespace trestle::train
