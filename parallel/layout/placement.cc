#include "parallel/layout/placement.h"

namespace trestle {
namespace {

int owner_stage(const CanonicalTensor& t, const std::vector<std::vector<LayerRange>>& stages) {
  switch (t.placement) {
    case Placement::kFirstStage:
      return 0;
    case Placement::kLastStage:
      return static_cast<int>(stages.size()) - 1;
    case Placement::kLayer:
      return stage_of_layer(stages, t.layer);
  }
  return -1;
}

Status place_rank(const std::vector<PlacedTensor>& tensors, const GptModelSpec& model, const ParallelLayout& layout,
                  const std::vector<std::vector<LayerRange>>& stages, int rank, std::vector<RankPiece>& mine) {
  const std::int64_t padded = padded_vocab_size(model.vocab_size, layout.make_vocab_size_divisible_by, layout.tp);
  const RankCoordinates c = rank_coordinates(layout, rank);
  const LayerRange experts = experts_of_rank(layout, model.num_experts, c.ep_rank);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const PlacedTensor& placed = tensors[i];
    if (placed.holding == Holding::kEveryRank) {
      mine.push_back({i, Piece{whole_box(placed.shape), std::nullopt}});
      continue;
    }
    const CanonicalTensor& t = *placed.model;
    if (owner_stage(t, stages) != c.pp_rank) continue;
    if (t.expert >= 0 && (t.expert < experts.begin || t.expert >= experts.end)) continue;
    const bool expert = t.expert >= 0;  // routed experts split over their own tensor-parallel group
    auto split =
        tp_boxes(t.split, t.shape, expert ? layout.expert_tp() : layout.tp, expert ? c.etp_rank : c.tp_rank, padded);
    if (!split.ok()) return Status::Error(t.name + ": " + split.status().message());
    const auto& boxes = *split;
    for (const auto& box : boxes) {
      if (placed.holding == Holding::kModelWeight) {
        mine.push_back({i, Piece{box, std::nullopt}});
        continue;
      }
      const FlatRange flat = optimizer_flat_range(box.numel(), optimizer_shard(layout, c, t.expert >= 0));
      if (flat.stop > flat.start) mine.push_back({i, Piece{box, flat}});
    }
  }
  return OkStatus();
}

}  // namespace

Result<std::vector<std::vector<RankPiece>>> place_on_ranks(const std::vector<PlacedTensor>& tensors,
                                                           const GptModelSpec& model, const ParallelLayout& layout) {
  TRESTLE_ASSIGN_OR_RETURN(const auto stages, pipeline_layers(layout, model.num_layers));
  std::vector<std::vector<RankPiece>> ranks(static_cast<std::size_t>(layout.world_size()));
  for (int rank = 0; rank < layout.world_size(); ++rank)
    TRESTLE_RETURN_IF_ERROR(place_rank(tensors, model, layout, stages, rank, ranks[static_cast<std::size_t>(rank)]));
  return ranks;
}

Result<std::vector<RankPiece>> pieces_of_rank(const std::vector<PlacedTensor>& tensors, const GptModelSpec& model,
                                              const ParallelLayout& layout, int rank) {
  if (rank < 0 || rank >= layout.world_size())
    return Status::Error("rank " + std::to_string(rank) + " is outside the layout's " +
                         std::to_string(layout.world_size()) + " ranks");
  TRESTLE_ASSIGN_OR_RETURN(const auto stages, pipeline_layers(layout, model.num_layers));
  std::vector<RankPiece> mine;
  TRESTLE_RETURN_IF_ERROR(place_rank(tensors, model, layout, stages, rank, mine));
  return mine;
}

}  // namespace trestle
