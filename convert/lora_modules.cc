#include "convert/lora_modules.h"

#include <algorithm>
#include <map>
#include <set>
#include <string_view>
#include <tuple>

#include "convert/bridge/qkv.h"

namespace trestle {
namespace {

constexpr std::string_view kAdapter = ".adapter.";

// module -> (its target, its canonical parts with their B rows, the base's pieces), in lora_tensors()'s order.
struct ModuleShape {
  std::string module, target;
  bool routed_expert = false;
  std::vector<std::string> parts;
  std::vector<std::int64_t> part_rows;
  std::vector<std::pair<std::string, std::int64_t>> pieces;
};

Result<std::vector<ModuleShape>> module_shapes(const GptModelSpec& spec) {
  LoraConfig all;
  all.rank = 1;
  all.alpha = 1;
  all.type = LoraType::kCanonical;
  all.targets = model_lora_targets(spec);
  TRESTLE_ASSIGN_OR_RETURN(const auto tensors, lora_tensors(spec, all));
  std::vector<ModuleShape> out;
  for (const CanonicalTensor& t : tensors) {
    const std::size_t at = t.name.find(kAdapter);
    const std::string module = t.name.substr(0, at);
    if (out.empty() || out.back().module != module) {
      // Gemma 4's KV-sharing layers: the linear_qkv target adapts linear_q_proj (multi-latent attention's is its own).
      const std::string last = module.substr(module.rfind('.') + 1);
      const bool kv_sharing = last == "linear_q_proj" && !spec.multi_latent_attention();
      out.push_back({module, kv_sharing ? "linear_qkv" : last, t.expert >= 0, {}, {}, {}});
    }
    const std::string rest = t.name.substr(at + kAdapter.size());  // [adapter_q.]linear_out.weight[.<piece>]
    constexpr std::string_view kOut = "linear_out.weight";
    const std::size_t out_at = rest.find(kOut);
    if (out_at == std::string::npos) continue;
    const std::string piece = rest.size() > out_at + kOut.size() ? rest.substr(out_at + kOut.size() + 1) : "";
    if (!piece.empty()) out.back().pieces.emplace_back(piece, t.shape[0]);
    if (!rest.starts_with("adapter_")) continue;
    const std::string part = rest.substr(0, rest.find('.'));
    if (out.back().parts.empty() || out.back().parts.back() != part) {
      out.back().parts.push_back(part);
      out.back().part_rows.push_back(0);
    }
    out.back().part_rows.back() += t.shape[0];
  }
  return out;
}

// The module's name in the model transformers builds, which PEFT's keys and target_modules use, where the checkpoint
// saves it under another (transformers' conversion mapping): Gemma 3 with vision is saved as language_model.model.*,
// vision_tower.*, multi_modal_projector.* and built as model.language_model.*, model.vision_tower.*, ...; Nemotron-H
// is saved as backbone.* and built as model.*.
std::string built_module_name(const BridgeModel& model, const std::string& saved) {
  using Renames = std::vector<std::pair<std::string_view, std::string_view>>;
  static const std::map<std::string, Renames, std::less<>> kRenames{
      {"Gemma3ForConditionalGeneration",
       {{"language_model.model.", "model.language_model."},
        {"language_model.lm_head", "lm_head"},
        {"vision_tower.", "model.vision_tower."},
        {"multi_modal_projector.", "model.multi_modal_projector."}}},
      {"NemotronHForCausalLM", {{"backbone.", "model."}}},
  };
  const auto renames = kRenames.find(model.architecture);
  if (renames == kRenames.end()) return saved;
  for (const auto& [from, to] : renames->second)
    if (saved.starts_with(from)) return std::string(to) + saved.substr(from.size());
  return saved;
}

// Maps the rows of one run of a routed expert's weight onto its slice of a fused expert parameter [E, out, in] (or
// [E, in, out] for a transposed run): each Megatron row must be one output row of one expert's slice, its columns the
// slice's inputs in order.
void map_fused_expert_rows(const HfTensor& hf, const ElementRun& run, std::int64_t first_row, std::int64_t in,
                           HfLoraModule& module) {
  const bool transposed = run.order == RunOrder::kTransposed || run.order == RunOrder::kTransposedInterleavedHalves;
  const std::int64_t d1 = hf.shape[1], d2 = hf.shape[2], slice = d1 * d2;
  if ((transposed ? d1 : d2) != in || run.canonical_offset % in || run.count % in) {
    module.problem = "its rows are not whole output rows of " + hf.name + " " + to_string(hf.shape);
    return;
  }
  if (module.rows.empty()) module.rows.assign(static_cast<std::size_t>(transposed ? d2 : d1), -1);
  for (std::int64_t r = 0; r < run.count / in; ++r) {
    const std::int64_t first = run.hf_offset + run_hf_element(run, r * in);
    const std::int64_t last = run.hf_offset + run_hf_element(run, r * in + in - 1);
    const std::int64_t expert = first / slice, at = first % slice;
    const std::int64_t out_row = transposed ? at % d2 : at / d2, in_col = transposed ? at / d2 : at % d2;
    if (in_col != 0 || last - first != (in - 1) * (transposed ? d2 : 1) ||
        (module.expert >= 0 && module.expert != expert)) {
      module.problem = "its rows are not whole output rows of one expert's slice of " + hf.name;
      return;
    }
    module.expert = expert;
    module.rows[static_cast<std::size_t>(out_row)] = first_row + run.canonical_offset / in + r;
  }
}

// Adds the Hugging Face modules of one Megatron weight (or of its piece whose rows start at `row_offset`), from the
// plan's element runs: each must be whole rows of a 2-D Hugging Face tensor with the same columns, in order, or a
// routed expert's slice of a fused expert parameter. `index` maps the plan's Hugging Face tensors to m.hf across a
// weight's pieces.
void map_rows(const BridgeModel& model, const BridgeTensor& weight, std::int64_t row_offset, const BridgePlan& plan,
              std::map<std::size_t, std::size_t>& index, LoraModule& m) {
  for (const ElementRun& run : weight.runs) {
    const HfTensor& hf = plan.hf[run.hf_index];
    const bool fused_experts = hf.shape.size() == 3 && weight.expert >= 0;
    auto it = index.find(run.hf_index);
    if (it == index.end()) {
      it = index.emplace(run.hf_index, m.hf.size()).first;
      HfLoraModule module;
      module.name = built_module_name(model, hf_module_of_weight(hf.name));
      module.linear = hf.shape.size() == 2;
      if (fused_experts) {
        module.parameter = module.name;
        module.name = module.parameter.substr(0, module.parameter.rfind('.'));
        module.num_experts = hf.shape[0];
      } else if (hf.shape.size() != 2 || hf.shape[1] != m.in) {
        module.problem = "its Hugging Face weight " + hf.name + " is not [rows, " + std::to_string(m.in) + "] but " +
                         to_string(hf.shape);
      } else {
        module.rows.assign(static_cast<std::size_t>(hf.shape[0]), -1);
      }
      m.hf.push_back(std::move(module));
    }
    HfLoraModule& module = m.hf[it->second];
    if (!module.problem.empty()) continue;
    if (fused_experts) {
      map_fused_expert_rows(hf, run, row_offset, m.in, module);
      continue;
    }
    if (run.order != RunOrder::kSame || run.canonical_offset % m.in || run.count % m.in || run.hf_offset % m.in) {
      module.problem = "its rows are not whole rows of " + hf.name;
      continue;
    }
    for (std::int64_t r = 0; r < run.count / m.in; ++r)
      module.rows[static_cast<std::size_t>(run.hf_offset / m.in + r)] = row_offset + run.canonical_offset / m.in + r;
  }
}

// Checks every Hugging Face module's rows are all the weight's, and finds the canonical part they belong to.
void finish_rows(LoraModule& m) {
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
  if (m.target == "in_proj") {  // the parts' rows follow one another, as their pieces do
    std::int64_t at = 0;
    for (std::size_t p = 0; p < m.part_rows.size(); ++p)
      for (std::int64_t r = 0; r < m.part_rows[p] && at < m.out; ++r, ++at) {
        m.part_of_row[static_cast<std::size_t>(at)] = static_cast<int>(p);
        m.row_in_part[static_cast<std::size_t>(at)] = r;
      }
    if (at != m.out) m.problem = "its canonical parts do not cover its " + std::to_string(m.out) + " rows";
    return;
  }
  if (m.target == "linear_qkv" && spec.attention_output_gate) {
    // Gated attention: per group [queries; gates; key; value]; the q part holds each group's queries and gates.
    const std::int64_t layer = layer_of(m.module), d = spec.layer_kv_channels_of(layer),
                       groups = spec.layer_query_groups_of(layer), queries = 2 * spec.num_attention_heads / groups * d;
    std::int64_t at = 0;
    for (std::int64_t g = 0; g < groups; ++g)
      for (const auto& [part, rows, first] : {std::tuple{0, queries, g * queries}, {1, d, g * d}, {2, d, g * d}})
        for (std::int64_t r = 0; r < rows && at < m.out; ++r, ++at) {
          m.part_of_row[static_cast<std::size_t>(at)] = part;
          m.row_in_part[static_cast<std::size_t>(at)] = first + r;
        }
    if (at != m.out)
      m.problem = "its " + std::to_string(m.out) + " rows are not the layer's queries, gates, keys and values";
    return;
  }
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

namespace {

// The converter's plan with PEFT's per-expert linears where the architecture has them; where transformers has only
// fused experts, its fused parameters as transformers builds them ([E, 2I, H], whatever the files' layout).
Result<BridgePlan> peft_plan(const BridgedModel& model) {
  const ExpertLayout experts = !model.model.is_moe()                ? model.experts
                               : hf_experts_fused_only(model.model) ? ExpertLayout::kFused
                                                                    : ExpertLayout::kOriginal;
  auto plan = make_bridge_plan(model.model, model.norms, experts);
  if (!plan.ok()) plan = make_bridge_plan(model.model, model.norms, model.experts);
  return plan;
}

}  // namespace

Result<std::vector<std::string>> hf_modules(const BridgedModel& model) {
  TRESTLE_ASSIGN_OR_RETURN(const BridgePlan plan, peft_plan(model));
  std::set<std::string> out;
  for (const HfTensor& t : plan.hf) {
    const std::string name = built_module_name(model.model, t.name);
    for (std::size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1))
      out.insert(name.substr(0, dot));
  }
  // transformers builds lm_head in a tied model too (its weight the embedding's), though no file holds it.
  if (model.model.tied()) out.insert("lm_head");
  return std::vector<std::string>(out.begin(), out.end());
}

Result<std::vector<LoraModule>> lora_modules(const BridgedModel& model) {
  const GptModelSpec spec = megatron_spec(model.model, model.norms);
  auto plan = peft_plan(model);
  if (!plan.ok()) return plan.status();
  std::map<std::string, const BridgeTensor*> weights;
  for (const BridgeTensor& t : plan->tensors) weights[t.name] = &t;
  TRESTLE_ASSIGN_OR_RETURN(const auto shapes, module_shapes(spec));
  std::vector<LoraModule> out;
  for (const ModuleShape& s : shapes) {
    LoraModule m;
    m.module = s.module;
    m.target = s.target;
    m.routed_expert = s.routed_expert;
    m.parts = s.parts;
    m.part_rows = s.part_rows;
    m.pieces = s.pieces;
    // The weight, or its pieces in order, each 2-D with the same columns.
    std::vector<std::pair<const BridgeTensor*, std::int64_t>> stored;  // tensor, its first row
    std::vector<std::string> names;
    if (m.pieces.empty()) names.push_back(s.module + ".weight");
    for (const auto& [piece, rows] : m.pieces) names.push_back(s.module + ".weight." + piece);
    for (const std::string& name : names) {
      const auto it = weights.find(name);
      if (it == weights.end() || it->second->shape.size() != 2 ||
          (!stored.empty() && it->second->shape[1] != stored.front().first->shape[1])) {
        m.problem = "the converter's plan has no 2-D " + name + (stored.empty() ? "" : " of the same columns");
        break;
      }
      stored.emplace_back(it->second, m.out);
      m.out += it->second->shape[0];
    }
    if (!m.problem.empty()) {
      out.push_back(std::move(m));
      continue;
    }
    m.in = stored.front().first->shape[1];
    if (!m.parts.empty()) map_parts(spec, m);
    std::map<std::size_t, std::size_t> index;
    for (const auto& [tensor, first_row] : stored) map_rows(model.model, *tensor, first_row, *plan, index, m);
    finish_rows(m);
    out.push_back(std::move(m));
  }
  // transformers 5 builds the experts fused even where the files keep them per expert, and PEFT adapters saved on it
  // adapt the fused parameters (target_parameters): each routed expert also gets its slice of them.
  if (model.model.is_moe() && plan->experts == ExpertLayout::kOriginal) {
    const auto fused = make_bridge_plan(model.model, model.norms, ExpertLayout::kFused);
    if (!fused.ok()) return out;
    std::map<std::string, const BridgeTensor*> fused_weights;
    for (const BridgeTensor& t : fused->tensors)
      if (t.expert >= 0) fused_weights[t.name] = &t;
    for (LoraModule& m : out) {
      const auto it = fused_weights.find(m.module + ".weight");
      const bool has_slice =
          std::any_of(m.hf.begin(), m.hf.end(), [](const HfLoraModule& hf) { return !hf.parameter.empty(); });
      if (it == fused_weights.end() || has_slice || !m.problem.empty() || !m.pieces.empty()) continue;
      std::map<std::size_t, std::size_t> index;
      const std::size_t first = m.hf.size();
      map_rows(model.model, *it->second, 0, *fused, index, m);
      // Only the fused parameter's slice is the alternative; anything else the fused plan maps is not.
      m.hf.erase(std::remove_if(m.hf.begin() + static_cast<std::ptrdiff_t>(first), m.hf.end(),
                                [](const HfLoraModule& hf) { return hf.parameter.empty(); }),
                 m.hf.end());
      finish_rows(m);
    }
  }
  return out;
}

std::vector<const HfLoraModule*> peft_form(const LoraModule& m, bool fused_experts) {
  std::vector<const HfLoraModule*> linears, parameters;
  for (const HfLoraModule& hf : m.hf) (hf.parameter.empty() ? linears : parameters).push_back(&hf);
  if (fused_experts) return parameters.empty() ? linears : parameters;
  return linears.empty() ? parameters : linears;
}

}  // namespace trestle
