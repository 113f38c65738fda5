// Writing a Trestle checkpoint in a parallel layout from pieces produced on demand (a converter reading another
// format, the reshard tool reading another layout): every rank runs the ordinary save protocol (plan, write, commit)
// in its own thread of a ThreadGroup, at most `concurrent_writers` ranks writing at once (admitted in rank order), each
// holding one piece and its staging. Replicated pieces are written once, by the save's replica planning.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/layout_tensor.h"
#include "ckpt/save.h"

namespace trestle {

// Fills `out` (the piece's bytes in the tensor's dtype). Called from several rank threads at once.
using RankPieceFiller = std::function<Status(const RankPiece& piece, std::span<std::byte> out)>;

struct LayoutSaveOptions {
  SaveOptions save;
  int concurrent_writers = 2;
  bool progress = true;
  std::string progress_label = "save";
};

struct LayoutSaveReport {
  std::uint64_t bytes_written = 0;
  std::uint64_t pieces_written = 0;
};

// Saves iteration info.iteration under `root` with ranks[r] the pieces of rank r (ranks.size() is the world size).
Result<LayoutSaveReport> save_layout(const std::string& root, const CheckpointInfo& info,
                                     const std::vector<LayoutTensor>& tensors,
                                     const std::vector<std::vector<RankPiece>>& ranks, const RankPieceFiller& fill,
                                     const LayoutSaveOptions& options);

// Each distinct piece once (a piece replicated on several ranks is written, so filled, once), in rank order.
std::vector<const RankPiece*> distinct_pieces(const std::vector<std::vector<RankPiece>>& ranks);

// Bytes of the distinct pieces (replicas counted once): what save_layout writes.
std::uint64_t distinct_piece_bytes(const std::vector<LayoutTensor>& tensors,
                                   const std::vector<std::vector<RankPiece>>& ranks);

}  // namespace trestle
