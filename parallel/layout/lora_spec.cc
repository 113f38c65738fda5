#include "parallel/layout/lora_spec.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "ckpt/hex_digest.h"

namespace trestle {
namespace {

using json = nlohmann::json;

struct OutPiece {
  std::string piece;  // "" when B is one tensor
  std::int64_t rows = 0;
  TpSplit split = TpSplit::kColumn;
};

struct AdapterPart {
  std::string part;  // "" (one adapter) or adapter_q, ...
  std::vector<OutPiece> out;
};

struct TargetShape {
  std::int64_t in = 0;
  TpSplit in_split = TpSplit::kColumn;  // A's: along the rank (column-parallel base), its input (row-parallel), none
  std::vector<AdapterPart> parts;
};

// A Gated DeltaNet's or Mamba mixer's linears; multi-latent attention's projections of queries, keys and values; an
// attention layer's.
bool mixer_target(const std::string& target) { return target == "in_proj" || target == "out_proj"; }
bool latent_target(const std::string& target) {
  return target == "linear_q_proj" || target == "linear_q_down_proj" || target == "linear_q_up_proj" ||
         target == "linear_kv_down_proj" || target == "linear_kv_up_proj";
}
bool attention_target(const std::string& target) {
  return target == "linear_qkv" || target == "linear_proj" || latent_target(target);
}

// Whether an attention layer of `s` has `target`: multi-latent attention its latent projections (linear_q_proj
// without a query latent, else linear_q_down_proj and linear_q_up_proj) instead of linear_qkv.
bool attention_has(const GptModelSpec& s, const std::string& target) {
  if (!s.multi_latent_attention()) return !latent_target(target);
  if (target == "linear_qkv") return false;
  if (target == "linear_q_proj") return s.q_lora_rank == 0;
  if (target == "linear_q_down_proj" || target == "linear_q_up_proj") return s.q_lora_rank > 0;
  return true;
}

// Whether layer `layer` has `target`: a Gated DeltaNet layer or a Mamba mixer in_proj and out_proj, the others
// linear_qkv (or multi-latent attention's projections) and linear_proj; every layer its MLP's, but a hybrid model's
// layers their one mixer's.
bool layer_has(const GptModelSpec& s, std::int64_t layer, const std::string& target) {
  if (s.hybrid()) {
    const char kind = s.hybrid_layer(layer);
    return kind == 'M'   ? mixer_target(target)
           : kind == '*' ? attention_target(target) && attention_has(s, target)
                         : !mixer_target(target) && !attention_target(target);
  }
  const bool linear = s.layer_is_linear_attention(layer);
  if (mixer_target(target)) return linear;
  if (attention_target(target)) return !linear && attention_has(s, target);
  return true;
}

// The adapters on `target` of layer `layer` of `spec` (an MLP of size f reading and writing vectors of `width`: the
// hidden size, a latent MoE's latent size for its experts). Gemma 4's layers
// have attention sizes of their own; its full-attention layers' linear_qkv no value rows (its keys are its values), and
// its KV-sharing layers queries alone (linear_q_proj, which the linear_qkv target adapts there). Gated attention's
// queries come with as many gate rows.
TargetShape target_shape(const GptModelSpec& s, std::int64_t layer, const std::string& target, LoraType type,
                         std::int64_t f, std::int64_t width) {
  const std::int64_t h = s.hidden_size, d = s.layer_kv_channels_of(layer);
  const std::int64_t q = s.num_attention_heads * d * (s.attention_output_gate ? 2 : 1),
                     kv = s.layer_query_groups_of(layer) * d;
  const bool canonical = type != LoraType::kLora;
  auto fused = [&](std::int64_t in, const std::vector<AdapterPart>& parts) {  // the lora type: one A over all parts
    if (canonical) return TargetShape{in, TpSplit::kColumn, parts};
    AdapterPart one{"", {}};
    for (const AdapterPart& p : parts)
      for (const OutPiece& piece : p.out) one.out.push_back(piece);
    if (one.out.size() > 1 && one.out.front().piece.empty()) {  // pieces of one tensor: rows of one B
      std::int64_t rows = 0;
      for (const OutPiece& piece : one.out) rows += piece.rows;
      one.out = {{"", rows, TpSplit::kColumn}};
    }
    return TargetShape{in, TpSplit::kColumn, {one}};
  };
  auto column = [](std::int64_t in, std::int64_t out) {
    return TargetShape{in, TpSplit::kColumn, {{"", {{"", out, TpSplit::kColumn}}}}};
  };
  if (target == "linear_qkv") {
    std::vector<AdapterPart> parts{{"adapter_q", {{"", q, TpSplit::kColumn}}}};
    if (!s.layer_kv_shared(layer)) parts.push_back({"adapter_k", {{"", kv, TpSplit::kColumn}}});
    if (!s.layer_kv_shared(layer) && !s.layer_k_eq_v(layer)) parts.push_back({"adapter_v", {{"", kv, TpSplit::kColumn}}});
    return fused(h, parts);
  }
  if (latent_target(target)) {
    // Multi-latent attention: the up projections (and linear_q_proj) column-parallel by heads; the down projections
    // replicated under Transformer Engine's spec ('duplicated', so their adapters are too), the local spec's
    // column-parallel.
    const std::int64_t heads = s.num_attention_heads, qk = s.qk_head_dim + s.qk_pos_emb_head_dim;
    if (target == "linear_q_proj") return column(h, heads * qk);
    if (target == "linear_q_up_proj") return column(s.q_lora_rank, heads * qk);
    if (target == "linear_kv_up_proj") return column(s.kv_lora_rank, heads * (s.qk_head_dim + s.v_head_dim));
    const std::int64_t latent =
        target == "linear_q_down_proj" ? s.q_lora_rank : s.kv_lora_rank + s.qk_pos_emb_head_dim;
    if (s.norms == NormNaming::kLocal) return column(h, latent);
    return {h, TpSplit::kReplicated, {{"", {{"", latent, TpSplit::kReplicated}}}}};
  }
  if (target == "in_proj" && s.hybrid()) {  // a Mamba mixer's [z; x; B; C; dt], one linear in Hugging Face's model
    const std::int64_t inner = s.mamba_num_heads * s.mamba_head_dim, bc = s.mamba_num_groups * s.mamba_state_dim;
    return {h, TpSplit::kColumn, {{"", {{"z", inner}, {"x", inner}, {"B", bc}, {"C", bc}, {"dt", s.mamba_num_heads}}}}};
  }
  if (target == "in_proj") {
    const std::int64_t keys = s.linear_num_key_heads * s.linear_key_head_dim,
                       values = s.linear_num_value_heads * s.linear_value_head_dim, heads = s.linear_num_value_heads;
    const OutPiece query{"query", keys}, key{"key", keys}, value{"value", values}, z{"z", values}, beta{"beta", heads},
        alpha{"alpha", heads};
    if (s.linear_in_proj_split)
      return fused(h, {{"adapter_qkv", {query, key, value}}, {"adapter_z", {z}}, {"adapter_b", {beta}},
                       {"adapter_a", {alpha}}});
    return fused(h, {{"adapter_qkvz", {query, key, value, z}}, {"adapter_ba", {beta, alpha}}});
  }
  if (target == "linear_proj" || target == "out_proj") {
    const std::int64_t in = target == "out_proj" && s.hybrid() ? s.mamba_num_heads * s.mamba_head_dim
                            : target == "out_proj"              ? s.linear_num_value_heads * s.linear_value_head_dim
                            : s.multi_latent_attention()        ? s.num_attention_heads * s.v_head_dim
                                                                : s.num_attention_heads * d;
    return {in, TpSplit::kRow, {{"", {{"", h, TpSplit::kReplicated}}}}};
  }
  if (target == "linear_fc1" && s.squared_relu) return column(width, f);  // no gate
  if (target == "linear_fc1") {
    if (!canonical) return {width, TpSplit::kColumn, {{"", {{"", 2 * f, TpSplit::kGatedColumn}}}}};
    return {width, TpSplit::kColumn,
            {{"adapter_gate", {{"", f, TpSplit::kColumn}}}, {"adapter_up", {{"", f, TpSplit::kColumn}}}}};
  }
  return {f, TpSplit::kRow, {{"", {{"", width, TpSplit::kReplicated}}}}};  // linear_fc2
}

std::string module_of(const GptModelSpec& spec, std::int64_t layer, const std::string& target) {
  if (target == "linear_qkv" && spec.layer_kv_shared(layer)) return "self_attention.linear_q_proj";
  if (mixer_target(target) && spec.hybrid()) return "mixer." + target;
  return (attention_target(target) || mixer_target(target) ? "self_attention." : "mlp.") + target;
}

}  // namespace

const std::vector<std::string>& lora_target_modules() {
  static const std::vector<std::string> targets{
      "linear_qkv",          "linear_q_proj",     "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
      "linear_kv_up_proj",   "linear_proj",       "in_proj",            "out_proj",         "linear_fc1",
      "linear_fc2"};
  return targets;
}

const std::vector<std::string>& default_lora_target_modules() {
  static const std::vector<std::string> targets{"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"};
  return targets;
}

bool model_has_lora_target(const GptModelSpec& spec, const std::string& target) {
  for (std::int64_t i = 0; i < spec.num_layers; ++i)
    if (layer_has(spec, i, target)) return true;
  return false;
}

std::vector<std::string> model_lora_targets(const GptModelSpec& spec) {
  std::vector<std::string> out;
  for (const std::string& target : lora_target_modules())
    if (model_has_lora_target(spec, target)) out.push_back(target);
  return out;
}

std::vector<LoraPart> lora_parts(const GptModelSpec& spec, std::int64_t layer, const std::string& target,
                                 LoraType type) {
  if (!layer_has(spec, layer, target)) return {};
  std::vector<LoraPart> out;
  for (const AdapterPart& p : target_shape(spec, layer, target, type, 0, 0).parts) {
    out.push_back({p.part, {}});
    for (const OutPiece& piece : p.out) out.back().pieces.push_back(piece.piece);
  }
  return out;
}

LoraType module_lora_type(LoraType type, bool routed_expert) {
  if (type != LoraType::kPeft) return type;
  return routed_expert ? LoraType::kLora : LoraType::kCanonical;
}

std::string_view lora_type_name(LoraType type) {
  return type == LoraType::kCanonical ? "canonical" : type == LoraType::kPeft ? "peft" : "lora";
}

Result<LoraType> parse_lora_type(const std::string& text) {
  if (text == "lora") return LoraType::kLora;
  if (text == "canonical") return LoraType::kCanonical;
  if (text == "peft") return LoraType::kPeft;
  return Status::Error(
      "unknown LoRA type '" + text +
      "' (lora: one adapter on each fused linear, as "
      "Megatron-Bridge's LoRA; canonical: separate q, k, v and gate, up adapters, as its CanonicalLoRA; "
      "peft: canonical but one adapter on each routed expert's gate and up, as PEFT on transformers 5)");
}

std::string lora_tensor_name(const std::string& module, const std::string& part, bool in, const std::string& piece) {
  return module + ".adapter." + (part.empty() ? "" : part + ".") + (in ? "linear_in.weight" : "linear_out.weight") +
         (piece.empty() ? "" : "." + piece);
}

json lora_to_json(const LoraConfig& c, const LoraBase& base) {
  return json{{"rank", c.rank},
              {"alpha", c.alpha},
              {"dropout", c.dropout},
              {"type", std::string(lora_type_name(c.type))},
              {"target_modules", c.targets},
              {"base",
               {{"path", base.path},
                {"manifest_xxh3_64", base.manifest_digest},
                {"weights_origin_xxh3_64", base.weights_origin.empty() ? base.manifest_digest : base.weights_origin}}}};
}

Result<LoraConfig> lora_config_from_json(const json& lora, const std::string& source) {
  const std::string where = source + " (model.lora)";
  if (!lora.is_object()) return Status::Error(where + " is not an object");
  LoraConfig c;
  const auto rank = lora.find("rank");
  const auto alpha = lora.find("alpha");
  const auto type = lora.find("type");
  const auto targets = lora.find("target_modules");
  if (rank == lora.end() || !rank->is_number_integer()) return Status::Error(where + " has no integer rank");
  if (alpha == lora.end() || !alpha->is_number()) return Status::Error(where + " has no numeric alpha");
  if (type == lora.end() || !type->is_string()) return Status::Error(where + " has no type");
  if (targets == lora.end() || !targets->is_array() || targets->empty())
    return Status::Error(where + " has no target_modules");
  c.rank = rank->get<std::int64_t>();
  c.alpha = alpha->get<double>();
  if (const auto dropout = lora.find("dropout"); dropout != lora.end()) {
    if (!dropout->is_number()) return Status::Error(where + ".dropout is not a number");
    c.dropout = dropout->get<double>();
  }
  auto parsed = parse_lora_type(type->get<std::string>());
  if (!parsed.ok()) return Status::Error(where + ": " + parsed.status().message());
  c.type = *parsed;
  c.targets.clear();
  for (const json& t : *targets) {
    if (!t.is_string()) return Status::Error(where + ".target_modules holds a non-string: " + t.dump());
    c.targets.push_back(t.get<std::string>());
  }
  return c;
}

Result<LoraBase> lora_base_from_json(const json& lora, const std::string& source) {
  const std::string where = source + " (model.lora.base)";
  const auto base = lora.find("base");
  if (base == lora.end() || !base->is_object()) return Status::Error(where + " is missing");
  const auto path = base->find("path");
  const auto digest = base->find("manifest_xxh3_64");
  if (path == base->end() || !path->is_string() || digest == base->end() || !digest->is_string())
    return Status::Error(where + " needs a path and a manifest_xxh3_64");
  // A digest is the 16 lower-case hexadecimal digits manifest_file_digest writes.
  auto check_digest = [&](const json& value, const char* key) -> Status {
    if (value.is_string() && is_hex_digest(value.get_ref<const std::string&>())) return OkStatus();
    return Status::Error(where + "." + key + " is " + value.dump().substr(0, 80) +
                         ", expected the 16 lower-case hexadecimal digits of a manifest's digest");
  };
  TRESTLE_RETURN_IF_ERROR(check_digest(*digest, "manifest_xxh3_64"));
  LoraBase b{path->get<std::string>(), digest->get<std::string>(), digest->get<std::string>()};
  if (const auto origin = base->find("weights_origin_xxh3_64"); origin != base->end()) {
    TRESTLE_RETURN_IF_ERROR(check_digest(*origin, "weights_origin_xxh3_64"));
    b.weights_origin = origin->get<std::string>();
  }
  return b;
}

Status check_lora_config(const LoraConfig& c, const GptModelSpec& spec) {
  if (c.rank <= 0) return Status::Error("the LoRA rank must be positive, not " + std::to_string(c.rank));
  if (!std::isfinite(c.alpha) || c.alpha <= 0)
    return Status::Error("the LoRA alpha must be positive, not " + std::to_string(c.alpha));
  if (!(c.dropout >= 0.0 && c.dropout < 1.0))
    return Status::Error("the LoRA dropout must be in [0, 1), not " + std::to_string(c.dropout));
  if (c.targets.empty()) return Status::Error("no LoRA target modules");
  const auto& known = lora_target_modules();
  for (std::size_t i = 0; i < c.targets.size(); ++i) {
    const std::string& t = c.targets[i];
    if (std::find(known.begin(), known.end(), t) == known.end())
      return Status::Error("unknown LoRA target module '" + t +
                           "' (the targets are linear_qkv, linear_proj, linear_fc1, linear_fc2; in multi-latent "
                           "attention linear_q_proj or linear_q_down_proj and linear_q_up_proj, linear_kv_down_proj, "
                           "linear_kv_up_proj instead of linear_qkv; in Gated DeltaNet layers and Mamba mixers "
                           "in_proj, out_proj)");
    if (std::find(c.targets.begin(), c.targets.begin() + static_cast<std::ptrdiff_t>(i), t) !=
        c.targets.begin() + static_cast<std::ptrdiff_t>(i))
      return Status::Error("LoRA target module '" + t + "' is given twice");
    if (model_has_lora_target(spec, t)) continue;
    if (t == "linear_qkv" && spec.multi_latent_attention()) {
      const std::string queries = spec.q_lora_rank > 0 ? "linear_q_down_proj, linear_q_up_proj" : "linear_q_proj";
      return Status::Error("LoRA target linear_qkv: the model's multi-latent attention has no linear_qkv (its "
                           "projections are " + queries +
                           ", linear_kv_down_proj and linear_kv_up_proj, which are targets of their own)");
    }
    if (latent_target(t) && spec.multi_latent_attention())
      return Status::Error("LoRA target " + t + ": the model's multi-latent attention " +
                           (spec.q_lora_rank > 0 ? "projects its queries through a latent (linear_q_down_proj, "
                                                   "linear_q_up_proj), not linear_q_proj"
                                                 : "has no query latent (q_lora_rank 0): its queries come from "
                                                   "linear_q_proj"));
    if (latent_target(t))
      return Status::Error("LoRA target " + t + ": the model has no multi-latent attention (whose projections it "
                           "names); its attention's are linear_qkv and linear_proj");
    if (mixer_target(t))
      return Status::Error("LoRA target " + t + ": the model has no Gated DeltaNet layers or Mamba mixers (in_proj "
                           "and out_proj are theirs; attention layers have linear_qkv and linear_proj)");
  }
  return OkStatus();
}

Result<std::vector<CanonicalTensor>> lora_tensors(const GptModelSpec& spec, const LoraConfig& config) {
  TRESTLE_RETURN_IF_ERROR(check_lora_config(config, spec));
  std::vector<CanonicalTensor> out;
  const std::int64_t r = config.rank;
  for (std::int64_t i = 0; i < spec.num_layers; ++i) {
    const std::string layer = "decoder.layers." + std::to_string(i) + ".";
    auto add = [&](const std::string& module, const std::string& target, std::int64_t f, std::int64_t expert,
                   std::int64_t width) {
      const TargetShape shape = target_shape(spec, i, target, module_lora_type(config.type, expert >= 0), f, width);
      for (const AdapterPart& part : shape.parts) {
        out.push_back({lora_tensor_name(module, part.part, true), Shape{r, shape.in},
                       shape.in_split, Placement::kLayer, i, expert});
        for (const OutPiece& piece : part.out)
          out.push_back({lora_tensor_name(module, part.part, false, piece.piece), Shape{piece.rows, r}, piece.split,
                         Placement::kLayer, i, expert});
      }
    };
    // Gemma 4's KV-sharing layers may have MLPs twice as wide.
    const std::int64_t wide = spec.double_wide_mlp && spec.layer_kv_shared(i) ? 2 : 1;
    for (const std::string& target : lora_target_modules()) {
      if (std::find(config.targets.begin(), config.targets.end(), target) == config.targets.end() ||
          !layer_has(spec, i, target))
        continue;
      const bool mlp = target == "linear_fc1" || target == "linear_fc2";
      if (!mlp || !spec.layer_is_moe(i)) {
        add(layer + module_of(spec, i, target), target,
            wide * (spec.is_moe() ? spec.dense_ffn_hidden_size : spec.ffn_hidden_size), -1, spec.hidden_size);
        continue;
      }
      // An MoE layer: one adapter per routed expert (Megatron-Bridge's SequentialMLP names; in a latent MoE on the
      // latent vectors) and the shared expert's.
      const std::int64_t expert_width = spec.moe_latent_size > 0 ? spec.moe_latent_size : spec.hidden_size;
      for (std::int64_t e = 0; e < spec.num_experts; ++e)
        add(layer + "mlp.experts.local_experts." + std::to_string(e) + "." + target, target, spec.ffn_hidden_size, e,
            expert_width);
      if (spec.shared_expert_ffn_hidden_size > 0)
        add(layer + "mlp.shared_experts." + target, target, wide * spec.shared_expert_ffn_hidden_size, -1,
            spec.hidden_size);
    }
  }
  return out;
}

}  // namespace trestle
