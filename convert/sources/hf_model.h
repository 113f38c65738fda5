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

// FP8 block quantisation (quantization_config quant_method "fp8", e4m3, weight_block_size): the block size; nullopt
// for a model without quantization_config. Other quantisations are refused naming `source`.
struct Fp8Blocks {
  std::int64_t rows = 128, cols = 128;
};
Result<std::optional<Fp8Blocks>> hf_fp8_blocks(const nlohmann::json& config, const std::string& source);

struct HfModel {
  BridgeModel model;  // an FP8 model's without its quantization_config: it is held in bfloat16
  SafetensorsCheckpoint files;
  BridgePlan plan;
  std::vector<DType> dtypes;  // plan.tensors[i]'s source dtype (bfloat16 for FP8 weights, dequantised)
  std::optional<Fp8Blocks> fp8;
};

// `config_path` empty: DIR/config.json.
Result<HfModel> open_hf_model(const std::string& dir, NormNaming norms, const std::string& config_path = "");

// Where each of `tensors` lies in its shard (SourceTensorCache's input, in the same order); every one must be present.
// A float8_e4m3fn tensor comes with its `<name>_scale_inv` (float32, one factor per block of `fp8`), to be held
// dequantised to bfloat16; one without it, or without `fp8`, is an error naming it.
Result<std::vector<StoredTensor>> stored_hf_tensors(const SafetensorsCheckpoint& files,
                                                    const std::vector<HfTensor>& tensors,
                                                    const std::optional<Fp8Blocks>& fp8 = std::nullopt);

// A multi-token-prediction layer's embed_tokens and shared_head.head repeat the model's embedding and lm_head; they
// are not converted, so they must equal them byte for byte (else something would be lost) and are then taken out of
// `present` (the accounting). Errors name `dir` and the tensor.
Status check_mtp_copies(const BridgeModel& model, const SafetensorsCheckpoint& files,
                        std::map<std::string, Shape>& present, const std::string& dir);

// Takes the scales of `tensors`' FP8 weights out of `present` (they are consumed with their weights).
void remove_fp8_scales(const SafetensorsCheckpoint& files, const std::vector<HfTensor>& tensors,
                       std::map<std::string, Shape>& present);

}  // namespace trestle
