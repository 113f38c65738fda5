#include "convert/megatron_layout.h"

#include <algorithm>

namespace trestle {
namespace {

using json = nlohmann::json;

std::string str(std::int64_t v) { return std::to_string(v); }

// Even split of `count` layers into `parts` blocks, or an error naming what does not divide.
Status check_divides(std::int64_t count, std::int64_t parts, const std::string& what) {
  if (parts <= 0 || count % parts != 0)
    return Status::Error(what + " (" + str(count) + ") is not divisible by " + str(parts));
  return OkStatus();
}

}  // namespace

std::string_view tp_split_name(TpSplit split) {
  switch (split) {
    case TpSplit::kReplicated:
      return "replicated";
    case TpSplit::kColumn:
      return "column";
    case TpSplit::kRow:
      return "row";
    case TpSplit::kVocab:
      return "vocab";
    case TpSplit::kGatedColumn:
      return "gated-column";
  }
  return "?";
}

ParallelLayout MegatronLayout::parallel_layout() const {
  ParallelLayout l;
  l.tp = tp;
  l.pp = pp;
  l.vpp = vpp;
  l.dp = dp();
  l.ep = ep;
  return l;
}

int global_rank(const MegatronLayout& layout, int tp_rank, int dp_rank, int pp_rank) {
  return tp_rank + layout.tp * (dp_rank + layout.dp() * pp_rank);
}

RankCoordinates rank_coordinates(const MegatronLayout& layout, int rank) {
  RankCoordinates c;
  c.tp_rank = rank % layout.tp;
  c.dp_rank = (rank / layout.tp) % layout.dp();
  c.pp_rank = rank / (layout.tp * layout.dp());
  c.ep_rank = c.dp_rank % layout.ep;
  return c;
}

std::int64_t padded_vocab_size(std::int64_t vocab_size, std::int64_t divisible_by, int tp) {
  const std::int64_t multiple = std::max<std::int64_t>(1, divisible_by) * tp;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

Result<std::vector<std::vector<LayerRange>>> pipeline_layers(const MegatronLayout& layout, std::int64_t num_layers) {
  const int pp = layout.pp, vpp = layout.vpp;
  if (pp < 1 || vpp < 1) return Status::Error("pp and vpp must be at least 1");
  std::vector<std::vector<LayerRange>> stages(static_cast<std::size_t>(pp));
  const bool uneven = layout.first_stage_layers > 0 || layout.last_stage_layers > 0;
  if (!uneven) {
    TRESTLE_RETURN_IF_ERROR(check_divides(num_layers, std::int64_t{pp} * vpp, "number of layers"));
    const std::int64_t per_chunk = num_layers / (pp * vpp);
    for (int s = 0; s < pp; ++s)
      for (int v = 0; v < vpp; ++v) {
        const std::int64_t begin = (std::int64_t{v} * pp + s) * per_chunk;
        stages[static_cast<std::size_t>(s)].push_back({begin, begin + per_chunk});
      }
    return stages;
  }
  if (vpp != 1) return Status::Error("explicit first/last pipeline stage sizes are supported with vpp 1 only");
  if (pp == 1) return Status::Error("explicit first/last pipeline stage sizes need pp > 1");
  std::vector<std::int64_t> counts(static_cast<std::size_t>(pp), 0);
  std::int64_t rest = num_layers;
  int middle = pp;
  if (layout.first_stage_layers > 0) {
    counts.front() = layout.first_stage_layers;
    rest -= layout.first_stage_layers;
    --middle;
  }
  if (layout.last_stage_layers > 0) {
    counts.back() = layout.last_stage_layers;
    rest -= layout.last_stage_layers;
    --middle;
  }
  if (rest < 0) return Status::Error("first and last pipeline stage sizes exceed the " + str(num_layers) + " layers");
  if (middle == 0 && rest != 0)
    return Status::Error("first and last pipeline stage sizes must add up to the " + str(num_layers) +
                         " layers when pp is 2");
  if (middle > 0) {
    TRESTLE_RETURN_IF_ERROR(check_divides(rest, middle, "layers left for the middle pipeline stages"));
    for (int s = 0; s < pp; ++s)
      if (counts[static_cast<std::size_t>(s)] == 0) counts[static_cast<std::size_t>(s)] = rest / middle;
  }
  std::int64_t begin = 0;
  for (int s = 0; s < pp; ++s) {
    stages[static_cast<std::size_t>(s)].push_back({begin, begin + counts[static_cast<std::size_t>(s)]});
    begin += counts[static_cast<std::size_t>(s)];
  }
  return stages;
}

int stage_of_layer(const std::vector<std::vector<LayerRange>>& stages, std::int64_t layer) {
  for (std::size_t s = 0; s < stages.size(); ++s)
    for (const auto& r : stages[s])
      if (layer >= r.begin && layer < r.end) return static_cast<int>(s);
  return -1;
}

LayerRange experts_of_rank(const MegatronLayout& layout, std::int64_t num_experts, int ep_rank) {
  const std::int64_t per_rank = num_experts / layout.ep;
  return {ep_rank * per_rank, (ep_rank + 1) * per_rank};
}

Result<std::vector<Box>> tp_boxes(TpSplit split, const Shape& shape, int tp, int tp_rank, std::int64_t padded_rows) {
  const auto where = [&] {
    return std::string(tp_split_name(split)) + " split of " + to_string(shape) + " over tp " + str(tp);
  };
  Box whole = whole_box(shape);
  switch (split) {
    case TpSplit::kReplicated:
      return std::vector<Box>{whole};
    case TpSplit::kColumn:
    case TpSplit::kRow: {
      const std::size_t dim = split == TpSplit::kColumn ? 0 : 1;
      if (shape.size() <= dim) return Status::Error(where() + ": tensor has too few dimensions");
      TRESTLE_RETURN_IF_ERROR(
          check_divides(shape[dim], tp, where() + ": dimension " + str(static_cast<std::int64_t>(dim))));
      const std::int64_t part = shape[dim] / tp;
      whole.offset[dim] = part * tp_rank;
      whole.shape[dim] = part;
      return std::vector<Box>{whole};
    }
    case TpSplit::kVocab: {
      if (shape.empty() || padded_rows < shape[0] || padded_rows % tp != 0)
        return Status::Error(where() + ": padded vocab " + str(padded_rows) +
                             " is not a multiple of tp covering the vocab");
      const std::int64_t part = padded_rows / tp;
      const std::int64_t begin = std::min(part * tp_rank, shape[0]);
      const std::int64_t end = std::min(part * (tp_rank + 1), shape[0]);
      if (begin == end) return std::vector<Box>{};
      whole.offset[0] = begin;
      whole.shape[0] = end - begin;
      return std::vector<Box>{whole};
    }
    case TpSplit::kGatedColumn: {
      if (shape.empty() || shape[0] % 2 != 0) return Status::Error(where() + ": dim 0 is not [gate; up]");
      const std::int64_t half = shape[0] / 2;
      TRESTLE_RETURN_IF_ERROR(check_divides(half, tp, where() + ": gate rows"));
      const std::int64_t part = half / tp;
      Box gate = whole, up = whole;
      gate.offset[0] = part * tp_rank;
      gate.shape[0] = part;
      up.offset[0] = half + part * tp_rank;
      up.shape[0] = part;
      return std::vector<Box>{gate, up};
    }
  }
  return Status::Error("unknown split");
}

std::string input_norm_name(NormNaming naming) {
  return naming == NormNaming::kTransformerEngine ? "self_attention.linear_qkv.layer_norm_weight"
                                                  : "input_layernorm.weight";
}

std::string pre_mlp_norm_name(NormNaming naming, bool moe) {
  return naming == NormNaming::kTransformerEngine && !moe ? "mlp.linear_fc1.layer_norm_weight"
                                                          : "pre_mlp_layernorm.weight";
}

NormNaming detect_norm_naming(const std::vector<std::string>& tensor_names) {
  for (const auto& name : tensor_names)
    if (name.ends_with(".self_attention.linear_qkv.layer_norm_weight")) return NormNaming::kTransformerEngine;
  return NormNaming::kLocal;
}

OptimizerShard optimizer_shard(const MegatronLayout& layout, const RankCoordinates& rank, bool expert) {
  if (expert) return {layout.dp() / layout.ep, rank.dp_rank / layout.ep};
  return {layout.dp(), rank.dp_rank};
}

FlatRange optimizer_flat_range(std::int64_t piece_numel, const OptimizerShard& shard) {
  return {piece_numel * shard.index / shard.count, piece_numel * (shard.index + 1) / shard.count};
}

json layout_to_json(const MegatronLayout& l) {
  return {{"tp", l.tp},
          {"pp", l.pp},
          {"vpp", l.vpp},
          {"ep", l.ep},
          {"dp", l.dp()},
          {"make_vocab_size_divisible_by", l.make_vocab_size_divisible_by},
          {"first_stage_layers", l.first_stage_layers},
          {"last_stage_layers", l.last_stage_layers},
          {"norm_naming", l.norms == NormNaming::kTransformerEngine ? "transformer_engine" : "local"}};
}

Result<MegatronLayout> layout_from_json(const json& j) {
  MegatronLayout l;
  try {
    l.tp = j.at("tp").get<int>();
    l.pp = j.at("pp").get<int>();
    l.vpp = j.value("vpp", 1);
    l.ep = j.value("ep", 1);
    l.data_parallel = j.value("dp", l.ep);
    l.make_vocab_size_divisible_by = j.value("make_vocab_size_divisible_by", std::int64_t{128});
    l.first_stage_layers = j.value("first_stage_layers", std::int64_t{0});
    l.last_stage_layers = j.value("last_stage_layers", std::int64_t{0});
    l.norms = j.value("norm_naming", std::string("transformer_engine")) == "local" ? NormNaming::kLocal
                                                                                   : NormNaming::kTransformerEngine;
  } catch (const json::exception& e) {
    return Status::Error(std::string("megatron layout: ") + e.what());
  }
  if (l.tp < 1 || l.pp < 1 || l.vpp < 1 || l.ep < 1 || l.data_parallel < 1)
    return Status::Error("megatron layout: sizes must be at least 1");
  if (l.data_parallel % l.ep != 0)
    return Status::Error("megatron layout: dp " + str(l.data_parallel) + " is not a multiple of ep " + str(l.ep));
  return l;
}

Status check_layout(const MegatronLayout& layout, std::int64_t num_layers, std::int64_t num_query_groups,
                    std::int64_t num_experts) {
  if (layout.tp < 1 || layout.pp < 1 || layout.vpp < 1 || layout.ep < 1 || layout.dp() < 1)
    return Status::Error("tp, pp, vpp, ep and dp must be at least 1");
  if (layout.dp() % layout.ep != 0)
    return Status::Error("dp " + str(layout.dp()) + " must be a multiple of ep " + str(layout.ep) +
                         " (expert-parallel groups are carved out of the data-parallel ranks)");
  if (layout.vpp > 1 && layout.pp == 1)
    return Status::Error("virtual pipeline (vpp " + str(layout.vpp) + ") needs pp > 1");
  TRESTLE_RETURN_IF_ERROR(check_divides(num_query_groups, layout.tp, "number of query groups (KV heads)"));
  if (layout.ep > 1 && num_experts == 0)
    return Status::Error("expert parallel (ep " + str(layout.ep) + ") needs an MoE model");
  if (num_experts > 0) TRESTLE_RETURN_IF_ERROR(check_divides(num_experts, layout.ep, "number of experts"));
  return pipeline_layers(layout, num_layers).status();
}

}  // namespace trestle
