// How Megatron-Core spreads one job over ranks: the sizes (tp, cp, ep, dp, pp, virtual pipeline chunks), the rank
// order tp-cp-ep-dp-pp, which pipeline stage and virtual chunk own which layers, which expert-parallel rank holds which
// experts, the padded vocabulary and the distributed optimizer's share of a piece. The one layout type that the
// converters, the reshard tool, the trainer and the Trestle manifest (as JSON) share. Pure functions; no I/O.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/status.h"

namespace trestle {

struct ParallelLayout {
  int tp = 1;
  int pp = 1;
  int vpp = 1;            // virtual pipeline chunks per stage
  int cp = 1;             // context parallel
  int ep = 1;             // expert parallel: with etp = tp expert groups are carved out of the cp x dp ranks
  // Megatron's --expert-tensor-parallel-size: the routed experts' own tensor parallelism; 0 = tp. The experts'
  // ranks are the tp·cp·dp of a stage cut as etp x ep x expert-data-parallel (so etp·ep divides tp·cp·dp; with
  // etp < tp, ep may span tensor-parallel ranks).
  int etp = 0;
  int data_parallel = 0;  // data-parallel size; 0 = ep (a conversion needs no more replicas than the experts do)
  std::int64_t make_vocab_size_divisible_by = 128;
  // Megatron's decoder_{first,last}_pipeline_num_layers: 0 = even split. The other stages share the rest evenly.
  std::int64_t first_stage_layers = 0;
  std::int64_t last_stage_layers = 0;
  // Megatron's --pipeline-model-parallel-layout (pipeline_layout_string.h): the decoder layers of each virtual stage,
  // entry v·pp + s for chunk v of stage s (pp·vpp entries, any of them 0); empty: the sizes above decide.
  std::vector<std::int64_t> chunk_layers;

  int dp() const { return data_parallel > 0 ? data_parallel : ep; }
  int expert_tp() const { return etp > 0 ? etp : tp; }
  // The expert-data-parallel size: the ranks of a stage holding the same pieces of the same experts.
  int expert_dp() const { return tp * cp * dp() / (expert_tp() * ep); }
  // Whether the experts' groups differ from the dense ones' (expert or expert-tensor parallelism of their own): their
  // gradients then reduce over the expert-data-parallel ranks, not the data-parallel ones.
  bool experts_apart() const { return ep > 1 || expert_tp() != tp; }
  int world_size() const { return tp * cp * dp() * pp; }
  bool operator==(const ParallelLayout&) const = default;
};

// A rank's place in each dimension. Megatron's order tp-cp-ep-dp-pp:
// rank = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank)). Megatron's expert generator cuts the same ranks of a
// stage, q = tp_rank + tp·(cp_rank + cp·dp_rank), as etp_rank + etp·(ep_rank + ep·expert_dp_rank); with etp = tp that
// is ep_rank = (cp_rank + cp·dp_rank) % ep.
struct RankCoordinates {
  int tp_rank = 0;
  int cp_rank = 0;
  int dp_rank = 0;
  int pp_rank = 0;
  int ep_rank = 0;
  int etp_rank = 0;        // in the experts' tensor-parallel group
  int expert_dp_rank = 0;  // in the expert-data-parallel group
};
int global_rank(const ParallelLayout& layout, const RankCoordinates& rank);
RankCoordinates rank_coordinates(const ParallelLayout& layout, int rank);

// Megatron's padded vocabulary: the next multiple of make_vocab_size_divisible_by × tp.
std::int64_t padded_vocab_size(std::int64_t vocab_size, std::int64_t divisible_by, int tp);
// The largest make_vocab_size_divisible_by read or written (times any tp it stays far inside an int64).
inline constexpr std::int64_t kMaxVocabSizeDivisibleBy = std::int64_t{1} << 30;
// `value` as a make_vocab_size_divisible_by, from 1 to kMaxVocabSizeDivisibleBy; the error names it as `named`.
Status check_vocab_size_divisible_by(std::int64_t value, const std::string& named);

// Layers [begin, end) of one model chunk (or experts [begin, end) of one rank).
struct LayerRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};
// Every (stage, virtual chunk)'s layers, indexed [stage][chunk]. Even split: each of pp·vpp chunks gets L/(pp·vpp)
// layers, chunk v of stage s holding the (v·pp + s)-th block (Megatron's interleaved order). With explicit first /
// last stage sizes the middle stages share the rest evenly, and each stage's layers split evenly over its chunks in
// the same order (megatron-core's get_transformer_layer_offset). With chunk_layers, its counts in layer order.
// Errors say why a split is impossible.
Result<std::vector<std::vector<LayerRange>>> pipeline_layers(const ParallelLayout& layout, std::int64_t num_layers);
// The stage that owns global layer `layer`, or -1.
int stage_of_layer(const std::vector<std::vector<LayerRange>>& stages, std::int64_t layer);

// Experts [begin, end) of EP rank ep_rank: a contiguous block of num_experts / ep.
LayerRange experts_of_rank(const ParallelLayout& layout, std::int64_t num_experts, int ep_rank);

// The distributed optimizer's share of a rank's TP piece (Adam moments, fp32 master weights): shard k of n holds the
// piece's row-major elements [k·N/n, (k+1)·N/n). Dense tensors are sharded over the dp ranks (k = dp_rank); expert
// tensors over the expert-data-parallel ranks (n = expert_dp(), k = expert_dp_rank).
struct OptimizerShard {
  int count = 1;
  int index = 0;
};
OptimizerShard optimizer_shard(const ParallelLayout& layout, const RankCoordinates& rank, bool expert);
FlatRange optimizer_flat_range(std::int64_t piece_numel, const OptimizerShard& shard);

// The whole layout as JSON (a converted model's description keeps it), and its sizes alone as the Trestle manifest
// records them ("layout": tp, pp, vpp, dp, ep, cp, and etp where it is not tp). Reading takes either: it checks every
// value, missing sizes default to 1 (dp to ep) and the rest to the defaults above; `source` names the file in errors.
nlohmann::json layout_to_json(const ParallelLayout& layout);
nlohmann::json layout_sizes_to_json(const ParallelLayout& layout);
Result<ParallelLayout> layout_from_json(const nlohmann::json& json, const std::string& source);

// Checks the sizes against a model: query groups divisible by tp, experts by ep, layers splittable over the stages.
Status check_layout(const ParallelLayout& layout, std::int64_t num_layers, std::int64_t num_query_groups,
                    std::int64_t num_experts);

}  // namespace trestle
