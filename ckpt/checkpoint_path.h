// A checkpoint named the way users name one: its root (the tracker's iteration, or the one asked for) or one of its
// iteration directories (iter_N holding manifest.json), which must then be the iteration asked for, if any.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ckpt/load.h"

namespace trestle {

Result<CheckpointReader> open_checkpoint_path(const std::string& path, std::optional<std::int64_t> iteration,
                                              const IoOptions& io = {});

}  // namespace trestle
