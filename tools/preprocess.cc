// `trestle preprocess`: Megatron's tools/preprocess_data.py flags -> PREFIX_<key>_document.bin/.idx.
#include "train/data/preprocess.h"

#include <cxxopts.hpp>
#include <iostream>

#include "tools/command.h"
#include "train/data/tokenizer.h"

namespace trestle::cli {

namespace {

void declare_preprocess(cxxopts::Options& spec) {
  spec.add_options()("input", "input file", cxxopts::value<std::string>())(
      "input-format",
      "jsonl (a JSON object per line), text (a document per blank-line-separated paragraph) or auto: JSON lines when "
      "the name holds .json or the file starts with '{', else text",
      cxxopts::value<std::string>()->default_value("auto"))("output-prefix", "output prefix",
                                                            cxxopts::value<std::string>())(
      "json-keys",
      "JSON keys to extract: one or more words (--json-keys text title) or comma-separated; given again, the last "
      "replaces the earlier, as with preprocess_data.py",
      cxxopts::value<std::vector<std::string>>()->default_value("text"))(
      "append-eod", "append the end-of-document token to each document")(
      "workers", "threads for parsing and tokenizing", cxxopts::value<int>()->default_value("1"))(
      "tokenizer-type", "HuggingFaceTokenizer (a tokenizer.json) or bytes (one id per UTF-8 byte, EOD 256)",
      cxxopts::value<std::string>()->default_value("HuggingFaceTokenizer"))(
      "tokenizer-model", "tokenizer.json, or the directory holding it", cxxopts::value<std::string>())(
      "eod-token", "the EOD token (default: tokenizer_config.json's eos_token, else <|endoftext|>, </s>, ...)",
      cxxopts::value<std::string>())("quiet", "no progress line");
}

Outcome run_preprocess(const cxxopts::ParseResult& args) {
  if (!args.count("input") || !args.count("output-prefix"))
    return usage_error("--input and --output-prefix are required");
  if (const Status s = check_at_least(args, "workers", 1); !s.ok()) return usage_error(s);
  data::PreprocessOptions options;
  options.input = args["input"].as<std::string>();
  options.output_prefix = args["output-prefix"].as<std::string>();
  if (options.output_prefix.empty() || args["input"].as<std::string>().empty())
    return usage_error("--input and --output-prefix must not be empty");
  if (const auto format = args["input-format"].as<std::string>(); format == "jsonl") {
    options.format = data::InputFormat::kJsonLines;
  } else if (format == "text") {
    options.format = data::InputFormat::kText;
  } else if (format != "auto") {
    return usage_error("--input-format: '" + format + "' is not jsonl, text or auto");
  }
  options.json_keys = args["json-keys"].as<std::vector<std::string>>();
  if (const Status s = data::check_json_keys(options.json_keys); !s.ok()) return usage_error(s);
  options.append_eod = args.count("append-eod") > 0;
  options.workers = args["workers"].as<int>();
  options.progress = args.count("quiet") == 0;
  const auto type = args["tokenizer-type"].as<std::string>();
  std::unique_ptr<data::Tokenizer> tokenizer;
  if (type == "bytes") {
    tokenizer = data::make_byte_tokenizer(options.workers);
  } else if (type == "HuggingFaceTokenizer") {
    if (!args.count("tokenizer-model"))
      return usage_error("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH");
    auto loaded = data::load_hf_tokenizer(args["tokenizer-model"].as<std::string>(), options.workers,
                                          args.count("eod-token") ? args["eod-token"].as<std::string>() : "");
    if (!loaded.ok()) return failure(loaded.status());
    tokenizer = std::move(*loaded);
  } else {
    return usage_error("unknown --tokenizer-type '" + type + "' (HuggingFaceTokenizer or bytes)");
  }
  auto report = data::preprocess(options, *tokenizer);
  if (!report.ok()) return failure(report.status());
  std::cout << "read " << options.input << " as "
            << (report->json_lines ? "JSON lines" : "plain text (a document per blank-line-separated paragraph)")
            << "\n";
  for (const auto& prefix : report->outputs) std::cout << "wrote " << prefix << ".bin/.idx\n";
  std::cout << report->documents << " documents, " << report->tokens << " tokens in " << report->seconds << " s ("
            << (report->seconds > 0 ? static_cast<double>(report->tokens) / report->seconds : 0.0) << " tokens/s)\n";
  return finished();
}

}  // namespace

const CommandSpec kPreprocessCommand = {
    .name = "preprocess",
    .summary = "tokenize text into Megatron indexed datasets (.bin/.idx), as preprocess_data.py does",
    .description =
        "Tokenize JSON lines (one document per line, each read as Python's json.loads reads it) or plain text (one\n"
        "document per blank-line-separated paragraph) into Megatron indexed datasets\n"
        "OUTPUT_PREFIX_<key>_document.bin/.idx, as Megatron's tools/preprocess_data.py does (uint16 tokens below "
        "65500\n"
        "ids, else int32). Lines end at \\n, \\r\\n or \\r, as Python reads text. --input-format auto reads JSON "
        "lines\n"
        "when the file's name holds .json or its first character is '{', else plain text.",
    .declare = declare_preprocess,
    .run = run_preprocess,
    .list_flags = {"--json-keys"},
    .last_wins = true,
};

}  // namespace trestle::cli
