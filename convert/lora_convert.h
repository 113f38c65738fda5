// LoRA adapter checkpoints (a Trestle checkpoint whose manifest's model carries "lora": lora_spec.h) to and from
// Hugging Face PEFT adapters, and merged into their base: a fused linear_qkv / linear_fc1 adapter becomes exact
// per-projection PEFT adapters (rows of B, the same A), separate PEFT q/k/v or gate/up adapters become the canonical
// form, routed experts' adapters use the per-expert linears or PEFT's adapters on transformers 5's fused expert
// parameters (target_parameters), modules of other ranks (rank_pattern) are padded to one rank with zero components
// and trimmed back on export; merging adds (alpha / r) · B · A to each adapted weight in fp32 and stores it in the
// base's dtype. Everything is checked (names, shapes, ranks, the base's identity) before a
// byte is written, and outputs appear whole or not at all.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "ckpt/checkpoint_path.h"
#include "ckpt/dtype.h"
#include "ckpt/save.h"
#include "convert/sources/canonical_source.h"
#include "parallel/layout/lora_spec.h"
#include "parallel/layout/parallel_layout.h"

namespace trestle {

// Whether the checkpoint's manifest describes LoRA adapters (model.lora).
bool is_adapter_checkpoint(const CheckpointReader& reader);

// The checkpoint at `base` (a model, not adapters) as an adapter checkpoint records its base: its absolute directory,
// manifest digest and weights origin.
Result<LoraBase> lora_base_of(const CheckpointReader& base);
// Whether `given` holds the weights the adapters of `adapters` were trained on (`recorded`): its manifest is the
// recorded one; or its weights have the recorded origin (a reshard of the base, or the base of a reshard); or, where
// the recorded base is still at its path with its manifest, both describe the same model and every model tensor is
// equal bit for bit (both read whole, a note says so; `given` then takes the recorded weights origin, which its
// weights are). Returns a line for people (empty for the recorded manifest); an error names both checkpoints and what
// differs. `progress`: the comparison says it runs and shows its progress.
Result<std::string> check_lora_base(const LoraBase& recorded, LoraBase& given, const std::string& adapters,
                                    bool progress);

struct PeftExportOptions {
  std::optional<std::int64_t> iteration;
  std::optional<DType> dtype;  // default: the adapters' own
  // Routed experts' adapters on the fused expert parameters (target_parameters), as transformers 5 builds MoE models,
  // even where per-expert linears exist (the files of Mixtral, Qwen2/3-MoE, DeepSeek, ... and transformers 4 keep
  // them); the fused form is written anyway where the model has no per-expert linears (GPT-OSS, Gemma 4, ...).
  bool fused_experts = false;
  bool progress = true;
};
// ADAPTER_CKPT (an adapter checkpoint) -> DST, a new PEFT adapter directory. Returns the summary line.
Result<std::string> export_peft_adapter(const std::string& adapter_ckpt, const std::string& dst,
                                        const PeftExportOptions& options);

struct PeftImportOptions {
  ParallelLayout layout;       // of the adapter checkpoint written
  std::optional<std::string> pipeline_layout;  // Megatron's --pipeline-model-parallel-layout over layout's pp
  std::optional<DType> dtype;  // default: the PEFT tensors' own
  std::int64_t iteration = 0;
  SaveOptions save;
  bool progress = true;
};
// PEFT_DIR (adapter_config.json + adapter_model.safetensors) for the model of BASE (a Trestle checkpoint) -> DST, a
// new adapter checkpoint recording BASE. Returns the summary line.
Result<std::string> import_peft_adapter(const std::string& peft_dir, const std::string& base, const std::string& dst,
                                        const PeftImportOptions& options);

// The base of adapter checkpoint ADAPTER_CKPT (at `base` when given, else where it recorded it; check_lora_base must
// accept it, and its note goes to stderr) seen as a canonical source whose adapted weights read merged:
// W + (alpha / r) · B · A in fp32, in W's dtype. `progress`: the comparison of the base's tensors shows progress.
Result<std::unique_ptr<CanonicalSource>> open_merged_lora_source(const std::string& adapter_ckpt,
                                                                 std::optional<std::int64_t> iteration,
                                                                 const std::optional<std::string>& base, bool progress);

// "rank 16, alpha 32, lora on [linear_qkv, ...], base /x/iter_0000000 (digest ...)": what inspect shows.
std::string describe_adapter_checkpoint(const CheckpointReader& reader);
// A PEFT directory's rank, alpha, dropout, targets, base and adapted modules (format, path, r, lora_alpha,
// lora_dropout, target_modules, base_model_name_or_path, modules, tensors, bytes), its files checked as an import
// would read them.
Result<nlohmann::ordered_json> summarize_peft_dir(const std::string& dir);

}  // namespace trestle
