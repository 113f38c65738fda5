// A Hugging Face model directory opened for conversion: config.json read as a BridgeModel, the shards memory-mapped,
// the bridge plan made for one layer-norm naming and checked against what the files hold (each HF tensor consumed
// exactly once). Each canonical tensor's dtype is that of its sources, which must agree. Shared by HF -> Trestle and
// the HF canonical source, which read the tensors through a SourceTensorCache (stored_hf_tensors).
#pragma once

#include <string>
#include <vector>

#include "convert/bridge/bridge_plan.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/sources/source_tensor_cache.h"

namespace trestle {

struct HfModel {
  BridgeModel model;
  SafetensorsCheckpoint files;
  BridgePlan plan;
  std::vector<DType> dtypes;  // plan.tensors[i]'s source dtype
};

// `config_path` empty: DIR/config.json.
Result<HfModel> open_hf_model(const std::string& dir, NormNaming norms, const std::string& config_path = "");

// Where each of `tensors` lies in its shard (SourceTensorCache's input, in the same order); every one must be present.
Result<std::vector<StoredTensor>> stored_hf_tensors(const SafetensorsCheckpoint& files,
                                                    const std::vector<HfTensor>& tensors);

}  // namespace trestle
