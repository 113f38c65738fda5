// A training checkpoint in the Trestle format (DESIGN.md "Trainer"): every parameter's piece under its canonical name,
// the optimizer's fp32 masters and moments as optimizer.{fp32_param,exp_avg,exp_avg_sq}.<name> (same pieces) and
// optimizer.step, the loop's progress (iteration, consumed samples, scheduler, the run's arguments) as JSON in the
// manifest's "training", and each rank's RNG state in its "ranks" entry. Saving is asynchronous (ckpt/async_saver.h):
// the call returns once the pieces are staged. Loading is resharding: any saved layout loads into any layout.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/async_saver.h"
#include "ckpt/load.h"
#include "train/model/model_parameters.h"
#include "train/optim/adamw.h"

namespace trestle::train {

struct TrainingProgress {
  std::int64_t iteration = 0;
  std::int64_t consumed_train_samples = 0;
  std::int64_t consumed_valid_samples = 0;  // where the next periodic validation starts in its split (Megatron's)
  std::int64_t skipped_iterations = 0;
  std::int64_t skipped_train_samples = 0;  // passed over by --iterations-to-skip (Megatron's skipped_train_samples)
  nlohmann::json scheduler = nlohmann::json::object();  // LrSchedule::state()
  nlohmann::json loss_scaler = nlohmann::json::object();
  nlohmann::json args = nlohmann::json::object();  // the run's arguments, for the record
  // What Megatron-LM's --use-checkpoint-args takes from a checkpoint, under its names ({"seq_length": S}); as a
  // converted Megatron-LM checkpoint keeps it (kept_megatron_args).
  nlohmann::json megatron_args = nlohmann::json::object();
};

struct TrainingCheckpoint {
  std::string root;
  nlohmann::json layout;  // the saving layout (layout_to_json)
  nlohmann::json model;   // the manifest's model description (carried from the loaded checkpoint, layout updated)
  std::vector<CheckpointInfo::File> files;  // whole files carried along (a converted model's tokenizer files)
  TrainingProgress progress;
  at::Device device = at::kCPU;  // the model's: a GPU's generator state is saved beside the CPU's
  bool save_rng = true;          // Megatron's --no-save-rng clears it: no generator state is saved
  // Parameters written from another tensor of their shape, in its dtype (the router expert biases' fp32 values,
  // which Megatron keeps and saves in fp32 whatever the training dtype).
  std::map<std::string, at::Tensor> saved_as;
};

// Which part of a parameter's piece one optimizer entry (AdamW's i-th parameter) holds: all of it, or under the
// distributed optimizer the flat elements [start, stop) of the piece (its boxes stacked), saved as flat ranges of the
// boxes so that any layout, with or without the distributed optimizer, loads them.
struct OptimizerSlice {
  std::size_t parameter = 0;  // index into the model's parameters
  std::optional<FlatRange> range;
};
// One whole-piece slice per parameter (the optimizer without sharding).
std::vector<OptimizerSlice> whole_optimizer_slices(const ModelParameters& parameters);

// Stages this rank's pieces (parameters, and optimizer state unless `optimizer` is null) and this rank's RNG states
// (CPU, and GPU when the model runs on one; none without save_rng), packed by the fused cast-and-pack kernels
// (kernels/cast_pack.h), and starts writing; the saver's finalize() (or its next save) commits. A collective over
// `world`. `frozen` (may be null): weights saved beside the parameters without optimizer state (a vision-language
// model's tower).
Status save_training_checkpoint_async(AsyncSaver& saver, Collective& world, const TrainingCheckpoint& checkpoint,
                                      const ModelParameters& parameters, AdamW* optimizer,
                                      const std::vector<OptimizerSlice>& slices, const SaveOptions& options,
                                      const ModelParameters* frozen = nullptr);

// The hex encoding of this process's default generator state for `device` (the CPU, or a GPU), and its restoration.
std::string rng_state(at::Device device);
Status restore_rng_state(at::Device device, const std::string& hex);

struct LoadedTraining {
  TrainingProgress progress;
  bool optimizer_loaded = false;
  bool rng_loaded = false;
  bool rng_absent = false;         // saved on this layout but holding no CPU generator state for this rank
  bool progress_recorded = false;  // the manifest holds consumed samples (a Trestle training checkpoint)
};

struct TrainingLoadOptions {
  bool weights_only = false;   // --finetune: parameters only, progress starts at zero
  bool load_optimizer = true;  // --no-load-optim clears it
  bool load_rng = true;        // --no-load-rng clears it; RNG states load only when the saved layout is this one
  int rank = 0;
  nlohmann::json layout;         // this run's layout (layout_to_json)
  at::Device device = at::kCPU;  // this run's model device: on a GPU its generator state is restored too
};

// Loads the parameters and, unless weights only, the optimizer state (when the checkpoint has it: a converted model
// at iteration 0 has none, and the optimizer then starts fresh from the loaded weights; a checkpoint of a later
// iteration without it, saved with --no-save-optim or converted with --model-only, is refused unless load_optimizer is
// cleared, as Megatron-LM's load_checkpoint stops), the progress and this rank's RNG state.
// The optimizer's masters are copied into the parameters after loading. Errors name the checkpoint and tensor.
Result<LoadedTraining> load_training_checkpoint(const CheckpointReader& reader, ModelParameters& parameters,
                                                AdamW& optimizer, const std::vector<OptimizerSlice>& slices,
                                                const TrainingLoadOptions& options);

}  // namespace trestle::train
