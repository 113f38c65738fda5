#include "convert/sources/hf_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "ckpt/dtype_cast.h"
#include "convert/bridge/bridge_copy.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/formats/safetensors/fp8_blocks.h"
#include "convert/formats/safetensors/mxfp4.h"

namespace trestle {

Status check_shared_copies(const BridgeModel& model, const SafetensorsCheckpoint& files,
                           std::map<std::string, Shape>& present, const std::string& dir) {
  auto same = [&](const std::string& copy, const std::string& original, const char* why) -> Status {
    TRESTLE_ASSIGN_OR_RETURN(const auto a, files.view(copy));
    TRESTLE_ASSIGN_OR_RETURN(const auto b, files.view(original));
    if (a.dtype != b.dtype || a.shape != b.shape || std::memcmp(a.data, b.data, a.nbytes()) != 0)
      return Status::Error(dir + ": '" + copy + "' differs from '" + original + "', " + why + "; it cannot be carried");
    present.erase(copy);
    return OkStatus();
  };
  if (model.tied()) {  // lm_head beside the embedding it is tied to (of the language model, in a multimodal one)
    const std::vector<std::string> heads = [&] {
      std::vector<std::string> out;
      for (const auto& [name, shape] : present)
        if (name.ends_with("lm_head.weight")) out.push_back(name);
      return out;
    }();
    for (const std::string& head : heads) {
      const std::string prefix = head.substr(0, head.size() - std::string_view("lm_head.weight").size());
      for (const std::string& embedding :
           {prefix + "model.embed_tokens.weight", prefix + "model.language_model.embed_tokens.weight"})
        if (present.count(embedding)) {
          TRESTLE_RETURN_IF_ERROR(same(head, embedding, "which tie_word_embeddings makes the same weight"));
          break;
        }
    }
  }
  if (!model.deepseek_moe()) return OkStatus();  // Qwen3-Next's MTP layer has no copies
  for (std::int64_t k = 0; k < model.mtp_layers; ++k) {
    const std::string p = "model.layers." + std::to_string(model.hf.num_layers + k) + ".";
    for (const auto& [copy, original] :
         {std::pair{p + "embed_tokens.weight", std::string("model.embed_tokens.weight")},
          {p + "shared_head.head.weight", std::string(model.tied() ? "model.embed_tokens.weight" : "lm_head.weight")}})
      if (present.count(copy))
        TRESTLE_RETURN_IF_ERROR(same(copy, original, "which the multi-token-prediction layer shares in Megatron-Core"));
  }
  return OkStatus();
}

// Qwen3-Next's gated norm is stored zero-centred (weight - 1) in Megatron's form, rounded to the tensor's dtype as
// Megatron-Bridge rounds it: exact for weights near 1, not for all. Says which tensors lose bits, and how much.
Result<std::vector<std::string>> shift_rounding_notes(const BridgePlan& plan, const SafetensorsCheckpoint& files) {
  std::vector<std::string> notes;
  for (const auto& t : plan.tensors) {
    if (t.shift == 0.0 || t.runs.size() != 1) continue;
    const std::string& name = plan.hf[t.runs.front().hf_index].name;
    TRESTLE_ASSIGN_OR_RETURN(const auto view, files.view(name));
    if (!is_floating(view.dtype)) continue;
    const std::int64_t n = numel(view.shape);
    // There in the tensor's dtype and back, as the conversions compute it: what does not return to its value is lost.
    std::vector<double> values(static_cast<std::size_t>(n)), back(values.size());
    std::vector<std::byte> rounded(values.size() * dtype_size(view.dtype));
    TRESTLE_RETURN_IF_ERROR(cast_elements(view.dtype, {view.data, view.nbytes()}, DType::kF64,
                                          std::as_writable_bytes(std::span(values))));
    TRESTLE_RETURN_IF_ERROR(shift_and_cast(DType::kF64, std::as_bytes(std::span(values)), t.shift, view.dtype, rounded));
    TRESTLE_RETURN_IF_ERROR(shift_and_cast(view.dtype, rounded, -t.shift, view.dtype, rounded));
    TRESTLE_RETURN_IF_ERROR(cast_elements(view.dtype, rounded, DType::kF64, std::as_writable_bytes(std::span(back))));
    std::int64_t inexact = 0;
    double largest = 0;
    for (std::size_t i = 0; i < values.size(); ++i)
      if (back[i] != values[i]) {
        ++inexact;
        largest = std::max(largest, std::abs(back[i] - values[i]));
      }
    if (inexact > 0)
      notes.push_back("note: " + std::to_string(inexact) + " of " + std::to_string(n) + " elements of '" + name +
                      "' do not survive Megatron's zero-centred form " + t.name + " (the weight - 1 in " +
                      std::string(dtype_name(view.dtype)) + "): rounded as Megatron-Bridge rounds them, each by at "
                      "most " + std::to_string(largest) + " on the way back; --dtype float32 keeps them");
  }
  return notes;
}

Result<HfModel> open_hf_model(const std::string& dir, NormNaming norms, const std::string& config_path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    const bool exists = std::filesystem::exists(std::filesystem::symlink_status(dir, ec));
    return Status::Error(dir + (exists ? ": not a directory" : ": no such directory") +
                         "; a Hugging Face model is read from its directory (config.json beside its .safetensors "
                         "files)");
  }
  TRESTLE_RETURN_IF_ERROR(check_hf_dir_links(dir));  // before any of its files is opened
  const std::string config_file =
      config_path.empty() ? (std::filesystem::path(dir) / "config.json").string() : config_path;
  TRESTLE_ASSIGN_OR_RETURN(const auto config, read_hf_config(config_file));
  TRESTLE_ASSIGN_OR_RETURN(BridgeModel model, bridge_model_from_config(config));
  TRESTLE_ASSIGN_OR_RETURN(const HfQuantization quantization, hf_quantization(config.raw, config_file));
  model.hf.raw.erase("quantization_config");
  if (!model.hf.given.is_null()) model.hf.given.erase("quantization_config");
  if (!model.hf.outer.is_null()) model.hf.outer.erase("quantization_config");  // converted, the weights are bfloat16
  TRESTLE_ASSIGN_OR_RETURN(auto files, SafetensorsCheckpoint::open(dir));
  model.mtp_layers = count_mtp_layers(model, files.names());
  std::map<std::string, Shape> present;
  for (const auto& name : files.names()) present[name] = files.find(name)->entry->shape;
  name_vision_tower(model, has_nested_vision_tower(files.names()));
  carry_towers_found(model, present);
  TRESTLE_ASSIGN_OR_RETURN(BridgePlan plan, make_bridge_plan(model, norms, detect_expert_layout(model, present)));
  TRESTLE_RETURN_IF_ERROR(check_shared_copies(model, files, present, dir));
  TRESTLE_RETURN_IF_ERROR(account_quantized(files, plan.hf, present, dir));
  TRESTLE_RETURN_IF_ERROR(check_accounting(hf_shapes(plan), present, dir));
  TRESTLE_ASSIGN_OR_RETURN(const auto stored, stored_hf_tensors(files, plan.hf, quantization));  // checks scales
  std::vector<DType> dtypes;
  for (const auto& t : plan.tensors) {
    const DType in = stored[t.runs.front().hf_index].loaded_dtype();
    for (const auto& r : t.runs)
      if (stored[r.hf_index].loaded_dtype() != in)
        return Status::Error(dir + ": '" + t.name + "': its sources " + plan.hf[t.runs.front().hf_index].name +
                             " and " + plan.hf[r.hf_index].name + " have different dtypes");
    if (!is_floating(in))  // a damaged or hostile file: weights are floating-point numbers
      return Status::Error(dir + ": '" + plan.hf[t.runs.front().hf_index].name + "' is stored as " +
                           std::string(dtype_name(in)) +
                           "; a model weight must be floating point (F32, BF16, F16, "
                           "F64 or F8)");
    dtypes.push_back(in);
  }
  TRESTLE_ASSIGN_OR_RETURN(auto notes, shift_rounding_notes(plan, files));
  return HfModel{std::move(model), std::move(files), std::move(plan), std::move(dtypes), quantization, std::move(notes)};
}

