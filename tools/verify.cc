// trestle verify PATH: reads every byte of a checkpoint, checks every checksum and that each tensor's chunks cover
// it exactly once. Exit 0 when intact, 1 otherwise.
#include <chrono>
#include <cstdio>
#include <cxxopts.hpp>
#include <iostream>

#include "ckpt/byte_size.h"
#include "ckpt/load.h"
#include "tools/command.h"

namespace trestle::cli {

int verify_main(int argc, char** argv) {
  cxxopts::Options spec("trestle verify",
                        "Check a Trestle checkpoint end to end: every chunk's blocks are read and their xxh3-64\n"
                        "checksums compared, and every tensor must be covered by its chunks exactly once.");
  spec.add_options()("iteration", "iteration to check (default: the tracker's latest)", cxxopts::value<std::int64_t>())(
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
    const auto start = std::chrono::steady_clock::now();
    auto reader = CheckpointReader::open(args["path"].as<std::string>(), iteration);
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
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle verify: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
