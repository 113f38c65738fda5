// trestle bench ARGS...: runs trestle-bench, the benchmarks' own program, found beside this executable.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "tools/command.h"
#include "tools/self_exe.h"

namespace trestle::cli {
namespace {

Outcome forward_to_bench(int argc, char** argv) {
  auto dir = self_exe_dir();
  if (!dir.ok()) return failure(dir.status());
  const std::string bench = *dir + "/trestle-bench";
  std::vector<char*> args = {const_cast<char*>(bench.c_str())};
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  ::execv(bench.c_str(), args.data());
  return failure(Status::Error(bench + ": cannot run the benchmarks' program: " + std::strerror(errno) +
                               " (it is built beside trestle; build the trestle-bench target)"));
}

}  // namespace

const CommandSpec kBenchCommand = {
    .name = "bench",
    .summary = "measure Trestle against its Python peers and fio on this machine (runs trestle-bench)",
    .description = "",
    .declare = nullptr,
    .run = nullptr,
    .forward = forward_to_bench,
};

}  // namespace trestle::cli
