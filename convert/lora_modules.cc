#include "convert/lora_modules.h"

#include <map>
#include <string_view>

#include "convert/bridge/qkv.h"

namespace trestle {
namespace {

constexpr std::string_view kAdapter = ".adapter.";

// module -> (its target, its canonical parts with their B rows), in lora_tensors()'s order.
struct ModuleShape {
  std::string module, target;
  std::vector<std::string> parts;
  std::vector<std::int64_t> part_rows;
};

Result<std::vector<ModuleShape>> module_shapes(const GptModelSpec& spec) {
  LoraConfig all;
  all.rank = 1;
  all.alpha = 1;
  all.type = LoraType::kCanonical;
  if (spec.multi_latent_attention()) all.targets = {"linear_proj", "linear_fc1", "linear_fc2"};
  TRESTLE_ASSIGN_OR_RETURN(const auto tensors, lora_tensors(spec, all));
  std::vector<ModuleShape> out;
  for (const CanonicalTensor& t : tensors) {
    const std::size_t at = t.name.find(kAdapter);
    const std::string module = t.name.substr(0, at);
    if (out.empty() || out.back().module != module) {
      // Gemma 4's KV-sharing layers: the linear_qkv target adapts linear_q_proj.
      const std::string last = module.substr(module.rfind('.') + 1);
      out.push_back({module, last == "linear_q_proj" ? "linear_qkv" : last, {}, {}});
    }
    const std::string rest = t.name.substr(at + kAdapter.size());  // [adapter_q.]linear_out.weight
    if (!rest.starts_with("adapter_") || !rest.ends_with("linear_out.weight")) continue;
    out.back().parts.push_back(rest.substr(0, rest.find('.')));
    out.back().part_rows.push_back(t.shape[0]);
  }
  return out;
}

// The Hugging Face modules of one Megatron weight, from the plan's element runs: each must be whole rows of a 2-D
// Hugging Face tensor with the same columns, in order.
void map_rows(const BridgeTensor& weight, const BridgePlan& plan, LoraModule& m) {
  std::map<std::size_t, std::size_t> index;  // hf tensor -> m.hf
  for (const ElementRun& run : weight.runs) {
    const HfTensor& hf = plan.hf[run.hf_index];
    auto it = index.find(run.hf_index);
    if (it == index.end()) {
      it = index.emplace(run.hf_index, m.hf.size()).first;
      HfLoraModule module{hf_module_of_weight(hf.name), {}, -1, hf.shape.size() == 2, {}};
      if (hf.shape.size() != 2 || hf.shape[1] != m.in)
        module.problem = "its Hugging Face weight " + hf.name + " is not [rows, " + std::to_string(m.in) + "] but " +
                         to_string(hf.shape) + " (fused experts: PEFT adapts the per-expert layout)";
      else module.rows.assign(static_cast<std::size_t>(hf.shape[0]), -1);
      m.hf.push_back(std::move(module));
    }
    HfLoraModule& module = m.hf[it->second];
    if (!module.problem.empty()) continue;
    if (run.order != RunOrder::kSame || run.canonical_offset % m.in || run.count % m.in || run.hf_offset % m.in) {
      module.problem = "its rows are not whole rows of " + hf.name;
      continue;
    }
    for (std::int64_t r = 0; r < run.count / m.in; ++r)
      module.rows[static_cast<std::size_t>(run.hf_offset / m.in + r)] = run.canonical_offset / m.in + r;
  }
  for (HfLoraModule& module : m.hf) {
    if (!module.problem.empty()) continue;
    for (const std::int64_t row : module.rows)
      if (row < 0) {
        module.problem = "its Hugging Face weight also holds rows of other Megatron tensors";
        break;
      }
    if (!module.problem.empty() || m.parts.empty()) continue;
    module.part = m.part_of_row[static_cast<std::size_t>(module.rows[0])];
    for (const std::int64_t row : module.rows)
      if (m.part_of_row[static_cast<std::size_t>(row)] != module.part) module.part = -1;
  }
}

// The decoder layer of a module named decoder.layers.<i>.…; -1 for others.
std::int64_t layer_of(const std::string& module) {
  constexpr std::string_view kLayers = "decoder.layers.";
  if (!module.starts_with(kLayers)) return -1;
  std::int64_t layer = 0;
  for (std::size_t i = kLayers.size(); i < module.size() && module[i] != '.'; ++i) {
    if (module[i] < '0' || module[i] > '9') return -1;
    layer = layer * 10 + (module[i] - '0');
  }
  return layer;
}

void map_parts(const GptModelSpec& spec, LoraModule& m) {
  m.part_of_row.assign(static_cast<std::size_t>(m.out), 0);
  m.row_in_part.assign(static_cast<std::size_t>(m.out), 0);
  if (m.target == "linear_qkv") {
    // The layer's own attention sizes (Gemma 4); its per-group [queries; key] where the keys are the values, its
    // queries alone in a KV-sharing layer's linear_q_proj.
    const std::int64_t layer = layer_of(m.module);
    if (spec.layer_kv_shared(layer)) {
      for (std::int64_t r = 0; r < m.out; ++r) m.row_in_part[static_cast<std::size_t>(r)] = r;
      return;
    }
    const QkvLayout qkv{spec.num_attention_heads, spec.layer_query_groups_of(layer), spec.layer_kv_channels_of(layer)};
    const bool values = !spec.layer_k_eq_v(layer);
    std::int64_t at = 0;
    for (const QkvBlock& b : qkv_blocks(qkv)) {
      if (!values && b.part == QkvPart::kValue) continue;
      for (std::int64_t r = 0; r < b.rows && at + r < m.out; ++r) {
        m.part_of_row[static_cast<std::size_t>(at + r)] = static_cast<int>(b.part);
        m.row_in_part[static_cast<std::size_t>(at + r)] = b.part_row + r;
      }
      at += b.rows;
    }
    if (at != m.out)
      m.problem = "its " + std::to_string(m.out) + " rows are not the layer's queries, keys and values (" +
                  std::to_string(at) + ")";
    return;
  }
  const std::int64_t half = m.out / 2;  // linear_fc1: [gate; up]
  for (std::int64_t r = 0; r < m.out; ++r) {
    m.part_of_row[static_cast<std::size_t>(r)] = r < half ? 0 : 1;
    m.row_in_part[static_cast<std::size_t>(r)] = r < half ? r : r - half;
  }
}

}  // namespace

std::string hf_module_of_weight(const std::string& weight) {
  return weight.ends_with(".weight") ? weight.substr(0, weight.size() - 7) : weight;
}

Result<std::vector<LoraModule>> lora_modules(const BridgedModel& model) {
  const GptModelSpec spec = megatron_spec(model.model, model.norms);
  // PEFT adapts per-expert linears: plan with that layout when the architecture has it.
  auto plan =
      make_bridge_plan(model.model, model.norms, model.model.is_moe() ? ExpertLayout::kOriginal : model.experts);
  if (!plan.ok()) plan = make_bridge_plan(model.model, model.norms, model.experts);
  if (!plan.ok()) return plan.status();
  std::map<std::string, const BridgeTensor*> weights;
  for (const BridgeTensor& t : plan->tensors) weights[t.name] = &t;
  TRESTLE_ASSIGN_OR_RETURN(const auto shapes, module_shapes(spec));
  std::vector<LoraModule> out;
  for (const ModuleShape& s : shapes) {
    LoraModule m;
    m.module = s.module;
    m.target = s.target;
    m.parts = s.parts;
    m.part_rows = s.part_rows;
    const auto it = weights.find(s.module + ".weight");
    if (it == weights.end() || it->second->shape.size() != 2) {
      m.problem = "the converter's plan has no 2-D " + s.module + ".weight";
      out.push_back(std::move(m));
      continue;
    }
    m.out = it->second->shape[0];
    m.in = it->second->shape[1];
    if (!m.parts.empty()) map_parts(spec, m);
    map_rows(*it->second, *plan, m);
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace trestle
