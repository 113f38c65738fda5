// The trainer's --ckpt-format torch_dist: every checkpoint it commits also holds Megatron-Core's torch_dist form of
// itself (.metadata, one __<rank>_0.distcp per rank of the run's layout, common.pt, metadata.json) in the same
// iteration directory, written by rank 0 from the Trestle files before the commit (on a thread of its own, behind
// training, as the files were), so a crash never leaves one form without the other. Megatron-LM loads the run's
// checkpoints (model, optimizer state as its optimizer saves it, scheduler, data position); Trestle resumes from its
// own files, bit-exactly.
#pragma once

#include <cxxopts.hpp>

#include "ckpt/status.h"
#include "train/loop/trainer.h"

namespace trestle::cli {

// With --ckpt-format torch_dist, sets config.save_options.before_commit to write the torch_dist form (the model
// described, layout and LoRA already in config); refuses what has no torch_dist form. Without it, nothing.
Status use_torch_dist_checkpoints(const cxxopts::ParseResult& args, train::TrainConfig& config);

}  // namespace trestle::cli
