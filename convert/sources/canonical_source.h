// A model checkpoint of any supported format seen as its canonical Megatron tensors (names with global layer and
// expert indices, canonical global shapes: vocab unpadded, QKV in per-group order, gated fc1 [all gate; all up]) plus
// the model they belong to, from which any box can be read. Export to Hugging Face, reshard and the torch_dist writer
// read through this, so every pair of formats converts in every layout.
//
// Formats: a Trestle checkpoint (its manifest describes the model; optimizer.* tensors are listed too), a torch_dist
// directory (stacked or per-layer keys mapped by megatron_dist_names.h; Megatron-Core's model-space Adam state as
// optimizer.<state>.<weight> and its common step as optimizer.step), a legacy mp_rank_* tree (each rank's local
// tensors mapped by bridge_layout.h's placement for the layout in its args), and a Hugging Face directory.
// The model of a Megatron checkpoint comes from `--hf-config` when given, else from the trestle_model.json Trestle
// keeps in the torch_dist directories it writes, else from Megatron's args; errors say which were looked for. (A
// Trestle checkpoint's manifest describes its model; a Hugging Face directory its config.json.)
// read() may be called from several threads at once.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/layout_tensor.h"
#include "ckpt/load.h"
#include "convert/bridge/bridge_model_json.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/formats/torch/pickle_value.h"

namespace trestle {

// kHfPeft: a Hugging Face PEFT LoRA adapter directory (lora_convert.h), converted to and from adapter checkpoints.
enum class CheckpointFormat { kHf, kTrestle, kTorchDist, kLegacy, kHfPeft };
std::string_view format_name(CheckpointFormat format);  // hf, trestle, megatron-dist, megatron-legacy, hf-peft
Result<CheckpointFormat> parse_format(const std::string& name);
// manifest.json / tracker of a Trestle root -> trestle; .metadata (here or in the tracker's iter dir) -> torch_dist
// (an iteration holding both, as the trainer's --ckpt-format torch_dist saves, is read as the Trestle checkpoint);
// mp_rank_* -> legacy; adapter_config.json -> hf-peft; config.json + safetensors -> hf. With `iteration`, a root's
// iter dir of that number decides (a root may hold iterations of several formats) when it is there.
Result<CheckpointFormat> detect_format(const std::string& path, std::optional<std::int64_t> iteration = std::nullopt);

struct SourceOptions {
  std::optional<std::int64_t> iteration;                 // default: the tracker's
  std::string hf_config;                                 // a config.json or a directory holding one; empty: none given
  NormNaming hf_norms = NormNaming::kTransformerEngine;  // the layer-norm names a Hugging Face source is read as
  bool model_only = false;                               // read the model weights only, leaving any optimizer state out
};

class CanonicalSource {
 public:
  virtual ~CanonicalSource() = default;

  // "torch_dist /path/iter_0000010" for plans and errors.
  virtual std::string description() const = 0;
  // Fills `out` (piece.numel() elements of the tensor's dtype). Flat pieces (optimizer shards) from Trestle and
  // torch_dist.
  virtual Status read(const std::string& name, const Piece& piece, std::span<std::byte> out) const = 0;
  // Fills several pieces (each destination piece.numel() elements of its tensor's dtype). A Trestle checkpoint issues
  // them as one load, so many small tensors stream at the disk's speed instead of one round trip each; the others
  // read them one by one.
  virtual Status read_many(std::span<const LoadRequest> requests) const;
  // A hint, given once before the first read: the model tensors will be read in this order, once per listing. A Hugging
  // Face source starts reading its tensors ahead of the reads (in background threads, within its cache's budget), so
  // the disk reads while the caller writes; the others ignore it.
  virtual void expect_reads(std::span<const std::string> names) const { (void)names; }
  // That the copies a format keeps of one piece on several ranks agree (a legacy tree's replicated tensors: norms and
  // routers in every tensor-parallel rank's file, dense layers in every expert-parallel rank's), where reads take the
  // first; an error names the tensor and both files. Ok for formats that store each piece once.
  virtual Status check_replicas() const { return OkStatus(); }

