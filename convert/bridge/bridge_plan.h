// The concrete conversion plan for one model: every canonical Megatron tensor (name, global shape, TP split, owning
// layer and expert) as runs of elements copied from Hugging Face tensors. Both directions and verification execute
// the same plan, and its accounting checks that every Hugging Face tensor is consumed exactly once and every
// Megatron tensor produced exactly once, naming the leftovers otherwise.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "convert/bridge/architectures.h"

namespace trestle {

// The Hugging Face MoE layouts: per-expert tensors; transformers 5's fused gate_up_proj [E, 2I, H] / down_proj
// [E, H, I]; or the same stored transposed, gate_up_proj [E, H, 2I] / down_proj [E, I, H] (Qwen3-VL-MoE as Qwen
// publishes it).
enum class ExpertLayout { kOriginal, kFused, kFusedTransposed };
std::string_view expert_layout_name(ExpertLayout layout);  // "original" | "fused" | "fused_transposed"
std::optional<ExpertLayout> expert_layout_from_name(std::string_view name);
// The layout a Hugging Face checkpoint's tensors (name -> shape) have: fused when it holds mlp.experts.gate_up_proj,
// transposed when their shapes say so (down_proj's [E, I, H] rather than [E, H, I]; where I equals H, gate_up_proj's).
ExpertLayout detect_expert_layout(const BridgeModel& model, const std::map<std::string, Shape>& hf_tensors);
// Whether transformers reads the model's experts fused only, having no per-expert form of them (Qwen3-VL-MoE).
inline bool hf_experts_fused_only(const BridgeModel& model) { return model.is_moe() && model.vision_language(); }

struct HfTensor {
  std::string name;
  Shape shape;
};

// How a run's elements correspond (GPT-OSS's experts): in the same order, or the run's canonical block [rows, cols]
// stored transposed ([cols, rows]), and/or with its two row halves [gate; up] interleaved (gate row j stored as row
// 2j, up row j as 2j + 1).
enum class RunOrder { kSame, kTransposed, kInterleavedHalves, kTransposedInterleavedHalves };

// `count` elements at flat element hf_offset of hf tensor hf_index are elements [canonical_offset, +count) of the
// Megatron tensor (both row-major), in the same order unless `order` says otherwise.
struct ElementRun {
  std::size_t hf_index;
  std::int64_t hf_offset;
  std::int64_t canonical_offset;
  std::int64_t count;
  RunOrder order = RunOrder::kSame;
  std::int64_t rows = 0, cols = 0;  // the canonical block, for other orders (rows · cols == count)
};

// Where the run's canonical element k (counted from its canonical_offset) lies in its Hugging Face range (counted
// from hf_offset).
std::int64_t run_hf_element(const ElementRun& run, std::int64_t k);

// A canonical Megatron tensor (name, global shape, TP split, placement: the layout library's) and how it is made.
struct BridgeTensor : CanonicalTensor {
  std::vector<ElementRun> runs;  // ascending canonical_offset, covering the tensor exactly once
  double shift = 0.0;            // each Megatron element is its Hugging Face one plus this, rounded to the dtype
};

struct BridgePlan {
  std::vector<BridgeTensor> tensors;
  std::vector<HfTensor> hf;  // every Hugging Face tensor the plan reads or writes
  ExpertLayout experts = ExpertLayout::kOriginal;
};

// Builds the plan from the config's sizes, checking its own accounting: each HF tensor covered exactly once, and each
// canonical tensor of the Megatron model (megatron_spec) made by exactly one rule.
Result<BridgePlan> make_bridge_plan(const BridgeModel& model, NormNaming norms, ExpertLayout experts);

// Hugging Face names that hold no weights (buffers older checkpoints saved); they are skipped, not converted.
bool is_ignored_hf_tensor(const std::string& name);

// Conversion accounting against what a source really holds: every present tensor must be consumed by the plan with
// the plan's shape, and every tensor the plan needs must be present. Errors list the leftovers by name.
// `source` names the checkpoint in errors; ignored Hugging Face names in `present` are skipped.
Status check_accounting(const std::map<std::string, Shape>& planned, const std::map<std::string, Shape>& present,
                        const std::string& source);
std::map<std::string, Shape> hf_shapes(const BridgePlan& plan);
std::map<std::string, Shape> canonical_shapes(const BridgePlan& plan);

}  // namespace trestle
