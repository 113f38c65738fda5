// `trestle preprocess`: Megatron's tools/preprocess_data.py flags -> PREFIX_<key>_document.bin/.idx.
#include <cxxopts.hpp>
#include <iostream>

#include "tools/command.h"
#include "train/data/preprocess.h"
#include "train/data/tokenizer.h"

namespace trestle::cli {

int preprocess_main(int argc, char** argv) {
  cxxopts::Options spec(
      "trestle preprocess",
      "Tokenize JSON lines (one document per line; .json/.jsonl) or plain text (one document per blank-line-separated\n"
      "paragraph) into Megatron indexed datasets OUTPUT_PREFIX_<key>_document.bin/.idx, as Megatron's\n"
      "tools/preprocess_data.py does (uint16 tokens below 65500 ids, else int32).");
  spec.add_options()("input", "input file", cxxopts::value<std::string>())(
      "output-prefix", "output prefix", cxxopts::value<std::string>())(
      "json-keys", "JSON keys to extract, comma-separated or repeated", cxxopts::value<std::vector<std::string>>()->default_value("text"))(
      "append-eod", "append the end-of-document token to each document")(
      "workers", "threads for parsing and tokenizing", cxxopts::value<int>()->default_value("1"))(
      "tokenizer-type", "HuggingFaceTokenizer (a tokenizer.json) or bytes (one id per UTF-8 byte, EOD 256)",
      cxxopts::value<std::string>()->default_value("HuggingFaceTokenizer"))(
      "tokenizer-model", "tokenizer.json, or the directory holding it", cxxopts::value<std::string>())(
      "eod-token", "the EOD token (default: tokenizer_config.json's eos_token, else <|endoftext|>, </s>, ...)",
      cxxopts::value<std::string>()->default_value(""))(
      "quiet", "no progress line")("h,help", "show this help");
  try {
    const auto args = spec.parse(argc, argv);
    if (args.count("help")) {
      std::cout << spec.help() << "\n";
      return 0;
    }
    if (!args.count("input") || !args.count("output-prefix")) {
      std::cerr << spec.help() << "\ntrestle preprocess: --input and --output-prefix are required\n";
      return 2;
    }
    data::PreprocessOptions options;
    options.input = args["input"].as<std::string>();
    options.output_prefix = args["output-prefix"].as<std::string>();
    options.json_keys = args["json-keys"].as<std::vector<std::string>>();
    options.append_eod = args.count("append-eod") > 0;
    options.workers = args["workers"].as<int>();
    options.progress = args.count("quiet") == 0;
    if (options.workers < 1) {
      std::cerr << "trestle preprocess: --workers must be at least 1\n";
      return 2;
    }
    const auto type = args["tokenizer-type"].as<std::string>();
    std::unique_ptr<data::Tokenizer> tokenizer;
    if (type == "bytes") {
      tokenizer = data::make_byte_tokenizer(options.workers);
    } else if (type == "HuggingFaceTokenizer") {
      if (!args.count("tokenizer-model")) {
        std::cerr << "trestle preprocess: --tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH\n";
        return 2;
      }
      auto loaded = data::load_hf_tokenizer(args["tokenizer-model"].as<std::string>(), options.workers,
                                            args["eod-token"].as<std::string>());
      if (!loaded.ok()) {
        std::cerr << "trestle preprocess: " << loaded.status().message() << "\n";
        return 1;
      }
      tokenizer = std::move(*loaded);
    } else {
      std::cerr << "trestle preprocess: unknown --tokenizer-type '" << type << "' (HuggingFaceTokenizer or bytes)\n";
      return 2;
    }
    auto report = data::preprocess(options, *tokenizer);
    if (!report.ok()) {
      std::cerr << "trestle preprocess: " << report.status().message() << "\n";
      return 1;
    }
    for (const auto& prefix : report->outputs) std::cout << "wrote " << prefix << ".bin/.idx\n";
    std::cout << report->documents << " documents, " << report->tokens << " tokens in " << report->seconds << " s ("
              << (report->seconds > 0 ? static_cast<double>(report->tokens) / report->seconds : 0.0) << " tokens/s)\n";
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle preprocess: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
