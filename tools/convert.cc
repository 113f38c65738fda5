// trestle convert --from FORMAT SRC --to FORMAT DST: moves a model between checkpoint formats, streaming.
#include <cxxopts.hpp>
#include <iostream>

#include "ckpt/process_memory.h"
#include "ckpt/byte_size.h"
#include "convert/bridge_convert.h"
#include "convert/sources/canonical_source.h"
#include "convert/hf_rewrite.h"
#include "convert/reshard.h"
#include "convert/torch_dist_writer.h"
#include "tools/command.h"

namespace trestle::cli {
namespace {

Result<std::optional<DType>> parse_dtype_option(const std::string& text) {
  if (text == "keep") return std::optional<DType>();
  const auto dtype = parse_dtype(text);
  if (!dtype || !is_floating(*dtype) || dtype_size(*dtype) == 1)
    return Status::Error("--dtype '" + text + "' is not one of keep, bf16, fp16, fp32");
  return std::optional<DType>(*dtype);
}

int run_hf_to_hf(const std::string& src, const std::string& dst, const cxxopts::ParseResult& args) {
  HfRewriteOptions options;
  auto shard = parse_byte_size(args["max-shard-size"].as<std::string>());
  auto dtype = parse_dtype_option(args["dtype"].as<std::string>());
  for (const Status& s : {shard.status(), dtype.status()})
    if (!s.ok()) {
      std::cerr << "trestle convert: " << s.message() << "\n";
      return 2;
    }
  options.max_shard_bytes = *shard;
  options.dtype = *dtype;
  options.progress = !args.count("quiet");
  auto report = rewrite_hf_checkpoint(src, dst, options);
  if (!report.ok()) {
    std::cerr << "trestle convert: " << report.status().message() << "\n";
    return 1;
  }
  std::cout << "wrote " << dst << ": " << report->tensors << " tensors in " << report->shards << " shard(s), "
            << format_bytes(report->bytes_written) << "\n";
  return 0;
}

int fail(const Status& s) {
  std::cerr << "trestle convert: " << s.message() << "\n";
  return 1;
}

Result<ParallelLayout> layout_from_args(const cxxopts::ParseResult& args) {
  ParallelLayout l;
  l.tp = args["tp"].as<int>();
  l.pp = args["pp"].as<int>();
  l.vpp = args["vpp"].as<int>();
  l.ep = args["ep"].as<int>();
  l.make_vocab_size_divisible_by = args["make-vocab-size-divisible-by"].as<std::int64_t>();
  l.first_stage_layers = args["first-stage-layers"].as<std::int64_t>();
  l.last_stage_layers = args["last-stage-layers"].as<std::int64_t>();
  if (l.tp < 1 || l.pp < 1 || l.vpp < 1 || l.ep < 1 || l.make_vocab_size_divisible_by < 1)
    return Status::Error("--tp, --pp, --vpp, --ep and --make-vocab-size-divisible-by must be at least 1");
  return l;
}

Result<NormNaming> norms_from_args(const cxxopts::ParseResult& args) {
  const auto norms = args["norms"].as<std::string>();
  if (norms != "te" && norms != "local") return Status::Error("--norms '" + norms + "' is not one of te, local");
  return norms == "local" ? NormNaming::kLocal : NormNaming::kTransformerEngine;
}

void print_report(const ConversionReport& r, const std::string& dst) {
  std::cout << "wrote " << dst << ": " << r.tensors << " tensors";
  if (r.pieces) std::cout << " in " << r.pieces << " chunks";
  std::cout << ", " << format_bytes(r.bytes_written) << " in " << r.seconds << " s";
  if (r.seconds > 0) std::cout << " (" << static_cast<double>(r.bytes_written) / r.seconds / 1e9 << " GB/s)";
  if (r.bytes_read) std::cout << ", " << format_bytes(r.bytes_read) << " read";
  std::cout << "; peak RSS " << format_bytes(r.peak_rss_bytes) << "\n";
}

int run_hf_to_trestle(const std::string& src, const std::string& dst, const cxxopts::ParseResult& args) {
  auto layout = layout_from_args(args);
  auto dtype = parse_dtype_option(args["dtype"].as<std::string>());
  auto norms = norms_from_args(args);
  for (const Status& s : {layout.status(), dtype.status(), norms.status()})
    if (!s.ok()) {
      std::cerr << "trestle convert: " << s.message() << "\n";
      return 2;
    }
  HfToTrestleOptions options;
  options.layout = *layout;
  options.norms = *norms;
  options.dtype = *dtype;
  options.iteration = args["iteration"].as<std::int64_t>();
  options.dry_run = args.count("dry-run") > 0;
  options.progress = !args.count("quiet");
  const auto codec = args["codec"].as<std::string>();
  if (codec != "raw" && codec != "zstd") return fail(Status::Error("--codec '" + codec + "' is not one of raw, zstd"));
  options.save.codec = codec == "zstd" ? Codec::kZstd : Codec::kRaw;
  auto report = convert_hf_to_trestle(src, dst, options);
  if (!report.ok()) return fail(report.status());
  std::cout << report->plan;
  if (!options.dry_run) print_report(*report, dst);
  return 0;
}

SourceOptions source_options(const cxxopts::ParseResult& args, NormNaming hf_norms) {
  SourceOptions o;
  if (args.count("iteration")) o.iteration = args["iteration"].as<std::int64_t>();
  if (args.count("hf-config")) o.hf_config = args["hf-config"].as<std::string>();
  o.hf_norms = hf_norms;
  o.model_only = args.count("model-only") > 0;
  return o;
}

int run_to_hf(const CanonicalSource& source, const std::string& dst, const cxxopts::ParseResult& args) {
  auto shard = parse_byte_size(args["max-shard-size"].as<std::string>());
  auto dtype = parse_dtype_option(args["dtype"].as<std::string>());
  for (const Status& s : {shard.status(), dtype.status()})
    if (!s.ok()) {
      std::cerr << "trestle convert: " << s.message() << "\n";
      return 2;
    }
  ToHfOptions options;
  options.max_shard_bytes = *shard;
  options.dtype = *dtype;
  const auto experts = args["hf-expert-layout"].as<std::string>();
  if (experts == "original") options.experts = ExpertLayout::kOriginal;
  else if (experts == "fused") options.experts = ExpertLayout::kFused;
  else if (experts != "source")
    return fail(Status::Error("--hf-expert-layout '" + experts + "' is not one of source, original, fused"));
  options.dry_run = args.count("dry-run") > 0;
  options.progress = !args.count("quiet");
  auto report = convert_to_hf(source, dst, options);
  if (!report.ok()) return fail(report.status());
  std::cout << report->plan;
  if (!options.dry_run) print_report(*report, dst);
  return 0;
}

int run_to_torch_dist(const CanonicalSource& source, const ParallelLayout& layout, const std::string& dst,
                      const cxxopts::ParseResult& args) {
  if (args["dtype"].as<std::string>() != "keep")
    return fail(Status::Error("--dtype is not supported when writing megatron-dist (tensors keep their dtype)"));
  TorchDistWriteOptions options;
  options.layout = layout;
  if (args.count("iteration")) options.iteration = args["iteration"].as<std::int64_t>();
  options.model_only = args.count("model-only") > 0;
  options.dry_run = args.count("dry-run") > 0;
  options.progress = !args.count("quiet");
  auto report = write_torch_dist(source, dst, options);
  if (!report.ok()) return fail(report.status());
  std::cout << report->plan;
  if (!options.dry_run)
    std::cout << "wrote " << dst << ": " << report->tensors << " tensors in " << report->pieces << " chunks, "
              << format_bytes(report->bytes_written) << "; peak RSS " << format_bytes(peak_rss_bytes()) << "\n";
  return 0;
}

int run_megatron_to_trestle(const CanonicalSource& source, const ParallelLayout& layout, const std::string& dst,
                            const cxxopts::ParseResult& args) {
  ReshardOptions options;
  options.change = {layout.tp, layout.pp, layout.vpp, layout.ep, std::nullopt, layout.first_stage_layers,
                    layout.last_stage_layers};
  options.dry_run = args.count("dry-run") > 0;
  options.progress = !args.count("quiet");
  auto report = reshard_to_trestle(source, dst, options);
  if (!report.ok()) return fail(report.status());
  std::cout << report->plan;
  if (!options.dry_run)
    std::cout << "wrote " << dst << ": " << report->tensors << " tensors in " << report->pieces << " chunks, "
              << format_bytes(report->bytes_written) << "; peak RSS " << format_bytes(report->peak_rss_bytes) << "\n";
  return 0;
}

// Every conversion that reads through a canonical source (anything but hf -> hf and hf -> trestle).
int run_from_source(CheckpointFormat from, CheckpointFormat to, const std::string& src, const std::string& dst,
                    const cxxopts::ParseResult& args) {
  auto layout = layout_from_args(args);
  auto norms = norms_from_args(args);
  for (const Status& s : {layout.status(), norms.status()})
    if (!s.ok()) {
      std::cerr << "trestle convert: " << s.message() << "\n";
      return 2;
    }
  auto source = open_canonical_source(from, src, source_options(args, *norms));
  if (!source.ok()) return fail(source.status());
  switch (to) {
    case CheckpointFormat::kHf: return run_to_hf(**source, dst, args);
    case CheckpointFormat::kTorchDist: return run_to_torch_dist(**source, *layout, dst, args);
    case CheckpointFormat::kTrestle: return run_megatron_to_trestle(**source, *layout, dst, args);
    case CheckpointFormat::kLegacy: break;
  }
  return fail(Status::Error("writing megatron-legacy is not supported (write megatron-dist, Megatron's default)"));
}

}  // namespace

int convert_main(int argc, char** argv) {
  cxxopts::Options spec("trestle convert",
                        "Convert a model checkpoint between formats without loading it whole.\n\n"
                        "  trestle convert --from hf SRC_DIR --to hf DST_DIR [--max-shard-size 5GB] [--dtype bf16]\n"
                        "  trestle convert --from hf SRC_DIR --to trestle CKPT --tp 2 --pp 2 [--vpp 2] [--ep 4] [--dry-run]\n"
                        "  trestle convert --from trestle CKPT --to hf DST_DIR [--dtype bf16] [--hf-expert-layout fused]\n"
                        "  trestle convert --from hf|trestle|megatron-dist|megatron-legacy SRC --to megatron-dist DST --tp 2 ...\n"
                        "  trestle convert --from megatron-dist|megatron-legacy SRC --to hf|trestle DST [--hf-config CONFIG]\n\n"
                        "Formats: hf (Hugging Face safetensors, sharded with an index, config and tokenizer files\n"
                        "copied through); trestle (a Trestle checkpoint in Megatron-Core layout: one file per TP/PP/EP\n"
                        "rank, canonical Megatron tensor names); megatron-dist (Megatron-Core torch_dist, i.e. PyTorch\n"
                        "DCP: a root with latest_checkpointed_iteration.txt and iter_N/, or an iter_N directory itself;\n"
                        "written with stacked layer keys and padded vocab as Megatron-LM saves it, common.pt with the\n"
                        "args Namespace); megatron-legacy (read only: Megatron's mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt\n"
                        "trees, including virtual-pipeline model0, model1, ...). The model of a Megatron checkpoint is\n"
                        "read from what Trestle kept beside it, else --hf-config, else Megatron's args; the layout flags\n"
                        "(--tp --pp --vpp --ep ...) describe the destination. Architectures: Llama 2/3/3.1/3.2, Mistral,\n"
                        "Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE.\n\n"
                        "Optimizer state (Adam exp_avg, exp_avg_sq, fp32 master weights, step) travels between trestle and\n"
                        "megatron-dist in Megatron-Core's model-space format (optimizer.state.<state>.<weight key>, sharded\n"
                        "as the weight; the step as common_step in common.pt). Optimizer state that cannot be mapped (the\n"
                        "distributed optimizer's dp_reshardable flat buffers, a legacy tree's) is an error, never dropped\n"
                        "silently; --model-only reads or writes megatron-dist / megatron-legacy without it.");
  spec.add_options()("from", "source format", cxxopts::value<std::string>())(
      "to", "destination format", cxxopts::value<std::string>())(
      "max-shard-size", "largest safetensors shard written, as save_pretrained cuts them",
      cxxopts::value<std::string>()->default_value("5GB"))(
      "dtype", "keep, bf16, fp16 or fp32 (casts floating-point tensors)",
      cxxopts::value<std::string>()->default_value("keep"))(
      "tp", "tensor parallel size (to trestle)", cxxopts::value<int>()->default_value("1"))(
      "pp", "pipeline parallel size (to trestle)", cxxopts::value<int>()->default_value("1"))(
      "vpp", "virtual pipeline chunks per stage (to trestle)", cxxopts::value<int>()->default_value("1"))(
      "ep", "expert parallel size, MoE models (to trestle)", cxxopts::value<int>()->default_value("1"))(
      "first-stage-layers", "layers of the first pipeline stage (0: even split)",
      cxxopts::value<std::int64_t>()->default_value("0"))(
      "last-stage-layers", "layers of the last pipeline stage (0: even split)",
      cxxopts::value<std::int64_t>()->default_value("0"))(
      "make-vocab-size-divisible-by", "vocab padding multiple (times tp)", cxxopts::value<std::int64_t>()->default_value("128"))(
      "norms", "layer-norm naming: te (Transformer Engine spec) or local", cxxopts::value<std::string>()->default_value("te"))(
      "codec", "chunk codec: raw or zstd (to trestle)", cxxopts::value<std::string>()->default_value("raw"))(
      "iteration", "iteration to write (hf -> trestle / megatron-dist) or read (default: the tracker's latest)",
      cxxopts::value<std::int64_t>()->default_value("0"))(
      "hf-config", "config.json (or its directory) describing a Megatron checkpoint's model",
      cxxopts::value<std::string>())(
      "hf-expert-layout", "MoE export layout: source (as converted from), original or fused",
      cxxopts::value<std::string>()->default_value("source"))(
      "model-only", "megatron-dist, megatron-legacy: model weights only, leaving optimizer state out")(
      "dry-run", "print the plan and memory estimate, write nothing")("q,quiet", "no progress output")(
      "h,help", "show this help")("paths", "SRC DST", cxxopts::value<std::vector<std::string>>());
  spec.parse_positional({"paths"});
  spec.positional_help("SRC DST");
  try {
    const auto args = spec.parse(argc, argv);
    if (args.count("help")) {
      std::cout << spec.help() << "\n";
      return 0;
    }
    const auto paths = args.count("paths") ? args["paths"].as<std::vector<std::string>>() : std::vector<std::string>{};
    if (!args.count("from") || !args.count("to") || paths.size() != 2) {
      std::cerr << spec.help() << "\ntrestle convert: --from, --to, SRC and DST are required\n";
      return 2;
    }
    auto from = parse_format(args["from"].as<std::string>());
    auto to = parse_format(args["to"].as<std::string>());
    for (const Status& s : {from.status(), to.status()})
      if (!s.ok()) {
        std::cerr << "trestle convert: " << s.message() << "\n";
        return 2;
      }
    using F = CheckpointFormat;
    if (*from == F::kHf && *to == F::kHf) return run_hf_to_hf(paths[0], paths[1], args);
    if (*from == F::kHf && *to == F::kTrestle) return run_hf_to_trestle(paths[0], paths[1], args);
    if (*from == F::kTrestle && *to == F::kTrestle) {
      std::cerr << "trestle convert: trestle -> trestle is `trestle reshard IN OUT --tp N ...`\n";
      return 2;
    }
    if (*to == F::kLegacy) {
      std::cerr << "trestle convert: writing megatron-legacy is not supported (write megatron-dist, Megatron-Core's "
                   "default format)\n";
      return 2;
    }
    return run_from_source(*from, *to, paths[0], paths[1], args);
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle convert: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
