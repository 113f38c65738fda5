#include "convert/operations.h"

#include <cstdio>
#include <sstream>

#include "ckpt/byte_size.h"
#include "ckpt/printable_text.h"
#include "ckpt/process_memory.h"
#include "convert/hf_rewrite.h"
#include "convert/lora_convert.h"
#include "convert/output_dir.h"
#include "convert/torch_dist_writer.h"

namespace trestle {
namespace {

std::string conversion_summary(const ConversionReport& r, const std::string& dst) {
  std::ostringstream out;
  out << "wrote " << dst << ": " << r.tensors << " tensors";
  if (r.pieces) out << " in " << r.pieces << " chunks";
  out << ", " << format_bytes(r.bytes_written) << " in " << r.seconds << " s";
  if (r.seconds > 0) out << " (" << static_cast<double>(r.bytes_written) / r.seconds / 1e9 << " GB/s)";
  if (r.bytes_read) out << ", " << format_bytes(r.bytes_read) << " read";
  out << "; peak RSS " << format_bytes(r.peak_rss_bytes) << "\n";
  return out.str();
}

// Notes go to stderr whatever the verbosity: they say what a conversion could not keep exactly.
void print_notes(const std::vector<std::string>& notes) {
  for (const auto& note : notes) std::fprintf(stderr, "trestle convert: %s\n", printable_text(note).c_str());
}

Result<std::string> hf_to_hf(const ConvertRequest& r) {
  HfRewriteOptions options;
  options.max_shard_bytes = r.max_shard_bytes;
  options.dtype = r.dtype;
  options.progress = r.progress;
  options.dry_run = r.dry_run;
  TRESTLE_ASSIGN_OR_RETURN(const auto report, rewrite_hf_checkpoint(r.src, r.dst, options));
  if (r.dry_run) return report.plan;
  return "wrote " + r.dst + ": " + std::to_string(report.tensors) + " tensors in " + std::to_string(report.shards) +
         " shard(s), " + format_bytes(report.bytes_written) + "\n";
}

Result<std::string> hf_to_trestle(const ConvertRequest& r) {
  HfToTrestleOptions options;
  options.layout = r.layout;
  options.pipeline_layout = r.pipeline_layout;
  options.norms = r.norms;
  options.dtype = r.dtype;
  options.iteration = r.iteration.value_or(0);
  options.dry_run = r.dry_run;
  options.progress = r.progress;
  options.save.codec = r.codec;
  TRESTLE_ASSIGN_OR_RETURN(const auto report, convert_hf_to_trestle(r.src, r.dst, options));
  print_notes(report.notes);
  return report.plan + (r.dry_run ? "" : conversion_summary(report, r.dst));
}

Result<std::string> to_hf(const CanonicalSource& source, const ConvertRequest& r) {
  ToHfOptions options;
  options.max_shard_bytes = r.max_shard_bytes;
  options.dtype = r.dtype;
  options.experts = r.experts;
  options.dry_run = r.dry_run;
  options.progress = r.progress;
  TRESTLE_ASSIGN_OR_RETURN(const auto report, convert_to_hf(source, r.dst, options));
  return report.plan + (r.dry_run ? "" : conversion_summary(report, r.dst));
}

// The target layout, keeping the pipeline split the source records (a --pipeline-model-parallel-layout's, or the
// embedding and loss counted in it) where the target's pipeline sizes are the source's.
ParallelLayout keeping_recorded_split(ParallelLayout target, const ParallelLayout& recorded) {
  if (target.chunk_layers.empty() && !recorded.chunk_layers.empty() && target.pp == recorded.pp &&
      target.vpp == recorded.vpp && target.first_stage_layers == 0 && target.last_stage_layers == 0)
    target.chunk_layers = recorded.chunk_layers;
  return target;
}

Result<std::string> to_torch_dist(const CanonicalSource& source, const ConvertRequest& r) {
  TorchDistWriteOptions options;
  options.layout = keeping_recorded_split(r.layout, source.model().layout);
  if (r.pipeline_layout) {
    TRESTLE_ASSIGN_OR_RETURN(options.layout, with_pipeline_layout(r.layout, *r.pipeline_layout, source.model().model));
  }
  if (r.keep_vocab_divisor)
    options.layout.make_vocab_size_divisible_by = source.model().layout.make_vocab_size_divisible_by;
  options.iteration = r.iteration;
  options.model_only = r.model_only;
  options.dp_reshardable = r.dp_reshardable;
  options.param_groups = r.param_groups;
  options.dry_run = r.dry_run;
  options.progress = r.progress;
  TRESTLE_ASSIGN_OR_RETURN(const auto report, write_torch_dist(source, r.dst, options));
  print_notes(source.notes());
  if (r.dry_run) return report.plan;
  return report.plan + "wrote " + r.dst + ": " + std::to_string(report.tensors) + " tensors in " +
         std::to_string(report.pieces) + " chunks, " + format_bytes(report.bytes_written) + "; peak RSS " +
         format_bytes(peak_rss_bytes()) + "\n";
}

// A line naming a dp the reshard chose itself (an --ep the source's dp cannot take, without --dp); else empty.
std::string dp_change_note(const ParallelLayout& from, const LayoutChange& change) {
  const ParallelLayout to = apply_layout_change(from, change);
  if (change.dp || to.dp() == from.dp()) return {};
  return "note: dp " + std::to_string(from.dp()) + " -> " + std::to_string(to.dp()) + ": ep " + std::to_string(to.ep) +
         " needs cp x dp to be a multiple of it (--dp chooses another)\n";
}

std::string reshard_summary(const ReshardReport& report) {
  char line[512];
  std::snprintf(line, sizeof line,
                "resharded %llu tensors (%llu optimizer states) into %llu pieces: read %s, wrote %s in %.2f s "
                "(%.2f GB/s written), peak RSS %s\n",
                static_cast<unsigned long long>(report.tensors),
                static_cast<unsigned long long>(report.optimizer_tensors),
                static_cast<unsigned long long>(report.pieces), format_bytes(report.bytes_read).c_str(),
                format_bytes(report.bytes_written).c_str(), report.seconds,
                report.seconds > 0 ? static_cast<double>(report.bytes_written) / report.seconds / 1e9 : 0.0,
                format_bytes(report.peak_rss_bytes).c_str());
  return line;
}

Result<std::string> megatron_to_trestle(const CanonicalSource& source, const ConvertRequest& r) {
  const ParallelLayout& layout = r.layout;
  ReshardOptions options;
  options.change = {
      layout.tp, layout.pp, layout.vpp, layout.ep, std::nullopt, layout.first_stage_layers, layout.last_stage_layers};
  options.change.pipeline_layout = r.pipeline_layout;
  options.save.codec = r.codec;
  options.dry_run = r.dry_run;
  options.progress = r.progress;
  TRESTLE_ASSIGN_OR_RETURN(const auto report, reshard_to_trestle(source, r.dst, options));
  if (r.dry_run) return report.plan;
  return report.plan + "wrote " + r.dst + ": " + std::to_string(report.tensors) + " tensors in " +
         std::to_string(report.pieces) + " chunks, " + format_bytes(report.bytes_written) + "; peak RSS " +
         format_bytes(report.peak_rss_bytes) + "\n";
}

}  // namespace

Result<std::optional<DType>> parse_conversion_dtype(const std::string& text) {
  if (text == "keep") return std::optional<DType>();
  const auto dtype = parse_dtype(text);
  if (!dtype || !is_floating(*dtype) || dtype_size(*dtype) == 1)
    return Status::Error("dtype '" + text + "' is not one of keep, bf16, fp16, fp32");
  return std::optional<DType>(*dtype);
}

Status check_convert_request(const ConvertRequest& r) {
  using F = CheckpointFormat;
  if (r.from == F::kTrestle && r.to == F::kTrestle)
    return Status::Error("trestle -> trestle is a reshard (`trestle reshard IN OUT --tp N ...`)");
  if (r.to == F::kLegacy)
    return Status::Error(
        "writing megatron-legacy is not supported (write megatron-dist, Megatron-Core's default format)");
  if (r.dtype && r.to == F::kTorchDist)
    return Status::Error("a dtype cast is not supported when writing megatron-dist (tensors keep their dtype)");
  if (r.max_shard_bytes == 0) return Status::Error("the largest shard must be more than 0 bytes");
  if (r.dp_reshardable && r.to != F::kTorchDist)
    return Status::Error("the dp_reshardable optimizer format is written to megatron-dist only");
  if (r.dp_reshardable && r.model_only)
    return Status::Error("--model-only writes no optimizer state: drop --optimizer-format dp_reshardable");
  if (r.from == F::kHfPeft && (r.to != F::kTrestle || !r.base))
    return Status::Error(
        "a PEFT adapter converts to an adapter checkpoint for its base: --from hf-peft DIR --base "
        "BASE --to trestle CKPT");
  if (r.to == F::kHfPeft && r.from != F::kTrestle)
    return Status::Error("--to hf-peft writes the adapters of a trestle adapter checkpoint (--from trestle)");
  if (r.merge_lora && (r.from != F::kTrestle || r.to != F::kHf))
    return Status::Error(
        "--merge-lora writes a trestle adapter checkpoint merged into its base: --from trestle "
        "ADAPTER_CKPT --to hf DIR");
  if (r.base && r.from != F::kHfPeft && !r.merge_lora)
    return Status::Error("--base names the base model of a LoRA adapter (--from hf-peft, or --merge-lora)");
  if ((r.from == F::kHfPeft || r.to == F::kHfPeft || r.merge_lora) && r.dry_run)
    return Status::Error("--dry-run is not offered for LoRA adapter conversions (they are small: run them)");
  return OkStatus();
}

Result<std::string> run_convert_request(const ConvertRequest& request) {
  TRESTLE_RETURN_IF_ERROR(check_convert_request(request));
  ConvertRequest r = request;
  if (r.iteration) r.source.iteration = r.iteration;
  r.source.hf_norms = r.norms;
  r.source.model_only = r.model_only;
  using F = CheckpointFormat;
  if (r.from == F::kHf && r.to == F::kHf) return hf_to_hf(r);
  if (r.from == F::kHf && r.to == F::kTrestle) return hf_to_trestle(r);
  if (r.from == F::kHfPeft) {
    PeftImportOptions options;
    options.layout = r.layout;
    options.pipeline_layout = r.pipeline_layout;
    options.dtype = r.dtype;
    options.iteration = r.iteration.value_or(0);
    options.save.codec = r.codec;
    options.progress = r.progress;
    return import_peft_adapter(r.src, *r.base, r.dst, options);
  }
  if (r.to == F::kHfPeft) {
    const bool fused = r.experts && *r.experts != ExpertLayout::kOriginal;
    return export_peft_adapter(r.src, r.dst, {r.iteration, r.dtype, fused, r.progress});
  }
  if (r.from == F::kTrestle) {
    // An adapter checkpoint holds no model: it goes out as a PEFT adapter or merged into its base.
    auto reader = open_checkpoint_path(r.src, r.iteration);
    const bool adapters = reader.ok() && is_adapter_checkpoint(*reader);
    if (adapters && !r.merge_lora)
      return Status::Error(reader->directory() +
                           " is a LoRA adapter checkpoint: --to hf-peft writes its adapters, "
                           "--to hf --merge-lora the model merged with them");
    if (r.merge_lora && reader.ok() && !adapters)
      return Status::Error("--merge-lora: " + reader->directory() + " is not a LoRA adapter checkpoint");
    if (r.merge_lora) {
      // The merged source's path() is its base: the adapter checkpoint is the other source not to write into.
      TRESTLE_RETURN_IF_ERROR(check_output_outside_source(r.dst, r.src));
      TRESTLE_ASSIGN_OR_RETURN(const auto merged, open_merged_lora_source(r.src, r.iteration, r.base, r.progress));
      return to_hf(*merged, r);
    }
  }
  // Every other conversion reads through a canonical source.
  TRESTLE_ASSIGN_OR_RETURN(const auto source, open_canonical_source(r.from, r.src, r.source));
  if (r.to == F::kHf) return to_hf(*source, r);
  if (r.to == F::kTorchDist) return to_torch_dist(*source, r);
  return megatron_to_trestle(*source, r);
}

Result<std::string> run_reshard_request(const ReshardRequest& r) {
  if (r.to && *r.to != CheckpointFormat::kTrestle && *r.to != CheckpointFormat::kTorchDist)
    return Status::Error("a reshard writes trestle or megatron-dist");
  if (r.dp_reshardable && r.source.model_only)
    return Status::Error("--model-only writes no optimizer state: drop --optimizer-format dp_reshardable");
  TRESTLE_ASSIGN_OR_RETURN(const CheckpointFormat from, detect_format(r.in, r.source.iteration));
  const CheckpointFormat to =
      r.to.value_or(from == CheckpointFormat::kTorchDist ? CheckpointFormat::kTorchDist : CheckpointFormat::kTrestle);
  if (r.dp_reshardable && to != CheckpointFormat::kTorchDist)
    return Status::Error("the dp_reshardable optimizer format is written to megatron-dist only (--to-format)");
  TRESTLE_ASSIGN_OR_RETURN(const auto source, open_canonical_source(from, r.in, r.source));
  const std::string note = dp_change_note(source->model().layout, r.change);
  if (to == CheckpointFormat::kTorchDist) {
    TorchDistWriteOptions write;
    write.layout = apply_layout_change(source->model().layout, r.change);
    if (r.change.pipeline_layout) {
      TRESTLE_ASSIGN_OR_RETURN(write.layout,
                               with_pipeline_layout(write.layout, *r.change.pipeline_layout, source->model().model));
    }
    // torch_dist chunks load at any layout; Megatron's dp_reshardable buffers only at the one they were cut for,
    // and Trestle cuts them with the experts split as the dense tensors.
    if (write.layout.expert_tp() != write.layout.tp && r.dp_reshardable)
      return Status::Error(
          "the dp_reshardable optimizer format is written with the experts split as the dense "
          "tensors, but the layout's etp is " +
          std::to_string(write.layout.expert_tp()) + ": pass --etp " + std::to_string(write.layout.tp));
    write.layout.etp = 0;
    write.model_only = r.source.model_only;
    write.dp_reshardable = r.dp_reshardable;
    write.param_groups = r.param_groups;
    write.dry_run = r.dry_run;
    write.progress = r.progress;
    TRESTLE_ASSIGN_OR_RETURN(const auto report, write_torch_dist(*source, r.out, write));
    if (r.dry_run) return note + report.plan;
    char line[512];
    std::snprintf(line, sizeof line,
                  "resharded %llu tensors (%llu optimizer states) into %llu torch_dist chunks: wrote %s, peak RSS %s\n",
                  static_cast<unsigned long long>(report.tensors),
                  static_cast<unsigned long long>(report.optimizer_tensors),
                  static_cast<unsigned long long>(report.pieces), format_bytes(report.bytes_written).c_str(),
                  format_bytes(peak_rss_bytes()).c_str());
    return note + report.plan + line;
  }
  ReshardOptions options;
  options.change = r.change;
  options.save.codec = r.codec;
  options.dry_run = r.dry_run;
  options.progress = r.progress;
  TRESTLE_ASSIGN_OR_RETURN(const auto report, reshard_to_trestle(*source, r.out, options));
  return note + report.plan + (r.dry_run ? "" : reshard_summary(report));
}

}  // namespace trestle
