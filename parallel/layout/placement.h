// Which pieces of a model's canonical tensors each rank of a layout holds: its pipeline stage's layers, its EP rank's
// experts and its TP rank's boxes (its expert-TP rank's for the routed experts). Model weights are held by every
// data-parallel (and context-parallel) rank (a save writes them once); optimizer state (Adam moments, fp32 master
// weights) by one data-parallel rank each, as the distributed optimizer's flat shard of the TP piece; a few tensors
// (step counters) whole by every rank.
#pragma once

#include <vector>

#include "ckpt/layout_tensor.h"
#include "parallel/layout/model_spec.h"
#include "parallel/layout/parallel_layout.h"

namespace trestle {

enum class Holding { kModelWeight, kOptimizerShard, kEveryRank };

struct PlacedTensor {
  const CanonicalTensor* model = nullptr;  // the weight it is or belongs to; null for kEveryRank
  Holding holding = Holding::kModelWeight;
  Shape shape;  // the global shape, for kEveryRank
};

// ranks[r] lists rank r's pieces, each naming its index in `tensors`. Optimizer shards that come out empty (a piece
// smaller than the data-parallel size) are left out.
Result<std::vector<std::vector<RankPiece>>> place_on_ranks(const std::vector<PlacedTensor>& tensors,
                                                           const GptModelSpec& model, const ParallelLayout& layout);

// The pieces of rank `rank` only (what a training process holds).
Result<std::vector<RankPiece>> pieces_of_rank(const std::vector<PlacedTensor>& tensors, const GptModelSpec& model,
                                              const ParallelLayout& layout, int rank);

}  // namespace trestle
