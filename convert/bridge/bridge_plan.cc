#include "convert/bridge/bridge_plan.h"

#include <algorithm>

#include "convert/bridge/qkv.h"

namespace trestle {
namespace {

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
}

struct Names {
  std::int64_t layer = -1;  // on the Hugging Face side; model.layers.{num_layers + k} for multi-token prediction
  std::int64_t expert = -1;
  NormNaming norms = NormNaming::kTransformerEngine;
  bool moe = false;  // this layer's MLP is a mixture of experts
  std::int64_t mtp = -1;
  bool linear = false;  // this layer is a Gated DeltaNet one
  char hybrid = 0;      // Nemotron-H: this layer's mixer (M, * or -)
  bool kv_shared = false;  // Gemma 4: this layer reuses an earlier layer's keys and values
  bool k_eq_v = false;     // Gemma 4: this layer's keys are its values
};

// The query / key / value sizes of Hugging Face layer `layer` (Gemma 4's differ by layer).
QkvLayout qkv_layout(const BridgeModel& m, std::int64_t layer) {
  QkvLayout qkv{m.hf.num_attention_heads, m.hf.num_kv_heads, m.hf.head_dim};
  if (layer >= 0 && layer < static_cast<std::int64_t>(m.layer_head_dim.size())) {
    qkv.head_dim = m.layer_head_dim[static_cast<std::size_t>(layer)];
    qkv.num_groups = m.layer_kv_heads[static_cast<std::size_t>(layer)];
  }
  return qkv;
}

std::string expand(std::string name, const Names& n) {
  if (n.mtp >= 0) {
    replace_all(name, "decoder.layers.{i}.", "mtp.layers.{k}.transformer_layer.");
    replace_all(name, "{k}", std::to_string(n.mtp));
  }
  const bool te = n.norms == NormNaming::kTransformerEngine;
  replace_all(name, "{input_norm}", input_norm_name(n.norms));
  replace_all(name, "{pre_mlp_norm}", pre_mlp_norm_name(n.norms, n.moe));
  replace_all(name, "{linear_input_norm}", linear_attention_input_norm_name(n.norms));
  replace_all(name, "{mamba_norm}", te ? "mixer.in_proj.layer_norm_weight" : "norm.weight");
  replace_all(name, "{q_norm}", te ? "self_attention.linear_q_up_proj.layer_norm_weight" : "self_attention.q_layernorm.weight");
  replace_all(name, "{kv_norm}",
              te ? "self_attention.linear_kv_up_proj.layer_norm_weight" : "self_attention.kv_layernorm.weight");
  if (n.layer >= 0) replace_all(name, "{i}", std::to_string(n.layer));
  if (n.expert >= 0) replace_all(name, "{e}", std::to_string(n.expert));
  return name;
}

// A Gated DeltaNet's projection sizes in rows.
struct GdnRows {
  std::int64_t key_heads, keys, values, value_heads, ratio;  // ratio: value heads per key head
  explicit GdnRows(const BridgeModel& m)
      : key_heads(m.linear_num_key_heads),
        keys(m.linear_num_key_heads * m.linear_key_head_dim),
        values(m.linear_num_value_heads * m.linear_value_head_dim),
        value_heads(m.linear_num_value_heads),
        ratio(m.linear_num_value_heads / m.linear_num_key_heads) {}
};

// A Mamba-2 mixer's projection sizes in rows: in_proj makes [z; x; B; C; dt], conv1d runs over [x; B; C].
struct MambaRows {
  std::int64_t inner, groups, heads;  // z and x; B and C; dt
  explicit MambaRows(const BridgeModel& m)
      : inner(m.mamba_num_heads * m.mamba_head_dim),
        groups(m.mamba_num_groups * m.mamba_state_dim),
        heads(m.mamba_num_heads) {}
};

// The Hugging Face shapes of a rule's sources, given the canonical shape.
std::vector<Shape> source_shapes(const BridgeModel& m, Fusion fusion, const Shape& canonical, const QkvLayout& qkv) {
  const Shape rest(canonical.begin() + (canonical.empty() ? 0 : 1), canonical.end());  // (a 0-dim tensor: none)
  auto with_rows = [&](std::int64_t rows) {
    Shape s{rows};
    s.insert(s.end(), rest.begin(), rest.end());
    return s;
  };
  switch (fusion) {
    case Fusion::kCopy:
    case Fusion::kFusedQkv:
      return {canonical};
    case Fusion::kTransposed:
      return {{canonical[1], canonical[0]}};
    case Fusion::kQkv:
      return {with_rows(qkv.query_rows()), with_rows(qkv.kv_rows()), with_rows(qkv.kv_rows())};
    case Fusion::kQk:
      return {with_rows(qkv.query_rows()), with_rows(qkv.kv_rows())};
    case Fusion::kGated:
      return {with_rows(canonical[0] / 2), with_rows(canonical[0] / 2)};
    case Fusion::kExpertSlice:
    case Fusion::kExpertSliceInterleaved: {
      Shape s{m.hf.num_experts};
      s.insert(s.end(), canonical.begin(), canonical.end());
      return {s};
    }
    case Fusion::kExpertSliceTransposed:
    case Fusion::kExpertSliceTransposedInterleaved:
      return {{m.hf.num_experts, canonical[1], canonical[0]}};
    case Fusion::kGatedQkv: {
      return {with_rows(2 * qkv.query_rows()), with_rows(qkv.kv_rows()), with_rows(qkv.kv_rows())};
    }
    case Fusion::kGdnQkvz: {
      const GdnRows g(m);
      return {with_rows(2 * g.keys + 2 * g.values)};
    }
    case Fusion::kGdnBa:
      return {with_rows(2 * GdnRows(m).value_heads)};
    case Fusion::kGdnQkv: {
      const GdnRows g(m);
      return {with_rows(2 * g.keys + g.values)};
    }
    case Fusion::kMambaInProj: {
      const MambaRows r(m);
      return {with_rows(2 * r.inner + 2 * r.groups + r.heads)};
    }
    case Fusion::kMambaConv: {
      const MambaRows r(m);
      return {with_rows(r.inner + 2 * r.groups)};
    }
  }
  return {};
}

// The element runs of one transformation; `sources` are indices into plan.hf in the rule's order.
std::vector<ElementRun> fusion_runs(const BridgeModel& m, Fusion fusion, const Shape& canonical,
                                    const std::vector<std::size_t>& sources, std::int64_t expert, int part,
                                    const QkvLayout& qkv) {
  const std::int64_t total = numel(canonical);
  const std::int64_t row = canonical.empty() || canonical[0] == 0 ? 1 : total / canonical[0];
  // Per key head (Qwen3-Next's fused projections): block `rows` rows of which the part takes `take` from `at`.
  auto per_key_head = [&](std::int64_t rows, std::int64_t at, std::int64_t take) {
    std::vector<ElementRun> runs;
    for (std::int64_t h = 0; h < m.linear_num_key_heads; ++h)
      runs.push_back({sources[0], (h * rows + at) * row, h * take * row, take * row});
    return runs;
  };
  switch (fusion) {
    case Fusion::kGatedQkv: {
      // Per group: its heads' queries, their gates, the key, the value; q_proj holds each head's query then gate.
      const std::int64_t d = m.hf.head_dim, groups = m.hf.num_kv_heads, heads = m.hf.num_attention_heads / groups;
      std::vector<ElementRun> runs;
      for (std::int64_t g = 0, at = 0; g < groups; ++g) {
        for (const std::int64_t half : {0, 1})
          for (std::int64_t j = 0; j < heads; ++j, at += d)
            runs.push_back({sources[0], ((g * heads + j) * 2 * d + half * d) * row, at * row, d * row});
        for (const std::size_t kv : {1, 2}) {
          runs.push_back({sources[kv], g * d * row, at * row, d * row});
          at += d;
        }
      }
      return runs;
    }
    case Fusion::kGdnQkvz: {  // per key head [q (dk); k (dk); v (ratio dv); z (ratio dv)]
      const GdnRows g(m);
      const std::int64_t dk = g.keys / g.key_heads, dv = g.values / g.key_heads;
      const std::int64_t at[] = {0, dk, 2 * dk, 2 * dk + dv}, take[] = {dk, dk, dv, dv};
      return per_key_head(2 * dk + 2 * dv, at[part], take[part]);
    }
    case Fusion::kGdnBa: {  // per key head [beta (ratio); alpha (ratio)]
      const GdnRows g(m);
      return per_key_head(2 * g.ratio, part * g.ratio, g.ratio);
    }
    case Fusion::kGdnQkv: {  // [all q; all k; all v]
      const GdnRows g(m);
      const std::int64_t at[] = {0, g.keys, 2 * g.keys};
      return {{sources[0], at[part] * row, 0, total}};
    }
    case Fusion::kMambaInProj: {  // [z; x; B; C; dt]
      const MambaRows r(m);
      const std::int64_t at[] = {0, r.inner, 2 * r.inner, 2 * r.inner + r.groups, 2 * r.inner + 2 * r.groups};
      return {{sources[0], at[part] * row, 0, total}};
    }
    case Fusion::kMambaConv: {  // [x; B; C]
      const MambaRows r(m);
      const std::int64_t at[] = {0, r.inner, r.inner + r.groups};
      return {{sources[0], at[part] * row, 0, total}};
    }
    case Fusion::kCopy:
      return {{sources[0], 0, 0, total}};
    case Fusion::kTransposed:
      return {{sources[0], 0, 0, total, RunOrder::kTransposed, canonical[0], canonical[1]}};
    case Fusion::kQkv: {
      std::vector<ElementRun> runs;
      for (const auto& b : qkv_blocks(qkv))
        runs.push_back({sources[static_cast<std::size_t>(b.part)], b.part_row * row, b.fused_row * row, b.rows * row});
      return runs;
    }
    case Fusion::kQk: {  // per group: its heads' queries, then its key
      const std::int64_t d = qkv.head_dim, heads = qkv.heads_per_group();
      std::vector<ElementRun> runs;
      for (std::int64_t g = 0, at = 0; g < qkv.num_groups; ++g) {
        runs.push_back({sources[0], g * heads * d * row, at * row, heads * d * row});
        at += heads * d;
        runs.push_back({sources[1], g * d * row, at * row, d * row});
        at += d;
      }
      return runs;
    }
    case Fusion::kFusedQkv: {  // the parts stacked [q; k; v] in one tensor
      const std::int64_t part_start[] = {0, qkv.query_rows(), qkv.query_rows() + qkv.kv_rows()};
      std::vector<ElementRun> runs;
      for (const auto& b : qkv_blocks(qkv))
        runs.push_back({sources[0], (part_start[static_cast<std::size_t>(b.part)] + b.part_row) * row,
                        b.fused_row * row, b.rows * row});
      return runs;
    }
    case Fusion::kGated:
      return {{sources[0], 0, 0, total / 2}, {sources[1], 0, total / 2, total / 2}};
    case Fusion::kExpertSlice:
      return {{sources[0], expert * total, 0, total}};
    case Fusion::kExpertSliceTransposed:
    case Fusion::kExpertSliceTransposedInterleaved:
    case Fusion::kExpertSliceInterleaved: {
      const RunOrder order = fusion == Fusion::kExpertSliceTransposed   ? RunOrder::kTransposed
                             : fusion == Fusion::kExpertSliceInterleaved ? RunOrder::kInterleavedHalves
                                                                         : RunOrder::kTransposedInterleavedHalves;
      const std::int64_t rows = canonical[0], cols = canonical.size() > 1 ? canonical[1] : 1;
      return {{sources[0], expert * total, 0, total, order, rows, cols}};
    }
  }
  return {};
}

bool applies(const TensorRule& rule, const BridgeModel& m, ExpertLayout experts, const Names& n) {
  switch (rule.when) {
    case Condition::kDenseLayer:
      return !n.moe;
    case Condition::kMoeLayer:
      return n.moe;
    case Condition::kQLora:
      return m.q_lora_rank > 0;
    case Condition::kNoQLora:
      return m.q_lora_rank == 0;
    case Condition::kQkvBias:
      return m.qkv_bias;
    case Condition::kQkNorm:
      return m.qk_norm;
    case Condition::kLinearAttentionLayer:
      return n.linear;
    case Condition::kFullAttentionLayer:
      return !n.linear;
    case Condition::kMambaLayer:
      return n.hybrid == 'M';
    case Condition::kAttentionOnlyLayer:
      return n.hybrid == '*';
    case Condition::kMlpOnlyLayer:
      return n.hybrid == '-';
    case Condition::kLatentMoe:
      return n.moe && m.moe_latent_size > 0;
    case Condition::kKvLayer:
      return !n.kv_shared;
    case Condition::kKvSharedLayer:
      return n.kv_shared;
    case Condition::kValueLayer:
      return !n.kv_shared && !n.k_eq_v;
    case Condition::kKEqVLayer:
      return n.k_eq_v;
    case Condition::kPerLayerInputs:
      return m.per_layer_input_size > 0;
    case Condition::kAlways:
      return true;
    case Condition::kUntied:
      return !m.tied();
    case Condition::kOriginalExperts:
      return n.moe && experts == ExpertLayout::kOriginal;
    case Condition::kSharedExpert:
      return n.moe && m.shared_expert_ffn_hidden_size > 0;
    case Condition::kFusedExperts:
      return n.moe && experts == ExpertLayout::kFused;
    case Condition::kFusedTransposedExperts:
      return n.moe && experts == ExpertLayout::kFusedTransposed;
  }
  return false;
}

// Every Hugging Face tensor must be covered by the plan's runs exactly once.
Status check_hf_coverage(const BridgePlan& plan) {
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> covered(plan.hf.size());
  for (const auto& t : plan.tensors)
    for (const auto& r : t.runs) covered[r.hf_index].emplace_back(r.hf_offset, r.count);
  for (std::size_t i = 0; i < plan.hf.size(); ++i) {
    auto& runs = covered[i];
    std::sort(runs.begin(), runs.end());
    std::int64_t next = 0;
    for (const auto& [offset, count] : runs) {
      if (offset != next)
        return Status::Error("plan error: '" + plan.hf[i].name + "' elements from " + std::to_string(next) + " are " +
                             (offset < next ? "used twice" : "never used"));
      next = offset + count;
    }
    if (next != numel(plan.hf[i].shape))
      return Status::Error("plan error: '" + plan.hf[i].name + "' is not used whole");
  }
  return OkStatus();
}

}  // namespace

