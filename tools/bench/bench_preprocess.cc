// bench preprocess: `trestle preprocess` (tokenizers through embedded Python, native JSON parsing and writing) against
// the same job done by Megatron's pipeline in Python (tools/bench/peers/preprocess_peer.py: a multiprocessing pool
// over the `tokenizers` package, megatron-core's IndexedDatasetBuilder) in the same run, on the shipped corpus
// repeated --repeat times. Checks both outputs are byte-identical, prints tokens/s and the ratio, writes JSON.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cxxopts.hpp>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "tools/bench/bench.h"
#include "tools/bench/bench_options.h"
#include "tools/bench/bench_peer.h"
#include "tools/bench/bench_process.h"
#include "tools/bench/bench_report.h"
#include "tools/parse_error.h"
#include "tools/self_exe.h"
#include "train/data/preprocess.h"
#include "train/data/tokenizer.h"

namespace trestle::cli {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

int bench_preprocess_main(int argc, char** argv) {
  cxxopts::Options spec(
      "bench preprocess",
      "tokens/s of `trestle preprocess` beside Megatron's Python pipeline (tokenizers + megatron-core's\n"
      "IndexedDatasetBuilder) on the same JSON lines, in the same run; the outputs must be identical.");
  spec.add_options()("input", "JSON lines with a 'text' key (default: the shipped KJV corpus)",
                     cxxopts::value<std::string>()->default_value(corpus_file("kjv.jsonl")))(
      "tokenizer-model", "tokenizer.json", cxxopts::value<std::string>()->default_value(corpus_file("tokenizer.json")))(
      "repeat", "concatenate the input this many times", cxxopts::value<int>()->default_value("8"))(
      "workers", "workers for both sides",
      cxxopts::value<int>()->default_value(std::to_string(std::max(1u, std::thread::hardware_concurrency()))))(
      "python", "the venv's python for the peer (default: the project's venv)",
      cxxopts::value<std::string>()->default_value(""))(
      "peers-dir", "where the Python peers are (default: bench/peers beside this program)",
      cxxopts::value<std::string>()->default_value(""))(
      "json", "write the results here", cxxopts::value<std::string>()->default_value("bench_preprocess.json"))(
      "json-out", "the same as --json", cxxopts::value<std::string>())("h,help", "show this help");
  try {
    const auto args = spec.parse(argc, argv);
    if (args.count("help")) {
      std::cout << spec.help() << "\n";
      return 0;
    }
    if (!args.unmatched().empty()) {
      std::cerr << "bench preprocess: unexpected argument '" << args.unmatched().front() << "'\n";
      return 2;
    }
    const int workers = args["workers"].as<int>();
    const int repeat = args["repeat"].as<int>();
    if (workers < 1 || repeat < 1) {
      std::cerr << "bench preprocess: --workers and --repeat must be at least 1\n";
      return 2;
    }
    if (const Status s = check_report_writable(report_path(args)); !s.ok()) {
      std::cerr << "bench preprocess: " << s.message() << "\n";
      return 2;
    }
    const fs::path dir = fs::temp_directory_path() / ("trestle_bench_preprocess_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    const std::string text = slurp(args["input"].as<std::string>());
    if (text.empty()) {
      std::cerr << "bench preprocess: " << args["input"].as<std::string>() << ": empty or unreadable\n";
      return 1;
    }
    const fs::path input = dir / "input.jsonl";
    {
      std::ofstream out(input, std::ios::binary);
      for (int i = 0; i < repeat; ++i) out << text << (text.back() == '\n' ? "" : "\n");
    }
    const std::string tokenizer_path = args["tokenizer-model"].as<std::string>();

    // Trestle: tokenizer load included.
    const auto start = std::chrono::steady_clock::now();
    auto tokenizer = trestle::data::load_hf_tokenizer(tokenizer_path, workers);
    if (!tokenizer.ok()) {
      std::cerr << "bench preprocess: " << tokenizer.status().message() << "\n";
      return 1;
    }
    trestle::data::PreprocessOptions options;
    options.input = input.string();
    options.output_prefix = (dir / "trestle").string();
    options.append_eod = true;
    options.workers = workers;
    options.progress = false;
    auto report = trestle::data::preprocess(options, **tokenizer);
    if (!report.ok()) {
      std::cerr << "bench preprocess: " << report.status().message() << "\n";
      return 1;
    }
    const double trestle_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    auto python = find_python(args["python"].as<std::string>());
    auto script = peer_script(args["peers-dir"].as<std::string>(), "preprocess_peer.py");
    for (const Status& s : {python.status(), script.status()})
      if (!s.ok()) {
        std::cerr << "bench preprocess: " << s.message() << "\n";
        return 1;
      }
    auto peer_run =
        run_child_ok({*python, *script, "--input", input.string(), "--output-prefix", (dir / "peer").string(),
                      "--tokenizer-model", tokenizer_path, "--workers", std::to_string(workers)});
    if (!peer_run.ok()) {
      std::cerr << "bench preprocess: the Python peer failed: " << peer_run.status().message() << "\n";
      return 1;
    }
    const std::string* peer_out = &peer_run->out;
    const auto peer = nlohmann::json::parse(peer_out->substr(peer_out->find('{')));
    const double peer_seconds = peer["seconds"].get<double>();
    const auto peer_tokens = peer["tokens"].get<std::uint64_t>();
    const bool identical = slurp(dir / "trestle_text_document.bin") == slurp(dir / "peer.bin") &&
                           slurp(dir / "trestle_text_document.idx") == slurp(dir / "peer.idx");
    fs::remove_all(dir);

    const double ours = static_cast<double>(report->tokens) / trestle_seconds;
    const double theirs = static_cast<double>(peer_tokens) / peer_seconds;
    std::printf("bench preprocess: %llu documents, %.1f MB of JSON lines, %d workers\n",
                static_cast<unsigned long long>(report->documents), static_cast<double>(report->input_bytes) / 1e6,
                workers);
    std::printf("  %-44s %12s %9s %14s\n", "tool", "tokens", "seconds", "tokens/s");
    std::printf("  %-44s %12llu %9.3f %14.0f\n", "trestle preprocess", static_cast<unsigned long long>(report->tokens),
                trestle_seconds, ours);
    std::printf("  %-44s %12llu %9.3f %14.0f\n", "python: tokenizers + megatron-core builder",
                static_cast<unsigned long long>(peer_tokens), peer_seconds, theirs);
    std::printf("  ratio (trestle / python): %.2fx   outputs identical: %s\n", ours / theirs, identical ? "yes" : "NO");
    nlohmann::ordered_json out = {
        {"bench", "preprocess"},
        {"documents", report->documents},
        {"input_bytes", report->input_bytes},
        {"workers", workers},
        {"trestle", {{"tokens", report->tokens}, {"seconds", trestle_seconds}, {"tokens_per_s", ours}}},
        {"python", {{"tokens", peer_tokens}, {"seconds", peer_seconds}, {"tokens_per_s", theirs}}},
        {"ratio", ours / theirs},
        {"identical", identical}};
    if (auto s = write_json_file(report_path(args), out); !s.ok()) {
      std::cerr << "bench preprocess: " << s.message() << "\n";
      return 1;
    }
    if (!identical || peer_tokens != report->tokens) {
      std::cerr << "bench preprocess: the two outputs differ\n";
      return 1;
    }
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "bench preprocess: " << describe_parse_error(e, argc, argv) << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
