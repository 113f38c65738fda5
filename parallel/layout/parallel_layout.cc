#include "parallel/layout/parallel_layout.h"

#include <algorithm>

#include "parallel/layout/tp_split.h"

namespace trestle {
namespace {

using json = nlohmann::json;

std::string str(std::int64_t v) { return std::to_string(v); }

// Layer counts per stage with explicit first / last stage sizes (vpp 1): the middle stages share the rest evenly.
Result<std::vector<std::int64_t>> uneven_stage_counts(const ParallelLayout& layout, std::int64_t num_layers) {
  const int pp = layout.pp;
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
  if (middle > 0 && rest == 0)  // megatron-core's TransformerConfig refuses a stage without layers
    return Status::Error("first and last pipeline stage sizes (" + str(layout.first_stage_layers) + " and " +
                         str(layout.last_stage_layers) + ") take all " + str(num_layers) +
                         " layers, leaving none for " + str(middle) + " other pipeline stage" +
                         (middle > 1 ? "s" : ""));
  if (middle > 0) {
    TRESTLE_RETURN_IF_ERROR(check_divides(rest, middle, "layers left for the middle pipeline stages"));
    for (auto& c : counts)
      if (c == 0) c = rest / middle;
  }
  return counts;
}

}  // namespace

int global_rank(const ParallelLayout& l, const RankCoordinates& r) {
  return r.tp_rank + l.tp * (r.cp_rank + l.cp * (r.dp_rank + l.dp() * r.pp_rank));
}

RankCoordinates rank_coordinates(const ParallelLayout& l, int rank) {
  RankCoordinates c;
  c.tp_rank = rank % l.tp;
  c.cp_rank = (rank / l.tp) % l.cp;
  c.dp_rank = (rank / (l.tp * l.cp)) % l.dp();
  c.pp_rank = rank / (l.tp * l.cp * l.dp());
  const int in_stage = rank % (l.tp * l.cp * l.dp());
  c.etp_rank = in_stage % l.expert_tp();
  c.ep_rank = (in_stage / l.expert_tp()) % l.ep;
  c.expert_dp_rank = in_stage / (l.expert_tp() * l.ep);
  return c;
}

Status check_vocab_size_divisible_by(std::int64_t value, const std::string& named) {
  if (value >= 1 && value <= kMaxVocabSizeDivisibleBy) return OkStatus();
  return Status::Error(named + " must be an integer from 1 to " + str(kMaxVocabSizeDivisibleBy) + ", not " +
                       str(value));
}

std::int64_t padded_vocab_size(std::int64_t vocab_size, std::int64_t divisible_by, int tp) {
  const std::int64_t multiple = std::max<std::int64_t>(1, divisible_by) * tp;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

Result<std::vector<std::vector<LayerRange>>> pipeline_layers(const ParallelLayout& layout, std::int64_t num_layers) {
  const int pp = layout.pp, vpp = layout.vpp;
  if (pp < 1 || vpp < 1) return Status::Error("pp and vpp must be at least 1");
  std::vector<std::vector<LayerRange>> stages(static_cast<std::size_t>(pp));
  if (!layout.chunk_layers.empty()) {
    if (static_cast<std::int64_t>(layout.chunk_layers.size()) != std::int64_t{pp} * vpp)
      return Status::Error("the pipeline layout has " + str(static_cast<std::int64_t>(layout.chunk_layers.size())) +
                           " virtual stages; pp x vpp is " + str(std::int64_t{pp} * vpp));
    std::int64_t begin = 0;
    for (std::size_t i = 0; i < layout.chunk_layers.size(); ++i) {
      const std::int64_t n = layout.chunk_layers[i];
      if (n < 0)
        return Status::Error("the pipeline layout's virtual stage " + str(static_cast<std::int64_t>(i)) +
                             " has a negative number of layers");
      stages[i % static_cast<std::size_t>(pp)].push_back({begin, begin + n});
      begin += n;
    }
    if (begin != num_layers)
      return Status::Error("the pipeline layout holds " + str(begin) + " layers; the model has " + str(num_layers));
    return stages;
  }
  if (layout.first_stage_layers <= 0 && layout.last_stage_layers <= 0) {
    const Status even = check_divides(num_layers, std::int64_t{pp} * vpp, "number of layers",
                                      vpp > 1 ? "the pipeline x virtual pipeline size " + str(pp) + " x " + str(vpp)
                                              : std::string("the pipeline-parallel size"));
    if (!even.ok())
      return Status::Error(even.message() +
                           " (for stages of uneven sizes give the first or last stage's layers: --first-stage-layers / "
                           "--last-stage-layers, in train Megatron's --decoder-first-pipeline-num-layers / "
                           "--decoder-last-pipeline-num-layers)");
    const std::int64_t per_chunk = num_layers / (pp * vpp);
    for (int s = 0; s < pp; ++s)
      for (int v = 0; v < vpp; ++v) {
        const std::int64_t begin = (std::int64_t{v} * pp + s) * per_chunk;
        stages[static_cast<std::size_t>(s)].push_back({begin, begin + per_chunk});
      }
    return stages;
  }
  // Uneven stages (megatron-core's get_transformer_layer_offset): each stage's layers split evenly over its vpp
  // chunks; chunk v of every stage comes before chunk v + 1 of any, stage by stage.
  TRESTLE_ASSIGN_OR_RETURN(const auto counts, uneven_stage_counts(layout, num_layers));
  std::int64_t per_round = 0;  // layers of chunk v over all stages
  for (std::size_t s = 0; s < stages.size(); ++s) {
    if (counts[s] % vpp != 0)
      return Status::Error("pipeline stage " + str(static_cast<std::int64_t>(s)) + "'s " + str(counts[s]) +
                           " layers are not divisible by the virtual pipeline size " + str(vpp) +
                           " (each of its model chunks holds the same number)");
    per_round += counts[s] / vpp;
  }
  for (int v = 0; v < vpp; ++v) {
    std::int64_t begin = v * per_round;
    for (std::size_t s = 0; s < stages.size(); ++s) {
      stages[s].push_back({begin, begin + counts[s] / vpp});
      begin += counts[s] / vpp;
    }
  }
  return stages;
}

int stage_of_layer(const std::vector<std::vector<LayerRange>>& stages, std::int64_t layer) {
  for (std::size_t s = 0; s < stages.size(); ++s)
    for (const auto& r : stages[s])
      if (layer >= r.begin && layer < r.end) return static_cast<int>(s);
  return -1;
}

LayerRange experts_of_rank(const ParallelLayout& layout, std::int64_t num_experts, int ep_rank) {
  const std::int64_t per_rank = num_experts / layout.ep;
  return {ep_rank * per_rank, (ep_rank + 1) * per_rank};
}

OptimizerShard optimizer_shard(const ParallelLayout& layout, const RankCoordinates& rank, bool expert) {
  if (expert) return {layout.expert_dp(), rank.expert_dp_rank};
  return {layout.dp(), rank.dp_rank};
}

FlatRange optimizer_flat_range(std::int64_t piece_numel, const OptimizerShard& shard) {
  return {piece_numel * shard.index / shard.count, piece_numel * (shard.index + 1) / shard.count};
}

json layout_sizes_to_json(const ParallelLayout& l) {
  json j = {{"tp", l.tp}, {"pp", l.pp}, {"vpp", l.vpp}, {"dp", l.dp()}, {"ep", l.ep}, {"cp", l.cp}};
  if (l.expert_tp() != l.tp) j["etp"] = l.expert_tp();
  return j;
}

json layout_to_json(const ParallelLayout& l) {
  json j = {{"tp", l.tp},
            {"pp", l.pp},
            {"vpp", l.vpp},
            {"cp", l.cp},
            {"ep", l.ep},
            {"dp", l.dp()},
            {"make_vocab_size_divisible_by", l.make_vocab_size_divisible_by},
            {"first_stage_layers", l.first_stage_layers},
            {"last_stage_layers", l.last_stage_layers}};
  if (l.expert_tp() != l.tp) j["etp"] = l.expert_tp();
  if (!l.chunk_layers.empty()) j["chunk_layers"] = l.chunk_layers;
  return j;
}

Result<ParallelLayout> layout_from_json(const json& j, const std::string& source) {
  const std::string where = source + ": layout";
  if (!j.is_object()) return Status::Error(where + " must be an object");
  ParallelLayout l;
  auto read = [&](const char* key, std::int64_t fallback, std::int64_t minimum) -> Result<std::int64_t> {
    if (!j.contains(key)) return fallback;
    const json& v = j[key];
    if (!v.is_number_integer() || v.get<std::int64_t>() < minimum || v.get<std::int64_t>() > (std::int64_t{1} << 30))
      return Status::Error(where + " '" + key + "' must be an integer from " + str(minimum) + ", not " + v.dump());
    return v.get<std::int64_t>();
  };
  for (auto [key, field] : {std::pair{"tp", &l.tp}, {"pp", &l.pp}, {"vpp", &l.vpp}, {"cp", &l.cp}, {"ep", &l.ep}}) {
    TRESTLE_ASSIGN_OR_RETURN(const std::int64_t v, read(key, 1, 1));
    *field = static_cast<int>(v);
  }
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t dp, read("dp", l.ep, 1));
  l.data_parallel = static_cast<int>(dp);
  TRESTLE_ASSIGN_OR_RETURN(l.make_vocab_size_divisible_by, read("make_vocab_size_divisible_by", 128, 1));
  TRESTLE_RETURN_IF_ERROR(
      check_vocab_size_divisible_by(l.make_vocab_size_divisible_by, where + " 'make_vocab_size_divisible_by'"));
  TRESTLE_ASSIGN_OR_RETURN(l.first_stage_layers, read("first_stage_layers", 0, 0));
  TRESTLE_ASSIGN_OR_RETURN(l.last_stage_layers, read("last_stage_layers", 0, 0));
  if (j.contains("chunk_layers")) {
    const json& chunks = j["chunk_layers"];
    if (!chunks.is_array() || chunks.size() != static_cast<std::size_t>(l.pp) * static_cast<std::size_t>(l.vpp))
      return Status::Error(where + " 'chunk_layers' must be an array of pp x vpp layer counts");
    for (const json& n : chunks) {
      if (!n.is_number_integer() || n.get<std::int64_t>() < 0 || n.get<std::int64_t>() > (std::int64_t{1} << 30))
        return Status::Error(where + " 'chunk_layers' holds " + n.dump() + ", not a layer count");
      l.chunk_layers.push_back(n.get<std::int64_t>());
    }
  }
  TRESTLE_ASSIGN_OR_RETURN(const std::int64_t etp, read("etp", l.tp, 1));
  l.etp = etp == l.tp ? 0 : static_cast<int>(etp);
  if (l.etp == 0 && l.cp * l.data_parallel % l.ep != 0)
    return Status::Error(where + ": cp x dp " + str(l.cp * l.data_parallel) + " is not a multiple of ep " + str(l.ep));
  if (l.tp * l.cp * l.data_parallel % (l.expert_tp() * l.ep) != 0)
    return Status::Error(where + ": tp x cp x dp " + str(l.tp * l.cp * l.data_parallel) +
                         " is not a multiple of etp x ep " + str(l.expert_tp() * l.ep));
  return l;
}

Status check_layout(const ParallelLayout& layout, std::int64_t num_layers, std::int64_t num_query_groups,
                    std::int64_t num_experts) {
  if (layout.tp < 1 || layout.pp < 1 || layout.vpp < 1 || layout.cp < 1 || layout.ep < 1 || layout.dp() < 1)
    return Status::Error("tp, pp, vpp, cp, ep and dp must be at least 1");
  TRESTLE_RETURN_IF_ERROR(
      check_vocab_size_divisible_by(layout.make_vocab_size_divisible_by, "make_vocab_size_divisible_by"));
  if (layout.expert_tp() == layout.tp && layout.cp * layout.dp() % layout.ep != 0)
    return Status::Error(
        (layout.cp > 1 ? "cp x dp " + str(layout.cp) + " x " + str(layout.dp()) : "dp " + str(layout.dp())) +
        " must be a multiple of ep " + str(layout.ep) +
        " (expert-parallel groups are carved out of the context- and data-parallel ranks)");
  if (layout.etp < 0 || layout.tp * layout.cp * layout.dp() % (layout.expert_tp() * layout.ep) != 0)
    return Status::Error("the expert-tensor-parallel size " + str(layout.expert_tp()) + " times ep " + str(layout.ep) +
                         " must divide tp x cp x dp " + str(layout.tp * layout.cp * layout.dp()) +
                         " (Megatron cuts each stage's ranks into etp x ep x expert-data-parallel)");
  if (layout.vpp > 1 && layout.pp == 1)
    return Status::Error("virtual pipeline (vpp " + str(layout.vpp) + ") needs pp > 1");
  TRESTLE_RETURN_IF_ERROR(
      check_divides(num_query_groups, layout.tp, "number of query groups (KV heads)", "the tensor-parallel size"));
  if (layout.ep > 1 && num_experts == 0)
    return Status::Error("expert parallel (ep " + str(layout.ep) + ") needs an MoE model");
  if (num_experts > 0)
    TRESTLE_RETURN_IF_ERROR(check_divides(num_experts, layout.ep, "number of experts", "the expert-parallel size"));
  return pipeline_layers(layout, num_layers).status();
}

}  // namespace trestle
