// Any canonical source (Trestle, torch_dist, legacy) -> Hugging Face: each canonical tensor is read once (gathered from
// whatever ranks and chunks hold it, the next one while this one is written), cast if asked, and its runs are written
// straight into the safetensors shards being filled.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <sstream>

#include "ckpt/aligned_buffer.h"
#include "ckpt/atomic_file.h"
#include "ckpt/byte_size.h"
#include "ckpt/dtype_cast.h"
#include "ckpt/process_memory.h"
#include "ckpt/progress.h"
#include "convert/bridge/bridge_copy.h"
#include "convert/bridge_convert.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "convert/output_dir.h"
#include "convert/sources/canonical_source.h"

namespace trestle {
namespace fs = std::filesystem;
namespace {

// Hugging Face order: embeddings, then layer by layer, then the final norm and head (as save_pretrained lists them).
std::pair<std::int64_t, std::string> hf_order_key(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.starts_with(prefix)) return {std::strtoll(name.c_str() + prefix.size(), nullptr, 10), name};
  if (name.starts_with("model.embed_tokens")) return {-1, name};
  return {std::numeric_limits<std::int64_t>::max(), name};
}

// Smaller tensors are read together in batches of up to this many bytes (larger ones alone).
constexpr std::size_t kReadBatchBytes = 16u << 20;

// Where each batch starts (and, last, sizes.size()): runs of consecutive tensors whose sizes add up to at most `limit`,
// a larger tensor alone.
std::vector<std::size_t> read_batches(const std::vector<std::size_t>& sizes, std::size_t limit) {
  std::vector<std::size_t> starts;
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (starts.empty() || bytes + sizes[i] > limit) {
      starts.push_back(i);
      bytes = 0;
    }
    bytes += sizes[i];
  }
  starts.push_back(sizes.size());
  return starts;
}

// DeepSeek's releases give each multi-token-prediction layer model.layers.<L + k>.embed_tokens.weight and
// shared_head.head.weight, copies of the embedding and the head it shares (what vLLM's and SGLang's MTP models load):
// the plan's embedding and head also feed those copies.
void add_mtp_copies(const BridgeModel& model, BridgePlan& plan) {
  if (!model.deepseek_moe()) return;  // Qwen3-Next's MTP layer keeps no copies
  for (std::int64_t k = 0; k < model.mtp_layers; ++k) {
    const std::string p = "model.layers." + std::to_string(model.hf.num_layers + k) + ".";
    const std::map<std::string, std::string> copies = {{"model.embed_tokens.weight", p + "embed_tokens.weight"},
                                                       {"lm_head.weight", p + "shared_head.head.weight"}};
    std::map<std::size_t, std::size_t> copy_of;  // hf index -> its copy's
    for (std::size_t i = 0, n = plan.hf.size(); i < n; ++i)
      if (const auto c = copies.find(plan.hf[i].name); c != copies.end()) {
        copy_of[i] = plan.hf.size();
        plan.hf.push_back({c->second, plan.hf[i].shape});
      }
    // A tied model's head is its embedding: both copies come from it.
    if (model.tied() && copy_of.size() == 1) {
      const std::size_t embedding = copy_of.begin()->first;
      copy_of.clear();
      copy_of.emplace(embedding, plan.hf.size() - 1);
      plan.hf.push_back({p + "shared_head.head.weight", plan.hf[embedding].shape});
    }
    for (BridgeTensor& t : plan.tensors) {
      std::vector<ElementRun> added;
      for (const ElementRun& r : t.runs)
        for (const auto& [from, to] : copy_of)
          if (r.hf_index == from) {
            ElementRun copy = r;
            copy.hf_index = to;
            added.push_back(copy);
          }
      t.runs.insert(t.runs.end(), added.begin(), added.end());
    }
  }
}

}  // namespace

