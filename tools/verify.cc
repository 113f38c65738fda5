// trestle verify PATH: reads every byte of a checkpoint, checks every checksum and that each tensor's chunks cover it
// exactly once (torch_dist / legacy: every canonical tensor read whole). With --against HF_DIR it also compares every
// tensor with a Hugging Face model after undoing the Megatron layout. Exit 0 when intact (and identical), 1 otherwise.
#include <chrono>
#include <cstdio>
#include <cxxopts.hpp>
#include <iostream>

#include "ckpt/byte_size.h"
#include "ckpt/load.h"
#include "convert/bridge_verify.h"
#include "convert/sources/canonical_source.h"
#include "tools/command.h"

namespace trestle::cli {
namespace {

// Prints each tensor's largest absolute difference; exit 0 when none exceeds the tolerance.
int compare_against(const CanonicalSource& source, const std::string& hf_dir, double tolerance) {
  auto result = compare_with_hf(source, hf_dir);
  if (!result.ok()) {
    std::fprintf(stderr, "trestle verify: FAILED: %s\n", result.status().message().c_str());
    return 1;
  }
  std::size_t differing = 0;
  for (const auto& t : result->tensors) {
    std::printf("%-70s max abs diff %g\n", t.name.c_str(), t.max_abs_diff);
    if (!(t.max_abs_diff <= tolerance)) ++differing;
  }
  std::printf("%s: %zu tensors compared with %s, max abs diff %g, %zu above tolerance %g\n", differing ? "FAILED" : "ok",
              result->tensors.size(), hf_dir.c_str(), result->max_abs_diff, differing, tolerance);
  return differing ? 1 : 0;
}

// torch_dist and legacy checkpoints carry no checksums: every canonical tensor is read whole instead, which checks
// that the stored chunks cover it exactly and match the model's shapes.
int verify_megatron(const CanonicalSource& source) {
  std::uint64_t bytes = 0;
  std::vector<std::byte> data;
  for (const auto& t : source.tensors()) {
    data.resize(static_cast<std::size_t>(numel(t.shape)) * dtype_size(t.dtype));
    if (Status s = source.read(t.name, Piece{whole_box(t.shape), std::nullopt}, data); !s.ok()) {
      std::fprintf(stderr, "trestle verify: FAILED: %s\n", s.message().c_str());
      return 1;
    }
    bytes += data.size();
  }
  std::printf("ok: %s: %zu canonical tensors read whole (%s; the format has no checksums)\n",
              source.description().c_str(), source.tensors().size(), format_bytes(bytes).c_str());
  return 0;
}

}  // namespace

int verify_main(int argc, char** argv) {
  cxxopts::Options spec("trestle verify",
                        "Check a Trestle checkpoint end to end: every chunk's blocks are read and their xxh3-64\n"
                        "checksums compared, and every tensor must be covered by its chunks exactly once.\n"
                        "With --against HF_DIR, also compares every tensor with a Hugging Face model after undoing the\n"
                        "Megatron layout (QKV order, gated fc1, vocab padding, TP/PP/EP split) and prints the largest\n"
                        "absolute difference per tensor (0 for a lossless conversion).\n"
                        "torch_dist directories and legacy mp_rank trees (detected) have no checksums: every canonical\n"
                        "tensor is read whole instead (keys, shapes and chunk coverage checked), then --against.");
  spec.add_options()("iteration", "iteration to check (default: the tracker's latest)", cxxopts::value<std::int64_t>())(
      "against", "Hugging Face model directory to compare every tensor with", cxxopts::value<std::string>())(
      "tolerance", "largest absolute difference accepted with --against", cxxopts::value<double>()->default_value("0"))(
      "hf-config", "config.json describing a Megatron checkpoint's model (when it keeps none and has no args)",
      cxxopts::value<std::string>())(
      "h,help", "show this help")("path", "checkpoint root", cxxopts::value<std::string>());
  spec.parse_positional({"path"});
  spec.positional_help("PATH");
  try {
    const auto args = spec.parse(argc, argv);
    if (args.count("help") || !args.count("path")) {
      std::cout << spec.help() << "\n";
      return args.count("help") ? 0 : 2;
    }
    std::optional<std::int64_t> iteration;
    if (args.count("iteration")) iteration = args["iteration"].as<std::int64_t>();
    const std::string path = args["path"].as<std::string>();
    auto format = detect_format(path);
    if (!format.ok()) {
      std::fprintf(stderr, "trestle verify: %s\n", format.status().message().c_str());
      return 1;
    }
    SourceOptions source_options;
    source_options.iteration = iteration;
    if (args.count("hf-config")) source_options.hf_config = args["hf-config"].as<std::string>();
    if (*format != CheckpointFormat::kTrestle) {
      auto source = open_canonical_source(*format, path, source_options);
      if (!source.ok()) {
        std::fprintf(stderr, "trestle verify: FAILED: %s\n", source.status().message().c_str());
        return 1;
      }
      if (const int rc = verify_megatron(**source); rc != 0 || !args.count("against")) return rc;
      return compare_against(**source, args["against"].as<std::string>(), args["tolerance"].as<double>());
    }
    const auto start = std::chrono::steady_clock::now();
    auto reader = CheckpointReader::open(path, iteration);
    if (!reader.ok()) {
      std::fprintf(stderr, "trestle verify: %s\n", reader.status().message().c_str());
      return 1;
    }
    LoadStats stats;
    const Status s = reader->verify(&stats);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!s.ok()) {
      std::fprintf(stderr, "trestle verify: FAILED: %s\n", s.message().c_str());
      return 1;
    }
    std::printf("ok: %s: %zu tensors, %llu blocks verified, %s read in %.2f s\n", reader->directory().c_str(),
                reader->manifest().tensors.size(), static_cast<unsigned long long>(stats.blocks_verified),
                format_bytes(stats.bytes_read).c_str(), seconds);
    if (args.count("against")) {
      auto source = open_canonical_source(CheckpointFormat::kTrestle, path, source_options);
      if (!source.ok()) {
        std::fprintf(stderr, "trestle verify: FAILED: %s\n", source.status().message().c_str());
        return 1;
      }
      return compare_against(**source, args["against"].as<std::string>(), args["tolerance"].as<double>());
    }
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle verify: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
