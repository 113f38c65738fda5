// What a --load or --pretrained-checkpoint directory holds (a Trestle checkpoint, or Megatron-LM's torch_dist or legacy
// form) and what its run's arguments said, which Megatron-LM's --use-checkpoint-args takes over the command line's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ckpt/status.h"

namespace trestle::cli {

// The iteration directory --load names: <root>/iter_N (the tracker's N, or --ckpt-step's) or the directory itself.
std::string iteration_directory(const std::string& root, std::optional<std::int64_t> step);
// A Megatron torch_dist checkpoint (not a Trestle one): DCP's .metadata and Megatron's metadata.json.
bool is_torch_dist(const std::string& directory);
// A Megatron legacy (torch format) checkpoint: mp_rank_XX[_YYY][_ZZZ]/ directories of model_optim_rng.pt.
bool is_legacy_megatron(const std::string& directory);

// The sequence length the checkpoint under `root` (at iteration `step`, else the tracker's) was trained with: a
// Megatron-LM checkpoint's args.seq_length, a Trestle checkpoint's training "megatron_args" (a trainer's save, a
// converted Megatron-LM checkpoint) or, for a save that predates that record, its recorded --seq-length. nullopt when
// there is no checkpoint there or it records none; an unreadable one is an error naming its file.
Result<std::optional<std::int64_t>> checkpoint_seq_length(const std::string& root, std::optional<std::int64_t> step);

}  // namespace trestle::cli
