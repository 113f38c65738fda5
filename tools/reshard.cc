// trestle reshard IN OUT --tp N --pp N ...: rewrites a checkpoint (Trestle or torch_dist, either way) in another
// parallel layout, model and optimizer state, reading only the bytes each target piece needs.
#include <cstdio>
#include <cxxopts.hpp>

#include "convert/operations.h"
#include "tools/command.h"
#include "tools/dist_optimizer_options.h"

namespace trestle::cli {

namespace {

void declare_reshard(cxxopts::Options& spec) {
  spec.add_options()("tp", "tensor-parallel size", cxxopts::value<int>())(
      "pp", "pipeline-parallel size", cxxopts::value<int>())("vpp", "virtual pipeline chunks per stage",
                                                             cxxopts::value<int>())("ep", "expert-parallel size",
                                                                                    cxxopts::value<int>())(
      "etp",
      "the routed experts' own tensor-parallel size (Megatron's --expert-tensor-parallel-size; trestle output; "
      "default: the source's, which is tp unless a run chose otherwise)",
      cxxopts::value<int>())("dp", "data-parallel size", cxxopts::value<int>())(
      "first-stage-layers", "layers on the first pipeline stage (0: even split)", cxxopts::value<std::int64_t>())(
      "last-stage-layers", "layers on the last pipeline stage (0: even split)", cxxopts::value<std::int64_t>())(
      "pipeline-model-parallel-layout",
      "Megatron's layout string: every virtual pipeline stage's layers in order, '|' between stages, E the "
      "embedding, t a decoder layer, m an MTP layer, L the loss (e.g. \"Ett||tttL\" at --pp 3); in place of --vpp "
      "and the stage sizes. Without it, a source's layout string is kept while pp and vpp stay",
      cxxopts::value<std::string>())("iteration", "source iteration (default: the tracker's latest)",
                                     cxxopts::value<std::int64_t>())("to-format", "trestle or megatron-dist",
                                                                     cxxopts::value<std::string>())(
      "hf-config", "config.json (or its directory) describing a Megatron source's model",
      cxxopts::value<std::string>())("model-only", "read or write the model weights only, leaving optimizer state out")(
      "zstd", "compress the written chunks with zstd (trestle output)")(
      "dry-run", "print the plan and memory estimate only")("q,quiet", "no progress output")(
      "in", "source checkpoint", cxxopts::value<std::string>())("out", "destination (new or empty directory)",
                                                                cxxopts::value<std::string>());
  declare_dist_optimizer_options(spec, false);
  spec.parse_positional({"in", "out"});
  spec.positional_help("IN OUT");
}

Outcome run_reshard(const cxxopts::ParseResult& args) {
  if (!args.count("in") || (!args.count("out") && !args.count("dry-run")))
    return usage_error("IN and OUT are required (OUT may be left out with --dry-run)");
  if (Outcome usage = check_paths_not_empty(args, {{"in", "IN"}, {"out", "OUT"}}); usage.code != kExitOk) return usage;
  for (const char* option : {"tp", "pp", "vpp", "ep", "etp", "dp"}) {
    const Status s = check_at_least<int>(args, option, 1);
    if (!s.ok()) return usage_error(s);
  }
  for (const char* option : {"first-stage-layers", "last-stage-layers"}) {
    const Status s = check_at_least<std::int64_t>(args, option, 0);
    if (!s.ok()) return usage_error(s);
  }
  ReshardRequest r;
  auto take = [&](const char* name, auto& field) {
    if (args.count(name)) field = args[name].as<typename std::decay_t<decltype(field)>::value_type>();
  };
  take("tp", r.change.tp);
  take("pp", r.change.pp);
  take("vpp", r.change.vpp);
  take("ep", r.change.ep);
  take("etp", r.change.etp);
  take("dp", r.change.dp);
  take("first-stage-layers", r.change.first_stage_layers);
  take("last-stage-layers", r.change.last_stage_layers);
  take("pipeline-model-parallel-layout", r.change.pipeline_layout);
  if (r.change.pipeline_layout)
    for (const char* other : {"vpp", "first-stage-layers", "last-stage-layers"})
      if (args.count(other))
        return usage_error(std::string("--pipeline-model-parallel-layout and --") + other +
                           " exclude each other (the layout gives every stage's layers)");
  take("iteration", r.source.iteration);
  if (args.count("hf-config")) r.source.hf_config = args["hf-config"].as<std::string>();
  r.source.model_only = args.count("model-only") > 0;
  if (args.count("zstd")) r.codec = Codec::kZstd;
  auto flat = parse_dist_optimizer_options(args, false);
  if (!flat.ok()) return usage_error(flat.status());
  r.dp_reshardable = flat->dp_reshardable;
  r.param_groups = flat->param_groups;
  r.dry_run = args.count("dry-run") > 0;
  r.progress = !args.count("quiet");
  r.in = args["in"].as<std::string>();
  if (args.count("out")) r.out = args["out"].as<std::string>();
  if (args.count("to-format")) {
    auto parsed = parse_format(args["to-format"].as<std::string>());
    if (!parsed.ok()) return usage_error(parsed.status());
    if (*parsed != CheckpointFormat::kTrestle && *parsed != CheckpointFormat::kTorchDist)
      return usage_error("--to-format must be trestle or megatron-dist");
    r.to = *parsed;
  }
  auto shown = run_reshard_request(r);
  if (!shown.ok()) return failure(shown.status());
  std::printf("%s", shown->c_str());
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
        "source's values (but dp, where a new --ep needs more: the smallest multiple of it that ep fits, noted). The\n"
        "source is never modified; OUT must be new or empty, outside IN and the checkpoint directory IN is in.\n\n"
        "IN's format is detected (manifest.json: trestle; .metadata: torch_dist; mp_rank_*: megatron-legacy). OUT is\n"
        "written as --to-format (default: IN's format; trestle for a legacy source), so torch_dist <-> trestle works\n"
        "too. torch_dist is written with Megatron's keys (stacked layers, padded vocab); optimizer state travels in\n"
        "Megatron-Core's model-space format (optimizer.state.<exp_avg | exp_avg_sq | fp32_param>.<weight key>, "
        "sharded\n"
        "as the weight; the distributed optimizer's fully_reshardable 'param' is read as fp32_param; the step as\n"
        "common_step in common.pt). Optimizer state that cannot be mapped is an error, never dropped silently;\n"
        "--optimizer-format dp_reshardable writes the distributed optimizer's flat buckets instead (Megatron-LM's\n"
        "default), laid out for a run at --dp (default: the source's).\n"
        "--model-only reads and writes the weights without it. A Megatron checkpoint's model comes from what Trestle\n"
        "kept beside it, else --hf-config, else Megatron's args.",
    .declare = declare_reshard,
    .run = run_reshard,
};

}  // namespace trestle::cli
