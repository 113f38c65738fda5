// A Hugging Face model directory opened for conversion: config.json read as a BridgeModel, the shards memory-mapped,
// the bridge plan made for one layer-norm naming and checked against what the files hold (each HF tensor consumed
// exactly once). Each canonical tensor's dtype is that of its sources, which must agree. Shared by HF -> Trestle and
// the HF canonical source, which read the tensors through a SourceTensorCache (stored_hf_tensors).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "convert/bridge/bridge_plan.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/sources/source_tensor_cache.h"

namespace trestle {

// How a model's weights are quantised (config.json's quantization_config): not at all, FP8 blocks (quant_method
// "fp8", fmt "e4m3", weight_block_size [rows, cols]: <w> float8_e4m3fn with <w>_scale_inv), or MXFP4 (quant_method
// "mxfp4", GPT-OSS's experts: <w>_blocks / <w>_scales). Both are dequantised to bfloat16 as they are read; other
// quantisations are refused naming `source`.
struct HfQuantization {
  enum class Kind { kNone, kFp8, kMxfp4 } kind = Kind::kNone;
  std::int64_t block_rows = 128, block_cols = 128;  // FP8
  bool any() const { return kind != Kind::kNone; }
};
Result<HfQuantization> hf_quantization(const nlohmann::json& config, const std::string& source);

struct HfModel {
  BridgeModel model;  // a quantised model's without its quantization_config: it is held in bfloat16
  SafetensorsCheckpoint files;
  BridgePlan plan;
  std::vector<DType> dtypes;  // plan.tensors[i]'s source dtype (bfloat16 for quantised weights, dequantised)
  HfQuantization quantization;
  // Lines for people: Hugging Face values Megatron's form cannot hold exactly (a shifted tensor's rounded elements).
  std::vector<std::string> notes;
};

// `config_path` empty: DIR/config.json.
Result<HfModel> open_hf_model(const std::string& dir, NormNaming norms, const std::string& config_path = "");

// Where each of `tensors` lies in its shard (SourceTensorCache's input, in the same order); every one must be present.
// Under FP8 a float8_e4m3fn tensor comes with its `<name>_scale_inv` (float32, one factor per block), under MXFP4 a
// tensor may be stored as `<name>_blocks` + `<name>_scales`; both are held dequantised to bfloat16. A quantised tensor
// whose scales are missing or misshapen, or found without the config saying so, is an error naming it.
Result<std::vector<StoredTensor>> stored_hf_tensors(const SafetensorsCheckpoint& files,
                                                    const std::vector<HfTensor>& tensors,
                                                    const HfQuantization& quantization = {});

// Copies a directory may hold of weights the model shares: a multi-token-prediction layer's embed_tokens and
// shared_head.head repeat the model's embedding and lm_head, and some exporters store a tied model's lm_head beside
// the embedding it is. They are not converted, so they must equal them byte for byte (else something would be lost)
// and are then taken out of `present` (the accounting). Errors name `dir` and the tensor.
Status check_shared_copies(const BridgeModel& model, const SafetensorsCheckpoint& files,
                           std::map<std::string, Shape>& present, const std::string& dir);

// What `present` (the names and shapes a directory holds) looks like to the plan once quantised weights are read
// dequantised: FP8 scales consumed with their weights, MXFP4 blocks and scales replaced by the weight they make.
Status account_quantized(const SafetensorsCheckpoint& files, const std::vector<HfTensor>& tensors,
                         std::map<std::string, Shape>& present, const std::string& source);

}  // namespace trestle
