// The options every benchmark shares, declared once: --size, --repeat, --dir, --json-out, --no-fio and, for benchmarks
// with a Python peer, --no-python, --python and --peers-dir, and --threads where Trestle's thread count is a knob.
#pragma once

#include <cstdint>
#include <cxxopts.hpp>
#include <string>

#include "ckpt/status.h"

namespace trestle::cli {

// What a benchmark declares beyond the shared set, and the defaults it gives the shared options.
struct BenchOptionSet {
  const char* size = "2GiB";  // --size default
  const char* size_help = "state dict size";
  unsigned repeat = 2;                        // --repeat default
  bool python_peer = true;                    // --no-python, --python, --peers-dir
  const char* peer_help = "the Python peer";  // what --no-python skips
  bool threads = false;                       // --threads
  const char* threads_help = "Trestle's threads (0: one per CPU, at least 2)";
};

struct BenchOptions {
  std::uint64_t size = 0;
  unsigned repeat = 1;
  std::string dir;
  std::string json_out;
  bool fio = true;
  bool python = false;  // only when the benchmark has a peer and --no-python is not given
  std::string python_path;
  std::string peers_dir;
  unsigned threads = 0;  // resolved: one per CPU, at least 2, when 0 is asked
};

// Adds the shared options and -h/--help to spec.
void add_bench_options(cxxopts::Options& spec, const BenchOptionSet& set);
// Reads them back; a bad value (a size of 0, --repeat 0, negative --threads) is an error naming the option.
Result<BenchOptions> parse_bench_options(const cxxopts::ParseResult& args, const BenchOptionSet& set);

// bench train's and bench preprocess's JSON report, always written: --json-out (the other benchmarks' name) where
// given, else --json (each declares both; --json has the default).
std::string report_path(const cxxopts::ParseResult& args);

}  // namespace trestle::cli