std::int64_t run_hf_element(const ElementRun& run, std::int64_t k) {
  if (run.order == RunOrder::kSame) return k;
  const std::int64_t r = k / run.cols, c = k % run.cols, half = run.rows / 2;
  const std::int64_t row = run.order == RunOrder::kTransposed ? r : (r < half ? 2 * r : 2 * (r - half) + 1);
  return run.order == RunOrder::kInterleavedHalves ? row * run.cols + c : c * run.rows + row;
}

std::string_view expert_layout_name(ExpertLayout layout) {
  switch (layout) {
    case ExpertLayout::kFused:
      return "fused";
    case ExpertLayout::kFusedTransposed:
      return "fused_transposed";
    case ExpertLayout::kOriginal:
      break;
  }
  return "original";
}

std::optional<ExpertLayout> expert_layout_from_name(std::string_view name) {
  for (const ExpertLayout layout : {ExpertLayout::kOriginal, ExpertLayout::kFused, ExpertLayout::kFusedTransposed})
    if (expert_layout_name(layout) == name) return layout;
  return std::nullopt;
}

ExpertLayout detect_expert_layout(const BridgeModel& model, const std::map<std::string, Shape>& hf_tensors) {
  const Shape* gate_up = nullptr;
  const Shape* down = nullptr;
  for (const auto& [name, shape] : hf_tensors) {
    if (!gate_up && name.ends_with(".experts.gate_up_proj")) gate_up = &shape;
    if (!down && name.ends_with(".experts.down_proj")) down = &shape;
  }
  if (!gate_up) return ExpertLayout::kOriginal;
  // GPT-OSS's fused experts are always stored transposed and interleaved: its rules say so, whatever the layout.
  if (model.gpt_oss() || !down || down->size() != 3 || gate_up->size() != 3) return ExpertLayout::kFused;
  const std::int64_t h = model.hf.hidden_size;
  const bool transposed = (*down)[1] != (*down)[2] ? (*down)[2] == h && (*down)[1] != h : (*gate_up)[1] == h;
  return transposed ? ExpertLayout::kFusedTransposed : ExpertLayout::kFused;
}