Result<HfQuantization> hf_quantization(const nlohmann::json& config, const std::string& source) {
  const auto q = config.find("quantization_config");
  if (q == config.end() || q->is_null()) return HfQuantization{};
  auto text = [&](const char* key) {
    const auto it = q->find(key);
    return q->is_object() && it != q->end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  const std::string method = text("quant_method"), format = text("fmt");
  if (method == "mxfp4") return HfQuantization{HfQuantization::Kind::kMxfp4};
  const auto block = q->is_object() ? q->find("weight_block_size") : q->end();
  if (method != "fp8" || (!format.empty() && format != "e4m3") || block == q->end() || !block->is_array() ||
      block->size() != 2 || !(*block)[0].is_number_integer() || !(*block)[1].is_number_integer() ||
      (*block)[0].get<std::int64_t>() <= 0 || (*block)[1].get<std::int64_t>() <= 0)
    return Status::Error(source + ": quantization_config " + q->dump().substr(0, 200) +
                         " is not supported: Trestle dequantises FP8 block-quantised weights (quant_method \"fp8\", "
                         "fmt \"e4m3\", weight_block_size [rows, cols]) and MXFP4-packed ones (quant_method "
                         "\"mxfp4\") to bfloat16");
  return HfQuantization{HfQuantization::Kind::kFp8, (*block)[0].get<std::int64_t>(), (*block)[1].get<std::int64_t>()};
}

namespace {

// The FP8 scale of `stored` (float8_e4m3fn), checked.
Result<Fp8BlockScale> fp8_scale(const SafetensorsCheckpoint& files, const StoredTensor& stored,
                                const HfQuantization& q) {
  const std::string scale_name = stored.name + "_scale_inv";
  if (q.kind != HfQuantization::Kind::kFp8)
    return Status::Error(stored.file + ": '" + stored.name +
                         "' is float8_e4m3fn, but config.json has no FP8 quantization_config (weight_block_size) to "
                         "dequantise it with");
  const auto scale = files.find(scale_name);
  const Shape grid = fp8_scale_shape(stored.shape, q.block_rows, q.block_cols);
  if (!scale.ok()) return Status::Error(stored.file + ": FP8 weight '" + stored.name + "' has no '" + scale_name + "'");
  if (scale->entry->dtype != DType::kF32 || scale->entry->shape != grid || grid.empty())
    return Status::Error(scale->file->path() + ": '" + scale_name + "' is " +
                         std::string(dtype_name(scale->entry->dtype)) + " " + to_string(scale->entry->shape) +
                         "; expected f32 " + to_string(grid) + " (one factor per " + std::to_string(q.block_rows) +
                         "x" + std::to_string(q.block_cols) + " block of " + to_string(stored.shape) + ")");
  return Fp8BlockScale{scale_name, scale->file->path(), scale->file->data_start() + scale->entry->begin, grid,
                       q.block_rows, q.block_cols};
}

// `name` stored MXFP4-packed (<name>_blocks, <name>_scales), checked; an error when it is not.
Result<StoredTensor> mxfp4_tensor(const SafetensorsCheckpoint& files, const std::string& name, const HfQuantization& q) {
  const auto blocks = files.find(name + "_blocks");
  if (!blocks.ok()) return files.find(name).status();  // neither the tensor nor its packed form: name what is missing
  const auto scales = files.find(name + "_scales");
  if (q.kind != HfQuantization::Kind::kMxfp4)
    return Status::Error(blocks->file->path() + ": '" + name +
                         "_blocks' is MXFP4-packed, but config.json's quantization_config does not say mxfp4");
  const Shape& shape = blocks->entry->shape;
  const Shape scales_shape(shape.begin(), shape.end() - (shape.empty() ? 0 : 1));
  if (blocks->entry->dtype != DType::kU8 || mxfp4_weight_shape(shape).empty())
    return Status::Error(blocks->file->path() + ": '" + name + "_blocks' is " +
                         std::string(dtype_name(blocks->entry->dtype)) + " " + to_string(shape) +
                         "; expected u8 [experts, rows, groups, 16]");
  if (!scales.ok()) return Status::Error(blocks->file->path() + ": '" + name + "_blocks' has no '" + name + "_scales'");
  if (scales->entry->dtype != DType::kU8 || scales->entry->shape != scales_shape)
    return Status::Error(scales->file->path() + ": '" + name + "_scales' is " +
                         std::string(dtype_name(scales->entry->dtype)) + " " + to_string(scales->entry->shape) +
                         "; expected u8 " + to_string(scales_shape) + " (one per 32 values of '" + name +
                         "_blocks')");
  StoredTensor stored{name, blocks->file->path(), blocks->file->data_start() + blocks->entry->begin, DType::kU8,
                      mxfp4_weight_shape(shape), std::nullopt, std::nullopt};
  stored.mxfp4 = Mxfp4Scales{name + "_scales", scales->file->path(),
                             scales->file->data_start() + scales->entry->begin, shape};
  return stored;
}

}  // namespace

Result<std::vector<StoredTensor>> stored_hf_tensors(const SafetensorsCheckpoint& files,
                                                    const std::vector<HfTensor>& tensors,
                                                    const HfQuantization& quantization) {
  std::vector<StoredTensor> out;
  for (const auto& t : tensors) {
    const auto located = files.find(t.name);
    if (!located.ok()) {
      TRESTLE_ASSIGN_OR_RETURN(StoredTensor packed, mxfp4_tensor(files, t.name, quantization));
      out.push_back(std::move(packed));
      continue;
    }
    StoredTensor stored{t.name, located->file->path(), located->file->data_start() + located->entry->begin,
                        located->entry->dtype, located->entry->shape, std::nullopt, std::nullopt};
    if (stored.dtype == DType::kF8E4M3) {
      TRESTLE_ASSIGN_OR_RETURN(stored.fp8, fp8_scale(files, stored, quantization));
    }
    out.push_back(std::move(stored));
  }
  return out;
}

Status account_quantized(const SafetensorsCheckpoint& files, const std::vector<HfTensor>& tensors,
                         std::map<std::string, Shape>& present, const std::string& source) {
  for (const auto& t : tensors) {
    const auto located = files.find(t.name);
    if (located.ok()) {
      if (located->entry->dtype == DType::kF8E4M3) present.erase(t.name + "_scale_inv");
      continue;
    }
    const auto blocks = present.find(t.name + "_blocks");
    if (blocks == present.end()) continue;
    if (!present.count(t.name + "_scales"))
      return Status::Error(source + ": MXFP4-packed '" + t.name + "_blocks' has no '" + t.name + "_scales'");
    const Shape weight = mxfp4_weight_shape(blocks->second);
    present.erase(blocks);
    present.erase(t.name + "_scales");
    present[t.name] = weight;  // empty when the blocks are misshapen: the accounting names it
  }
  return OkStatus();
}

}  // namespace trestle
