// trestle verify PATH: reads every byte of a checkpoint, checks every checksum and that each tensor's chunks cover it
// exactly once (torch_dist / legacy: every canonical tensor read whole). With --against HF_DIR it also compares every
// tensor with a Hugging Face model after undoing the Megatron layout. Exit 0 when intact (and identical), 1 otherwise,
// 2 on a usage error.
#include <chrono>
#include <cstdio>
#include <cxxopts.hpp>
#include <filesystem>
#include <iostream>
#include <optional>
#include <vector>

#include "ckpt/byte_size.h"
#include "ckpt/checkpoint_path.h"
#include "ckpt/load.h"
#include "convert/bridge_verify.h"
#include "convert/lora_convert.h"
#include "convert/reshard.h"
#include "convert/sources/canonical_source.h"
#include "tools/command.h"

namespace trestle::cli {
namespace {

Outcome failed(const Status& status) { return failure(Status::Error("FAILED: " + status.message())); }

// Prints each tensor's largest absolute difference; exit 0 when none exceeds the tolerance.
Outcome compare_against(const CanonicalSource& source, const std::string& hf_dir, double tolerance) {
  auto result = compare_with_hf(source, hf_dir);
  if (!result.ok()) return failed(result.status());
  std::size_t differing = 0;
  for (const auto& t : result->tensors) {
    std::printf("%-70s max abs diff %g\n", t.name.c_str(), t.max_abs_diff);
    if (!(t.max_abs_diff <= tolerance)) ++differing;
  }
  std::printf("%s: %zu tensors compared with %s, max abs diff %g, %zu above tolerance %g\n",
              differing ? "FAILED" : "ok", result->tensors.size(), hf_dir.c_str(), result->max_abs_diff, differing,
              tolerance);
  return finished(differing ? kExitFailure : kExitOk);
}

// torch_dist and legacy checkpoints carry no checksums: every canonical tensor is read whole instead, which checks
// that the stored chunks cover it exactly and match the model's shapes.
Outcome verify_megatron(const CanonicalSource& source) {
  std::uint64_t bytes = 0;
  std::vector<std::byte> data;
  for (const auto& t : source.tensors()) {
    data.resize(static_cast<std::size_t>(numel(t.shape)) * dtype_size(t.dtype));
    if (Status s = source.read(t.name, Piece{whole_box(t.shape), std::nullopt}, data); !s.ok()) return failed(s);
    bytes += data.size();
  }
  if (Status s = source.check_replicas(); !s.ok()) return failed(s);
  std::printf("ok: %s: %zu canonical tensors read whole (%s; the format has no checksums of its own)\n",
              source.description().c_str(), source.tensors().size(), format_bytes(bytes).c_str());
  return finished();
}

// A trainer's --ckpt-format torch_dist iteration also holds the checkpoint in Megatron-LM's form, which its manifest
// does not checksum (Trestle resumes from its own files; Megatron-LM loads these): read whole as a torch_dist
// checkpoint is. Nothing to do for an iteration without one.
Outcome verify_torch_dist_form(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(dir) / ".metadata", ec)) return finished();
  auto source = open_canonical_source(CheckpointFormat::kTorchDist, dir, SourceOptions{});
  if (!source.ok()) return failed(source.status().with_context(dir + ": its torch_dist form"));
  return verify_megatron(**source);
}

void declare_verify(cxxopts::Options& spec) {
  spec.add_options()("iteration", "iteration to check (default: the tracker's latest)", cxxopts::value<std::int64_t>())(
      "against", "Hugging Face model directory to compare every tensor with", cxxopts::value<std::string>())(
      "tolerance", "largest absolute difference accepted with --against", cxxopts::value<double>()->default_value("0"))(
      "hf-config", "config.json describing a Megatron checkpoint's model (when it keeps none and has no args)",
      cxxopts::value<std::string>())("path", "checkpoint root (or one of its iteration directories)",
                                     cxxopts::value<std::string>());
  spec.parse_positional({"path"});
  spec.positional_help("PATH");
}

