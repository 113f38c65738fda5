#include "tools/bench/bench_options.h"

#include <algorithm>
#include <thread>

#include "ckpt/byte_size.h"
#include "tools/bench/bench_report.h"

namespace trestle::cli {

void add_bench_options(cxxopts::Options& spec, const BenchOptionSet& set) {
  auto add = spec.add_options();
  add("size", set.size_help, cxxopts::value<std::string>()->default_value(set.size))(
      "repeat", "alternating rounds", cxxopts::value<int>()->default_value(std::to_string(set.repeat)))(
      "dir", "where to write (default: a fresh directory under $TMPDIR or /tmp); cleaned up afterwards",
      cxxopts::value<std::string>()->default_value(""))("json-out", "also write every figure as JSON to this file",
                                                        cxxopts::value<std::string>()->default_value(""))(
      "no-fio", "skip the fio ceiling");
  if (set.python_peer)
    add("no-python", std::string("skip ") + set.peer_help)(
        "python",
        "Python with torch (default: $TRESTLE_PYTHON, $TRESTLE_VENV/bin/python, ~/.cache/trestle/venv/bin/python)",
        cxxopts::value<std::string>()->default_value(""))(
        "peers-dir",
        "folder of the peer scripts (default: $TRESTLE_BENCH_PEERS, else bench/peers beside trestle-bench)",
        cxxopts::value<std::string>()->default_value(""));
  if (set.threads) add("threads", set.threads_help, cxxopts::value<int>()->default_value("0"));
  add("h,help", "show this help");
}

Result<BenchOptions> parse_bench_options(const cxxopts::ParseResult& args, const BenchOptionSet& set) {
  BenchOptions o;
  auto size = parse_byte_size(args["size"].as<std::string>());
  if (!size.ok()) return size.status().with_context("--size");
  if (*size == 0) return Status::Error("--size must be more than 0 bytes");
  o.size = *size;
  const int repeat = args["repeat"].as<int>();
  if (repeat < 1) return Status::Error("--repeat must be at least 1");
  o.repeat = static_cast<unsigned>(repeat);
  o.dir = args["dir"].as<std::string>();
  o.json_out = args["json-out"].as<std::string>();
  TRESTLE_RETURN_IF_ERROR(check_report_writable(o.json_out).with_context("--json-out"));
  o.fio = !args.count("no-fio");
  if (set.python_peer) {
    o.python = !args.count("no-python");
    o.python_path = args["python"].as<std::string>();
    o.peers_dir = args["peers-dir"].as<std::string>();
  }
  if (set.threads) {
    const int threads = args["threads"].as<int>();
    if (threads < 0) return Status::Error("--threads must be 0 (one per CPU) or more");
    o.threads = threads > 0 ? static_cast<unsigned>(threads) : std::max(2u, std::thread::hardware_concurrency());
  }
  return o;
}

std::string report_path(const cxxopts::ParseResult& args) {
  return args.count("json-out") ? args["json-out"].as<std::string>() : args["json"].as<std::string>();
}

}  // namespace trestle::cli
