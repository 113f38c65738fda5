// trestle reshard IN OUT --tp N --pp N ...: rewrites a checkpoint (Trestle or torch_dist, either way) in another
// parallel layout, model and optimizer state, reading only the bytes each target piece needs.
#include "convert/reshard.h"

#include <cstdio>
#include <cxxopts.hpp>
#include <iostream>
#include <optional>

#include "ckpt/byte_size.h"
#include "ckpt/process_memory.h"
#include "convert/bridge_convert.h"
#include "convert/sources/canonical_source.h"
#include "convert/torch_dist_writer.h"
#include "tools/command.h"

namespace trestle::cli {

namespace {

void declare_reshard(cxxopts::Options& spec) {
  spec.add_options()("tp", "tensor-parallel size", cxxopts::value<int>())(
      "pp", "pipeline-parallel size", cxxopts::value<int>())("vpp", "virtual pipeline chunks per stage",
                                                             cxxopts::value<int>())(
      "ep", "expert-parallel size", cxxopts::value<int>())("dp", "data-parallel size", cxxopts::value<int>())(
      "first-stage-layers", "layers on the first pipeline stage (0: even split)", cxxopts::value<std::int64_t>())(
      "last-stage-layers", "layers on the last pipeline stage (0: even split)", cxxopts::value<std::int64_t>())(
      "iteration", "source iteration (default: the tracker's latest)", cxxopts::value<std::int64_t>())(
      "to-format", "trestle or megatron-dist", cxxopts::value<std::string>())(
      "hf-config", "config.json (or its directory) describing a Megatron source's model",
      cxxopts::value<std::string>())("model-only",
                                     "torch_dist: read or write the model weights only, leaving optimizer state out")(
      "zstd", "compress the written chunks with zstd (trestle output)")(
      "dry-run", "print the plan and memory estimate only")("q,quiet", "no progress output")(
      "in", "source checkpoint", cxxopts::value<std::string>())("out", "destination (new or empty directory)",
                                                                cxxopts::value<std::string>());
  spec.parse_positional({"in", "out"});
  spec.positional_help("IN OUT");
}

Outcome run_reshard(const cxxopts::ParseResult& args) {
  if (!args.count("in") || (!args.count("out") && !args.count("dry-run")))
    return usage_error("IN and OUT are required (OUT may be left out with --dry-run)");
  for (const char* option : {"tp", "pp", "vpp", "ep", "dp"}) {
    const Status s = check_at_least<int>(args, option, 1);
    if (!s.ok()) return usage_error(s);
  }
  for (const char* option : {"first-stage-layers", "last-stage-layers"}) {
    const Status s = check_at_least<std::int64_t>(args, option, 0);
    if (!s.ok()) return usage_error(s);
  }
  ReshardOptions options;
  auto take = [&](const char* name, auto& field) {
    if (args.count(name)) field = args[name].as<typename std::decay_t<decltype(field)>::value_type>();
  };
  take("tp", options.change.tp);
  take("pp", options.change.pp);
  take("vpp", options.change.vpp);
  take("ep", options.change.ep);
  take("dp", options.change.dp);
  take("first-stage-layers", options.change.first_stage_layers);
  take("last-stage-layers", options.change.last_stage_layers);
  SourceOptions source_options;
  take("iteration", source_options.iteration);
  if (args.count("hf-config")) source_options.hf_config = args["hf-config"].as<std::string>();
  source_options.model_only = args.count("model-only") > 0;
  if (args.count("zstd")) options.save.codec = Codec::kZstd;
  options.dry_run = args.count("dry-run") > 0;
  options.progress = !args.count("quiet");
  const std::string in = args["in"].as<std::string>();
  const std::string out = args.count("out") ? args["out"].as<std::string>() : std::string();
  std::optional<CheckpointFormat> to_format;
  if (args.count("to-format")) {
    auto parsed = parse_format(args["to-format"].as<std::string>());
    if (!parsed.ok()) return usage_error(parsed.status());
    if (*parsed != CheckpointFormat::kTrestle && *parsed != CheckpointFormat::kTorchDist)
      return usage_error("--to-format must be trestle or megatron-dist");
    to_format = *parsed;
  }
  auto from = detect_format(in);
  if (!from.ok()) return failure(from.status());
  const CheckpointFormat to = to_format.value_or(*from == CheckpointFormat::kTorchDist ? CheckpointFormat::kTorchDist
                                                                                       : CheckpointFormat::kTrestle);
  auto source = open_canonical_source(*from, in, source_options);
  if (!source.ok()) return failure(source.status());
  if (to == CheckpointFormat::kTorchDist) {
    TorchDistWriteOptions write;
    write.layout = apply_layout_change((*source)->model().layout, options.change);
    write.model_only = source_options.model_only;
    write.dry_run = options.dry_run;
    write.progress = options.progress;
    auto report = write_torch_dist(**source, out, write);
    if (!report.ok()) return failure(report.status());
    std::printf("%s", report->plan.c_str());
    if (!options.dry_run)
      std::printf("resharded %llu tensors (%llu optimizer states) into %llu torch_dist chunks: wrote %s, peak RSS %s\n",
                  static_cast<unsigned long long>(report->tensors),
                  static_cast<unsigned long long>(report->optimizer_tensors),
                  static_cast<unsigned long long>(report->pieces), format_bytes(report->bytes_written).c_str(),
                  format_bytes(peak_rss_bytes()).c_str());
    return finished();
  }
  auto report = reshard_to_trestle(**source, out, options);
  if (!report.ok()) return failure(report.status());
  std::printf("%s", report->plan.c_str());
  if (options.dry_run) return finished();
  std::printf(
      "resharded %llu tensors (%llu optimizer states) into %llu pieces: read %s, wrote %s in %.2f s "
      "(%.2f GB/s written), peak RSS %s\n",
      static_cast<unsigned long long>(report->tensors), static_cast<unsigned long long>(report->optimizer_tensors),
      static_cast<unsigned long long>(report->pieces), format_bytes(report->bytes_read).c_str(),
      format_bytes(report->bytes_written).c_str(), report->seconds,
      report->seconds > 0 ? static_cast<double>(report->bytes_written) / report->seconds / 1e9 : 0.0,
      format_bytes(report->peak_rss_bytes).c_str());
  return finished();
}

}  // namespace

const CommandSpec kReshardCommand = {
    .name = "reshard",
    .summary = "rewrite a checkpoint in another TP/PP/VPP/EP/DP layout, with optimizer state",
    .description =
        "Rewrite a Trestle or Megatron torch_dist checkpoint in another Megatron parallel layout: tensor (--tp),\n"
        "pipeline (--pp, with\n"
        "optional uneven first/last stages), virtual pipeline (--vpp), expert (--ep) and data parallel (--dp, which\n"
        "re-shards distributed-optimizer state). Model weights, Adam moments and fp32 master weights move together;\n"
        "each piece of the new layout is read from the old one by the load planner (only overlapping bytes, every\n"
        "block checksummed) and written at once, so memory stays near the largest piece. Sizes not given keep the\n"
        "source's values. The source is never modified; OUT must be new or empty.\n\n"
        "IN's format is detected (manifest.json: trestle; .metadata: torch_dist; mp_rank_*: megatron-legacy). OUT is\n"
        "written as --to-format (default: IN's format; trestle for a legacy source), so torch_dist <-> trestle works\n"
        "too. torch_dist is written with Megatron's keys (stacked layers, padded vocab); optimizer state travels in\n"
        "Megatron-Core's model-space format (optimizer.state.<exp_avg | exp_avg_sq | fp32_param>.<weight key>, "
        "sharded\n"
        "as the weight; the distributed optimizer's fully_reshardable 'param' is read as fp32_param; the step as\n"
        "common_step in common.pt). Optimizer state that cannot be mapped is an error, never dropped silently;\n"
        "--model-only reads or writes torch_dist without it. A Megatron checkpoint's model comes from what Trestle\n"
        "kept beside it, else --hf-config, else Megatron's args.",
    .declare = declare_reshard,
    .run = run_reshard,
};

}  // namespace trestle::cli