bool is_ignored_hf_tensor(const std::string& name) { return name.ends_with("rotary_emb.inv_freq"); }

Result<BridgePlan> make_bridge_plan(const BridgeModel& m, NormNaming norms, ExpertLayout experts) {
  BridgePlan plan;
  plan.experts = experts;
  auto listed = canonical_tensors(megatron_spec(m, norms));  // (its bounds' errors name the config they came from)
  if (!listed.ok() && !m.hf.source.empty()) return listed.status().with_context(m.hf.source);
  TRESTLE_ASSIGN_OR_RETURN(const std::vector<CanonicalTensor> canonical, std::move(listed));
  std::map<std::string, const CanonicalTensor*> unmade;
  for (const auto& t : canonical) unmade.emplace(t.name, &t);
  std::map<std::string, std::size_t> hf_index;
  // `vision_qkv`: a vision tower's attention layout, for its fused QKV (the language model's layer's otherwise).
  auto add = [&](const TensorRule& rule, const Names& n, const QkvLayout* vision_qkv = nullptr) -> Status {
    const std::string megatron_name = expand(rule.megatron, n);
    const auto made = unmade.find(megatron_name);
    if (made == unmade.end())
      return Status::Error("plan error: " + m.architecture + " maps '" + megatron_name +
                           "', which the Megatron model " +
                           (std::any_of(plan.tensors.begin(), plan.tensors.end(),
                                        [&](const BridgeTensor& t) { return t.name == megatron_name; })
                                ? "already has from another rule"
                                : "does not have"));
    BridgeTensor t;
    static_cast<CanonicalTensor&>(t) = *made->second;
    unmade.erase(made);
    const QkvLayout qkv = vision_qkv ? *vision_qkv : qkv_layout(m, n.mtp >= 0 ? -1 : n.layer);
    const auto shapes = source_shapes(m, rule.fusion, t.shape, qkv);
    std::vector<std::size_t> sources;
    for (std::size_t s = 0; s < rule.hf.size(); ++s) {
      std::string name = rule.hf[s];
      // Qwen3-Next's and Qwen3.5's multi-token-prediction layer is mtp.layers.{k}.*, not model.layers.{L + k}.*.
      if (n.mtp >= 0 && m.gated_delta_net && name.starts_with("model.layers.{i}."))
        name = "mtp.layers.{k}." + name.substr(std::string_view("model.layers.{i}.").size());
      name = expand(name, n);
      auto [it, inserted] = hf_index.try_emplace(name, plan.hf.size());
      if (inserted) plan.hf.push_back({name, shapes[s]});
      else if (plan.hf[it->second].shape != shapes[s])
        return Status::Error("plan error: '" + name + "' has two shapes");
      sources.push_back(it->second);
    }
    t.runs = fusion_runs(m, rule.fusion, t.shape, sources, n.expert, rule.part, qkv);
    t.shift = rule.shift;
    plan.tensors.push_back(std::move(t));
    return OkStatus();
  };
  const GptModelSpec spec = megatron_spec(m, norms);
  for (const auto& rule : architecture_rules(m)) {
    if (rule.scope == Scope::kModel) {
      const Names n{-1, -1, norms, m.is_moe()};
      if (applies(rule, m, experts, n)) TRESTLE_RETURN_IF_ERROR(add(rule, n));
      continue;
    }
    // The decoder's layers, then the multi-token-prediction layers (numbered on after them on the HF side).
    for (std::int64_t layer = 0; layer < m.hf.num_layers + spec.mtp_num_layers; ++layer) {
      Names n{layer, -1, norms, spec.layer_is_moe(layer), layer >= m.hf.num_layers ? layer - m.hf.num_layers : -1,
              spec.layer_is_linear_attention(layer), spec.hybrid_layer(layer), spec.layer_kv_shared(layer),
              spec.layer_k_eq_v(layer)};
      if (rule.scope == Scope::kMtp && n.mtp < 0) continue;
      if (!applies(rule, m, experts, n)) continue;
      if (rule.scope != Scope::kExpert) {
        TRESTLE_RETURN_IF_ERROR(add(rule, n));
        continue;
      }
      for (n.expert = 0; n.expert < m.hf.num_experts; ++n.expert) TRESTLE_RETURN_IF_ERROR(add(rule, n));
    }
  }
  for (const auto& v : m.vision_tensors)
    TRESTLE_RETURN_IF_ERROR(add({Scope::kModel, v.megatron, {v.hf}, v.fusion}, Names{-1, -1, norms, false}, &v.qkv));
  if (!unmade.empty())
    return Status::Error("plan error: " + m.architecture + " maps no Hugging Face tensor to '" + unmade.begin()->first +
                         "'" + (unmade.size() > 1 ? " (and " + std::to_string(unmade.size() - 1) + " more)" : ""));
  TRESTLE_RETURN_IF_ERROR(check_hf_coverage(plan));
  return plan;
}

