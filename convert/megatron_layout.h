// How Megatron-Core lays a model out over TP/PP/VPP/EP ranks: the one description the converter, the reshard tool
// and the trainer share. It says which rank holds which layers and experts, how each kind of tensor is split across
// tensor-parallel ranks (as boxes of its canonical, layout-independent global tensor), the padded vocabulary, and
// the layer-norm naming (Transformer Engine or local spec). Pure functions of the description; no I/O.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/manifest.h"
#include "ckpt/status.h"

namespace trestle {

// How a tensor is split over the TP ranks. Boxes are of the canonical global tensor (DESIGN.md): vocab unpadded,
// QKV in per-group order (so TP's contiguous split of groups is a dim-0 split), gated fc1 as [all gate; all up].
enum class TpSplit {
  kReplicated,   // every TP rank holds all of it (norms, router)
  kColumn,       // dim 0 in tp equal parts (linear_qkv weight and bias)
  kRow,          // dim 1 in tp equal parts (linear_proj, linear_fc2)
  kVocab,        // dim 0 of the padded vocab in tp equal parts; the padding rows are not part of the tensor
  kGatedColumn,  // [gate; up] along dim 0: rank r holds gate rows r and up rows r (two boxes)
};
std::string_view tp_split_name(TpSplit split);

enum class NormNaming { kTransformerEngine, kLocal };

struct MegatronLayout {
  int tp = 1;
  int pp = 1;
  int vpp = 1;  // virtual pipeline chunks per stage
  int ep = 1;   // expert parallel: EP groups are carved out of the data-parallel ranks, so ep divides dp
  int data_parallel = 0;  // data-parallel size; 0 = ep (a conversion needs no more replicas than the experts do)
  std::int64_t make_vocab_size_divisible_by = 128;
  // Megatron's decoder_{first,last}_pipeline_num_layers: 0 = even split. The other stages share the rest evenly.
  std::int64_t first_stage_layers = 0;
  std::int64_t last_stage_layers = 0;
  NormNaming norms = NormNaming::kTransformerEngine;

  int dp() const { return data_parallel > 0 ? data_parallel : ep; }
  int world_size() const { return tp * pp * dp(); }
  ParallelLayout parallel_layout() const;  // what the manifest records
};

// Megatron's rank order tp-cp-ep-dp-pp with cp = 1: rank = tp_rank + tp·(dp_rank + dp·pp_rank); ep_rank = dp_rank % ep.
struct RankCoordinates {
  int tp_rank = 0;
  int dp_rank = 0;
  int pp_rank = 0;
  int ep_rank = 0;
};
int global_rank(const MegatronLayout& layout, int tp_rank, int dp_rank, int pp_rank);
RankCoordinates rank_coordinates(const MegatronLayout& layout, int rank);

// Megatron's padded vocabulary: the next multiple of make_vocab_size_divisible_by × tp.
std::int64_t padded_vocab_size(std::int64_t vocab_size, std::int64_t divisible_by, int tp);

// Layers [begin, end) of one model chunk: stage s, virtual chunk v.
struct LayerRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};
// Every (stage, virtual chunk)'s layers, indexed [stage][chunk]. Even split: each of pp·vpp chunks gets L/(pp·vpp)
// layers, chunk v of stage s holding the (v·pp + s)-th block (Megatron's interleaved order). With explicit first /
// last stage sizes (vpp must be 1) the middle stages share the rest evenly. Errors say why a split is impossible.
Result<std::vector<std::vector<LayerRange>>> pipeline_layers(const MegatronLayout& layout, std::int64_t num_layers);
// The stage that owns global layer `layer`.
int stage_of_layer(const std::vector<std::vector<LayerRange>>& stages, std::int64_t layer);

// Experts [begin, end) of EP rank ep_rank: a contiguous block of num_experts / ep.
LayerRange experts_of_rank(const MegatronLayout& layout, std::int64_t num_experts, int ep_rank);

// The boxes of a tensor with canonical global shape `shape` that TP rank tp_rank holds (empty when a vocab split
// leaves this rank only padding). padded_rows is the padded vocab for kVocab and unused otherwise.
Result<std::vector<Box>> tp_boxes(TpSplit split, const Shape& shape, int tp, int tp_rank, std::int64_t padded_rows = 0);

// The distributed optimizer's share of a rank's TP piece (Adam moments, fp32 master weights): shard k of n holds the
// piece's row-major elements [k·N/n, (k+1)·N/n). Dense tensors are sharded over the dp ranks (k = dp_rank); expert
// tensors over the expert-data-parallel ranks (n = dp / ep, k = dp_rank / ep).
struct OptimizerShard {
  int count = 1;
  int index = 0;
};
OptimizerShard optimizer_shard(const MegatronLayout& layout, const RankCoordinates& rank, bool expert);
FlatRange optimizer_flat_range(std::int64_t piece_numel, const OptimizerShard& shard);

// Layer-norm names. TE fuses the input norm into linear_qkv and (dense MLP) the pre-MLP norm into linear_fc1;
// MoE layers keep pre_mlp_layernorm under both specs.
std::string input_norm_name(NormNaming naming);              // relative to decoder.layers.{i}.
std::string pre_mlp_norm_name(NormNaming naming, bool moe);  // relative to decoder.layers.{i}.
// TE when a tensor named like TE's input norm is present, local otherwise.
NormNaming detect_norm_naming(const std::vector<std::string>& tensor_names);

nlohmann::json layout_to_json(const MegatronLayout& layout);
Result<MegatronLayout> layout_from_json(const nlohmann::json& json);
// Checks the sizes against the model: heads and groups divisible by tp, experts by ep, layers splittable.
Status check_layout(const MegatronLayout& layout, std::int64_t num_layers, std::int64_t num_query_groups,
                    std::int64_t num_experts);

}  // namespace trestle