Outcome run_verify(const cxxopts::ParseResult& args) {
  if (!args.count("path")) return usage_error("PATH is required");
  if (Outcome usage =
          check_paths_not_empty(args, {{"path", "PATH"}, {"against", "--against"}, {"hf-config", "--hf-config"}});
      usage.code != kExitOk)
    return usage;
  if (args.count("tolerance") && !args.count("against"))
    return usage_error("--tolerance bounds the differences of --against DIR: give --against too");
  const double tolerance = args["tolerance"].as<double>();
  if (!(tolerance >= 0)) return usage_error("--tolerance must be 0 or more, not " + std::to_string(tolerance));
  std::optional<std::int64_t> iteration;
  if (args.count("iteration")) iteration = args["iteration"].as<std::int64_t>();
  const std::string path = args["path"].as<std::string>();
  auto format = detect_format(path, iteration);
  if (!format.ok()) return failure(format.status());
  SourceOptions source_options;
  source_options.iteration = iteration;
  if (args.count("hf-config")) source_options.hf_config = args["hf-config"].as<std::string>();
  if (*format != CheckpointFormat::kTrestle) {
    auto source = open_canonical_source(*format, path, source_options);
    if (!source.ok()) return failed(source.status());
    Outcome outcome = verify_megatron(**source);
    if (outcome.code != kExitOk || !args.count("against")) return outcome;
    return compare_against(**source, args["against"].as<std::string>(), tolerance);
  }
  const auto start = std::chrono::steady_clock::now();
  auto reader = open_checkpoint_path(path, iteration);  // a root or one of its iteration directories
  if (!reader.ok()) return failure(reader.status());
  LoadStats stats;
  const Status s = reader->verify(&stats);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!s.ok()) return failed(s);
  std::printf("ok: %s: %zu tensors, %llu blocks verified, %s read in %.2f s\n", reader->directory().c_str(),
              reader->manifest().tensors.size(), static_cast<unsigned long long>(stats.blocks_verified),
              format_bytes(stats.bytes_read).c_str(), seconds);
  if (Outcome form = verify_torch_dist_form(reader->directory()); form.code != kExitOk) return form;
  // A model's checkpoint (not a LoRA adapter's) also holds every weight of its model, with its planned shape, and
  // nothing else but their optimizer state: reshard's accounting.
  const nlohmann::json& model = reader->manifest().model;
  const bool describes_model = model.is_object() && model.contains("parallel") && !is_adapter_checkpoint(*reader);
  if (!describes_model && !args.count("against")) return finished();
  auto source = open_canonical_source(CheckpointFormat::kTrestle, path, source_options);
  if (!source.ok()) return failed(source.status());
  if (describes_model) {
    const Status accounted = check_checkpoint_tensors((*source)->model(), (*source)->tensors(), reader->directory());
    if (!accounted.ok()) return failed(accounted);
  }
  if (!args.count("against")) return finished();
  return compare_against(**source, args["against"].as<std::string>(), tolerance);
}

}  // namespace

const CommandSpec kVerifyCommand = {
    .name = "verify",
    .summary = "check every checksum of a checkpoint (--against HF_DIR: compare every tensor)",
    .description =
        "Check a Trestle checkpoint end to end: every chunk's blocks are read and their xxh3-64\n"
        "checksums compared, and every tensor must be covered by its chunks exactly once.\n"
        "With --against HF_DIR, also compares every tensor with a Hugging Face model after undoing the\n"
        "Megatron layout (QKV order, gated fc1, vocab padding, TP/PP/EP split) and prints the largest\n"
        "absolute difference per tensor (0 for a lossless conversion).\n"
        "torch_dist directories and legacy mp_rank trees (detected) have no checksums: every canonical\n"
        "tensor is read whole instead (keys, shapes and chunk coverage checked), then --against. An\n"
        "iteration saved by `trestle train --ckpt-format torch_dist` is checked both ways: its Trestle files\n"
        "by their checksums, then the torch_dist form beside them read whole.",
    .declare = declare_verify,
    .run = run_verify,
};

}  // namespace trestle::cli