std::map<std::string, Shape> hf_shapes(const BridgePlan& plan) {
  std::map<std::string, Shape> out;
  for (const auto& t : plan.hf) out[t.name] = t.shape;
  return out;
}

std::map<std::string, Shape> canonical_shapes(const BridgePlan& plan) {
  std::map<std::string, Shape> out;
  for (const auto& t : plan.tensors) out[t.name] = t.shape;
  return out;
}

Status check_accounting(const std::map<std::string, Shape>& planned, const std::map<std::string, Shape>& present,
                        const std::string& source) {
  std::vector<std::string> leftover, missing, wrong;
  for (const auto& [name, shape] : present) {
    if (is_ignored_hf_tensor(name)) continue;
    const auto it = planned.find(name);
    if (it == planned.end()) leftover.push_back(name);
    else if (it->second != shape)
      wrong.push_back(name + " is " + to_string(shape) + ", expected " + to_string(it->second));
  }
  for (const auto& [name, shape] : planned)
    if (!present.count(name)) missing.push_back(name);
  if (leftover.empty() && missing.empty() && wrong.empty()) return OkStatus();
  auto list = [](const std::vector<std::string>& names) {
    std::string out;
    for (std::size_t i = 0; i < names.size() && i < 20; ++i) out += (i ? ", " : "") + names[i];
    if (names.size() > 20) out += ", ... (" + std::to_string(names.size()) + " in all)";
    return out;
  };
  std::string message = source + ": conversion accounting failed:";
  if (!leftover.empty()) message += " not consumed by the mapping: " + list(leftover) + ";";
  if (!missing.empty()) message += " missing: " + list(missing) + ";";
  if (!wrong.empty()) message += " wrong shape: " + list(wrong) + ";";
  message.pop_back();
  return Status::Error(message);
}

}  // namespace trestle
