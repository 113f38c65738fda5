// trestle reshard IN OUT --tp N --pp N ...: rewrites a checkpoint in another parallel layout, model and optimizer
// state, reading only the bytes each target piece needs.
#include <cstdio>
#include <cxxopts.hpp>
#include <iostream>

#include "ckpt/byte_size.h"
#include "convert/reshard.h"
#include "tools/command.h"

namespace trestle::cli {

int reshard_main(int argc, char** argv) {
  cxxopts::Options spec(
      "trestle reshard",
      "Rewrite a Trestle checkpoint in another Megatron parallel layout: tensor (--tp), pipeline (--pp, with\n"
      "optional uneven first/last stages), virtual pipeline (--vpp), expert (--ep) and data parallel (--dp, which\n"
      "re-shards distributed-optimizer state). Model weights, Adam moments and fp32 master weights move together;\n"
      "each piece of the new layout is read from the old one by the load planner (only overlapping bytes, every\n"
      "block checksummed) and written at once, so memory stays near the largest piece. Sizes not given keep the\n"
      "source's values. The source is never modified; OUT must be new or empty.");
  spec.add_options()("tp", "tensor-parallel size", cxxopts::value<int>())(
      "pp", "pipeline-parallel size", cxxopts::value<int>())("vpp", "virtual pipeline chunks per stage",
                                                             cxxopts::value<int>())(
      "ep", "expert-parallel size", cxxopts::value<int>())("dp", "data-parallel size", cxxopts::value<int>())(
      "first-stage-layers", "layers on the first pipeline stage (0: even split)", cxxopts::value<std::int64_t>())(
      "last-stage-layers", "layers on the last pipeline stage (0: even split)", cxxopts::value<std::int64_t>())(
      "iteration", "source iteration (default: the tracker's latest)", cxxopts::value<std::int64_t>())(
      "zstd", "compress the written chunks with zstd")("dry-run", "print the plan and memory estimate only")(
      "q,quiet", "no progress output")("h,help", "show this help")("in", "source checkpoint",
                                                                     cxxopts::value<std::string>())(
      "out", "destination (new or empty directory)", cxxopts::value<std::string>());
  spec.parse_positional({"in", "out"});
  spec.positional_help("IN OUT");
  try {
    const auto args = spec.parse(argc, argv);
    if (args.count("help") || !args.count("in") || (!args.count("out") && !args.count("dry-run"))) {
      std::cout << spec.help() << "\n";
      return args.count("help") ? 0 : 2;
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
    take("iteration", options.iteration);
    if (args.count("zstd")) options.save.codec = Codec::kZstd;
    options.dry_run = args.count("dry-run") > 0;
    options.progress = !args.count("quiet");
    const std::string out = args.count("out") ? args["out"].as<std::string>() : std::string();
    auto report = reshard_trestle(args["in"].as<std::string>(), out, options);
    if (!report.ok()) {
      std::fprintf(stderr, "trestle reshard: %s\n", report.status().message().c_str());
      return 1;
    }
    std::printf("%s", report->plan.c_str());
    if (options.dry_run) return 0;
    std::printf("resharded %llu tensors (%llu optimizer states) into %llu pieces: read %s, wrote %s in %.2f s "
                "(%.2f GB/s written), peak RSS %s\n",
                static_cast<unsigned long long>(report->tensors),
                static_cast<unsigned long long>(report->optimizer_tensors),
                static_cast<unsigned long long>(report->pieces), format_bytes(report->bytes_read).c_str(),
                format_bytes(report->bytes_written).c_str(), report->seconds,
                report->seconds > 0 ? static_cast<double>(report->bytes_written) / report->seconds / 1e9 : 0.0,
                format_bytes(report->peak_rss_bytes).c_str());
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle reshard: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
