// trestle convert --from FORMAT SRC --to FORMAT DST: moves a model between checkpoint formats, streaming.
#include <cxxopts.hpp>
#include <iostream>

#include "ckpt/byte_size.h"
#include "convert/hf_rewrite.h"
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

}  // namespace

int convert_main(int argc, char** argv) {
  cxxopts::Options spec("trestle convert",
                        "Convert a model checkpoint between formats without loading it whole.\n\n"
                        "  trestle convert --from hf SRC_DIR --to hf DST_DIR [--max-shard-size 5GB] [--dtype bf16]\n\n"
                        "Formats: hf (Hugging Face safetensors, sharded with an index, config and tokenizer files\n"
                        "copied through).");
  spec.add_options()("from", "source format", cxxopts::value<std::string>())(
      "to", "destination format", cxxopts::value<std::string>())(
      "max-shard-size", "largest safetensors shard written, as save_pretrained cuts them",
      cxxopts::value<std::string>()->default_value("5GB"))(
      "dtype", "keep, bf16, fp16 or fp32 (casts floating-point tensors)",
      cxxopts::value<std::string>()->default_value("keep"))("q,quiet", "no progress output")(
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
    const auto from = args["from"].as<std::string>(), to = args["to"].as<std::string>();
    if (from == "hf" && to == "hf") return run_hf_to_hf(paths[0], paths[1], args);
    std::cerr << "trestle convert: converting from '" << from << "' to '" << to
              << "' is not supported (supported: --from hf --to hf)\n";
    return 2;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle convert: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
