#include "convert/lora_modules.h"

#include <map>

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
    if (out.empty() || out.back().module != module)
      out.push_back({module, module.substr(module.rfind('.') + 1), {}, {}});
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
      HfLoraModule module{hf_module_of_weight(hf.name), {}, -1, {}};
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

void map_parts(const GptModelSpec& spec, LoraModule& m) {
  m.part_of_row.assign(static_cast<std::size_t>(m.out), 0);
  m.row_in_part.assign(static_cast<std::size_t>(m.out), 0);
  if (m.target == "linear_qkv") {
    const QkvLayout qkv{spec.num_attention_heads, spec.num_query_groups, spec.kv_channels};
    for (const QkvBlock& b : qkv_blocks(qkv))
      for (std::int64_t r = 0; r < b.rows; ++r) {
        m.part_of_row[static_cast<std::size_t>(b.fused_row + r)] = static_cast<int>(b.part);
        m.row_in_part[static_cast<std::size_t>(b.fused_row + r)] = b.part_row + r;
      }
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
