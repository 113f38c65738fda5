// Writing a rank's file from pieces produced on demand (a converter reading another format), so a rank never holds
// more than one piece. It is step 2 of save.h's protocol; steps 1 and 3 (plan_save, commit_save) are unchanged and
// read only the items' names, dtypes, shapes and pieces, so streamed items carry streamed_data() as their data.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/save.h"

namespace trestle {

// Placeholder data pointer for items whose bytes a PieceFiller produces.
const std::byte* streamed_data();

// Fills `out` (exactly items[index].nbytes() bytes) with the piece's row-major elements.
using PieceFiller = std::function<Status(std::size_t index, std::span<std::byte> out)>;
// Called after each piece is written with its raw byte count (progress reporting); may be empty.
using PieceWritten = std::function<void(std::uint64_t bytes)>;

// Like write_rank_file, with each piece in to_write produced by `fill` into one reused page-aligned buffer just before
// it is written. Memory: the largest piece plus the writer's staging buffers.
Result<RankChunks> write_rank_file_streaming(const std::string& temp_dir, int rank, std::span<const SaveItem> items,
                                             const std::vector<std::size_t>& to_write, const PieceFiller& fill,
                                             const SaveOptions& options, const PieceWritten& written = {});

}  // namespace trestle