  const BridgedModel& model() const { return model_; }
  // The path it was opened from (what open_canonical_source was given; empty for a source made otherwise).
  const std::string& path() const { return path_; }
  // The tensors: model weights under canonical names, and for Trestle and torch_dist checkpoints optimizer.* state too.
  const std::vector<LayoutTensor>& tensors() const { return tensors_; }
  const LayoutTensor* find(const std::string& name) const;
  std::int64_t iteration() const { return iteration_; }
  // A Trestle checkpoint's training state; a torch_dist checkpoint's learning-rate scheduler ({"scheduler": ...},
  // Megatron's state_dict keys) when it has optimizer state; empty elsewhere.
  const nlohmann::json& training() const { return training_; }
  // Where the Hugging Face side files (tokenizer, generation config) listed in model().side_files are; empty: none.
  const std::string& side_files_dir() const { return side_files_dir_; }
  SideFileLinks side_file_links() const { return side_file_links_; }
  std::uint64_t bytes_read() const { return bytes_read_; }
  // A Trestle checkpoint's weights origin (weights_origin_digest); empty for the other formats.
  const std::string& weights_origin() const { return weights_origin_; }
  // Lines for people about what the Megatron form of the source changes (a Hugging Face source's rounded elements).
  const std::vector<std::string>& notes() const { return notes_; }

 protected:
  friend Result<std::unique_ptr<CanonicalSource>> open_canonical_source(CheckpointFormat format,
                                                                        const std::string& path,
                                                                        const SourceOptions& options);
  BridgedModel model_;
  std::vector<std::string> notes_;
  std::vector<LayoutTensor> tensors_;
  std::int64_t iteration_ = 0;
  nlohmann::json training_ = nlohmann::json::object();
  std::string side_files_dir_;
  std::string path_;
  std::string weights_origin_;
  SideFileLinks side_file_links_ = SideFileLinks::kRefuse;  // a Hugging Face directory (cache snapshot) may link
  mutable std::uint64_t bytes_read_ = 0;                    // updated under the implementations' own locks
};

Result<std::unique_ptr<CanonicalSource>> open_canonical_source(CheckpointFormat format, const std::string& path,
                                                               const SourceOptions& options);

// Which weights a Trestle checkpoint holds, whatever layout holds them: the manifest digest (manifest_file_digest) of
// the checkpoint they were first written to. A reshard moves weights without changing a bit, so it records its
// source's origin as training[kWeightsOriginKey]; a checkpoint without that record is its own origin. An adapter
// checkpoint records its base's origin, so a resharded copy of the base is known as that base.
inline constexpr const char* kWeightsOriginKey = "weights_origin_xxh3_64";
// `training`: the manifest's training state; `manifest_path` the manifest.json it came from (digested when it holds
// no record; named in errors, as a record that is not 16 hexadecimal digits is).
Result<std::string> weights_origin_digest(const nlohmann::json& training, const std::string& manifest_path);

// Copies the source's Hugging Face side files (model().side_files) into directory `to`, creating it when needed.
Status copy_side_files(const CanonicalSource& source, const std::string& to);

// The iteration directory of a torch_dist checkpoint: PATH itself when it holds .metadata, else the asked (or the
// tracker's) iteration under it; and that iteration.
Result<std::pair<std::string, std::int64_t>> torch_dist_iteration_dir(const std::string& path,
                                                                      std::optional<std::int64_t> iteration);

// What a Megatron-LM checkpoint keeps of its run's arguments (kept_megatron_args, its converted form's training
// "megatron_args"), read from its args alone: what --use-checkpoint-args needs before the checkpoint converts. {} when
// it saved no args.
Result<nlohmann::json> read_torch_dist_run_args(const std::string& path, std::optional<std::int64_t> iteration);
Result<nlohmann::json> read_legacy_run_args(const std::string& path);  // a legacy root or iteration directory

// The implementations (one file each).
Result<std::unique_ptr<CanonicalSource>> open_trestle_source(const std::string& path, const SourceOptions& options);
Result<std::unique_ptr<CanonicalSource>> open_torch_dist_source(const std::string& path, const SourceOptions& options);
Result<std::unique_ptr<CanonicalSource>> open_legacy_source(const std::string& path, const SourceOptions& options);
Result<std::unique_ptr<CanonicalSource>> open_hf_source(const std::string& path, const SourceOptions& options);

// The model description Trestle keeps in the torch_dist directories it writes (bridged_model_to_json), beside
// hf_files/ with the Hugging Face side files.
inline constexpr const char* kKeptModelFile = "trestle_model.json";

// The model a Megatron checkpoint describes: --hf-config when given (the layout still from args when present), else
// the kept description at `kept_model` when it exists, else the args Namespace. `source` names the checkpoint in
// errors.
Result<BridgedModel> megatron_source_model(const SourceOptions& options, const std::string& kept_model,
                                           const PickleValue* args, const std::string& source);

// A model from a config (not Trestle's kept model) that can hold multi-token-prediction layers takes as many as the
// checkpoint's names hold: `mtp.layers.0.eh_proj.weight`, `mtp.layers.1.…`, each whole or after a prefix ending in
// '.' (a legacy rank file's `model.`).
void count_stored_mtp_layers(BridgedModel& model, const std::vector<std::string>& names);

}  // namespace trestle
