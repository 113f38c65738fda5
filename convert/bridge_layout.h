// Which pieces of a model's canonical tensors each rank of a Megatron layout holds: its pipeline stage's layers, its
// EP rank's experts and its TP rank's boxes. Model weights are held by every data-parallel rank (a save writes them
// once); optimizer state (Adam moments, fp32 master weights) by one data-parallel rank each, as the distributed
// optimizer's flat shard of the TP piece; a few tensors (step counters) whole by every rank.
#pragma once

#include <vector>

#include "convert/bridge_plan.h"
#include "convert/layout_save.h"

namespace trestle {

enum class Holding { kModelWeight, kOptimizerShard, kEveryRank };

struct PlacedTensor {
  const BridgeTensor* model = nullptr;  // the weight it belongs to; null for kEveryRank
  Holding holding = Holding::kModelWeight;
  Shape shape;  // the global shape, for kEveryRank
};

// ranks[r] lists rank r's pieces, each naming its index in `tensors`. Optimizer shards that come out empty (a piece
// smaller than the data-parallel size) are left out.
Result<std::vector<std::vector<RankPiece>>> place_on_ranks(const std::vector<PlacedTensor>& tensors,
                                                           const BridgeModel& model, const MegatronLayout& layout);

}  // namespace trestle