Result<ConversionReport> convert_to_hf(const CanonicalSource& source, const std::string& dst,
                                       const ToHfOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const BridgedModel& bridged = source.model();
  std::map<std::string, const LayoutTensor*> by_name;
  std::vector<std::string> names;
  std::map<std::string, Shape> present;
  for (const auto& t : source.tensors()) {
    if (t.name.starts_with("optimizer.")) continue;  // training state has no Hugging Face counterpart
    names.push_back(t.name);
    present[t.name] = t.shape;
    by_name[t.name] = &t;
  }
  ExpertLayout experts = options.experts.value_or(bridged.experts);
  // transformers reads experts stored transposed for Qwen3-VL-MoE only (its conversion mapping transposes them); a
  // folder of another class written so would not load. (GPT-OSS's rules store its experts as it publishes them.)
  if (options.experts == ExpertLayout::kFusedTransposed && bridged.model.is_moe() && !bridged.model.gpt_oss() &&
      bridged.model.architecture != "Qwen3VLMoeForConditionalGeneration")
    return Status::Error(bridged.model.architecture +
                         ": --hf-expert-layout fused_transposed is Qwen3-VL-MoE's publishing layout, which "
                         "transformers reads for that class only: give fused (transformers 5's own) or original");
  if (experts == ExpertLayout::kOriginal && hf_experts_fused_only(bridged.model)) {
    if (options.experts)
      return Status::Error(bridged.model.architecture +
                           ": transformers reads this model's experts fused only (gate_up_proj / down_proj): "
                           "--hf-expert-layout fused or fused_transposed, not original");
    experts = ExpertLayout::kFused;
  }
  TRESTLE_ASSIGN_OR_RETURN(BridgePlan plan, make_bridge_plan(bridged.model, detect_norm_naming(names), experts));
  TRESTLE_RETURN_IF_ERROR(check_accounting(canonical_shapes(plan), present, source.description()));
  add_mtp_copies(bridged.model, plan);

  // Each Hugging Face tensor takes the (cast) dtype of the Megatron tensors that feed it.
  std::vector<std::optional<DType>> hf_dtypes(plan.hf.size());
  std::vector<DType> out_dtypes;
  std::uint64_t total = 0;
  for (const auto& t : plan.tensors) {
    const DType stored = by_name.at(t.name)->dtype;
    const DType out =
        options.dtype && is_floating(stored) && can_cast(stored, *options.dtype) ? *options.dtype : stored;
    out_dtypes.push_back(out);
    total += static_cast<std::uint64_t>(numel(t.shape)) * dtype_size(stored);
    for (const auto& r : t.runs) {
      auto& d = hf_dtypes[r.hf_index];
      if (d && *d != out) return Status::Error("'" + plan.hf[r.hf_index].name + "' would be fed tensors of two dtypes");
      d = out;
    }
  }
  std::vector<TensorSpec> specs;
  for (std::size_t i = 0; i < plan.hf.size(); ++i) specs.push_back({plan.hf[i].name, *hf_dtypes[i], plan.hf[i].shape});
  std::sort(specs.begin(), specs.end(),
            [](const TensorSpec& a, const TensorSpec& b) { return hf_order_key(a.name) < hf_order_key(b.name); });

  ConversionReport report;
  std::ostringstream text;
  const ParallelLayout& l = bridged.layout;
  text << "source        " << source.description() << " (tp " << l.tp << ", pp " << l.pp << ", vpp " << l.vpp << ", ep "
       << l.ep << ")\nmodel         " << bridged.model.architecture << ", " << plan.tensors.size()
       << " Megatron tensors -> " << specs.size() << " Hugging Face tensors (" << expert_layout_name(experts)
       << " expert layout), " << format_bytes(total) << "\n";
  std::uint64_t largest = 0;
  std::vector<std::size_t> stored_sizes;
  for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
    const DType stored = by_name.at(plan.tensors[i].name)->dtype;
    stored_sizes.push_back(static_cast<std::size_t>(numel(plan.tensors[i].shape)) * dtype_size(stored));
    const std::uint64_t per_element = dtype_size(stored) + (out_dtypes[i] != stored ? dtype_size(out_dtypes[i]) : 0);
    largest = std::max<std::uint64_t>(largest, static_cast<std::uint64_t>(numel(plan.tensors[i].shape)) * per_element);
  }
  text << "memory        about "
       << format_bytes(2 * std::max<std::uint64_t>(largest, kReadBatchBytes) + kReadBufferBytes + kReadStagingBytes)
       << " (the largest tensor and its cast, or a batch of smaller tensors, twice: one is read while the other is "
          "written; read buffers)\n";
  report.plan = text.str();
  if (options.dry_run) {
    TRESTLE_RETURN_IF_ERROR(StagedOutput::check_destination(dst, source.path()));
    return report;
  }
  TRESTLE_ASSIGN_OR_RETURN(StagedOutput output, StagedOutput::begin(dst, source.path()));

  TRESTLE_ASSIGN_OR_RETURN(
      auto writer, ShardedSafetensorsWriter::create(output.path(), specs, options.max_shard_bytes, {{"format", "pt"}}));
  Progress progress("trestle -> hf " + fs::path(dst).filename().string(), total, options.progress);
  // Tensors are read in batches of consecutive ones (a large tensor alone, or smaller ones up to kReadBatchBytes,
  // issued to the source at once), the next batch on another thread while this one is written: two page-aligned
  // read buffers, grown as needed and reused, each tensor page-aligned in its batch (so O_DIRECT reads land in place
  // without a bounce).
  std::vector<std::size_t> aligned_sizes;
  for (const std::size_t size : stored_sizes) aligned_sizes.push_back(align_up(size, kIoAlignment));
  const std::vector<std::size_t> batch_starts = read_batches(aligned_sizes, kReadBatchBytes);
  AlignedBuffer buffers[2];
  std::vector<std::byte> cast, reordered;
  auto read_batch = [&](std::size_t b) {
    return std::async(std::launch::async, [&, b] {
      const std::size_t first = batch_starts[b], end = batch_starts[b + 1];
      std::size_t bytes = 0;
      for (std::size_t i = first; i < end; ++i) bytes += aligned_sizes[i];
      std::span<std::byte> buffer = buffers[b % 2].first(bytes);
      std::vector<LoadRequest> requests;
      for (std::size_t i = first, at = 0; i < end; at += aligned_sizes[i], ++i)
        requests.push_back(
            {plan.tensors[i].name, Piece{whole_box(plan.tensors[i].shape), std::nullopt}, buffer.data() + at});
      return source.read_many(requests);
    });
  };
  const std::size_t batches = batch_starts.size() - 1;
  std::future<Status> next = batches == 0 ? std::future<Status>() : read_batch(0);
  for (std::size_t b = 0; b < batches; ++b) {
    TRESTLE_RETURN_IF_ERROR(next.get());
    if (b + 1 < batches) next = read_batch(b + 1);
    std::size_t at = 0;
    for (std::size_t i = batch_starts[b]; i < batch_starts[b + 1]; at += aligned_sizes[i], ++i) {
      const BridgeTensor& t = plan.tensors[i];
      const DType stored = by_name.at(t.name)->dtype;
      const std::span<const std::byte> loaded = buffers[b % 2].span().subspan(at, stored_sizes[i]);
      std::span<const std::byte> data = loaded;
      if (out_dtypes[i] != stored || t.shift != 0.0) {
        cast.resize(static_cast<std::size_t>(numel(t.shape)) * dtype_size(out_dtypes[i]));
        // A shifted tensor (Qwen3-Next's gated norm) takes its Hugging Face value, rounded once to the output dtype.
        TRESTLE_RETURN_IF_ERROR(t.shift != 0.0 ? shift_and_cast(stored, loaded, -t.shift, out_dtypes[i], cast)
                                               : cast_elements(stored, loaded, out_dtypes[i], cast));
        data = cast;
      }
      const std::size_t size = dtype_size(out_dtypes[i]);
      for (const auto& r : t.runs) {
        std::span<const std::byte> part =
            data.subspan(static_cast<std::size_t>(r.canonical_offset) * size, static_cast<std::size_t>(r.count) * size);
        if (r.order != RunOrder::kSame) {  // put the run's elements in the Hugging Face order first
          reordered.resize(part.size());
          for (std::int64_t k = 0; k < r.count; ++k)
            std::memcpy(reordered.data() + static_cast<std::size_t>(run_hf_element(r, k)) * size,
                        part.data() + static_cast<std::size_t>(k) * size, size);
          part = reordered;
        }
        TRESTLE_RETURN_IF_ERROR(
            writer->write_part(plan.hf[r.hf_index].name, static_cast<std::uint64_t>(r.hf_offset) * size, part));
      }
      report.bytes_written += data.size();
      TRESTLE_RETURN_IF_ERROR(progress.advance(loaded.size()));
    }
  }
  TRESTLE_RETURN_IF_ERROR(writer->commit());
  progress.finish();

  TRESTLE_RETURN_IF_ERROR(write_file_atomically((fs::path(output.path()) / "config.json").string(),
                                                export_hf_config(bridged, options.dtype).dump(2) + "\n"));
  TRESTLE_RETURN_IF_ERROR(copy_side_files(source, output.path()));
  TRESTLE_RETURN_IF_ERROR(output.commit());
  report.bytes_read = source.bytes_read();
  report.tensors = specs.size();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.peak_rss_bytes = peak_rss_bytes();
  return report;
}

}  // namespace trestle
