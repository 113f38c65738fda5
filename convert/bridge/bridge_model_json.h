// The model description a bridged Trestle checkpoint carries in its manifest: Megatron-Core's sizes, the layout it was
// written with, and the original config.json with the Hugging Face details export needs (expert layout, side files).
// Reading it back yields the BridgeModel and layout again, and a config.json regenerated from it.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/dtype.h"
#include "convert/bridge/bridge_plan.h"
#include "parallel/layout/parallel_layout.h"

namespace trestle {

struct BridgedModel {
  BridgeModel model;
  ParallelLayout layout;
  NormNaming norms = NormNaming::kTransformerEngine;  // the layer-norm names its Megatron tensors have
  ExpertLayout experts = ExpertLayout::kOriginal;
  std::vector<std::string> side_files;  // tokenizer / generation files kept in <root>/hf_files/
};

nlohmann::json bridged_model_to_json(const BridgedModel& bridged);
// `source` names the manifest in errors.
Result<BridgedModel> bridged_model_from_json(const nlohmann::json& model, const std::string& source);
// bridged_model_to_json, read back as the checkpoint's readers will (bridged_model_from_json, then
// gpt_spec_from_json): a writer refuses, naming `destination`, a description they would refuse.
Result<nlohmann::json> checked_bridged_model_json(const BridgedModel& bridged, const std::string& destination);

// Records the weights' dtype in a config.json ("dtype" / "torch_dtype", whichever it uses).
void set_config_dtype(nlohmann::json& config, DType dtype);
// The same in a model's config: its language model's, and a vision-language model's whole config.json with its parts.
void set_model_dtype(HfModelConfig& config, DType dtype);

// config.json for export: the original one, with the dtype updated when tensors were cast.
nlohmann::ordered_json export_hf_config(const BridgedModel& bridged, std::optional<DType> cast_to);

}  // namespace trestle
