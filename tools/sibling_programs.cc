// trestle bench ARGS... and trestle train ARGS...: run trestle-bench and trestle-train, programs of their own found
// beside this executable, so that `trestle` itself links neither the benchmarks nor LibTorch (the converters' memory
// stays their own: LibTorch's CUDA libraries alone add some 350 MiB of resident memory at start-up).
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <cxxopts.hpp>
#include <iostream>
#include <vector>

#include "tools/command.h"
#include "tools/parse_error.h"
#include "tools/self_exe.h"
#include "tools/train_options.h"

namespace trestle::cli {
namespace {

// Replaces this process with `program` beside it, passing argv[first..]; returns only when that fails.
Outcome exec_sibling(const char* program, const char* what, int first, int argc, char** argv) {
  auto dir = self_exe_dir();
  if (!dir.ok()) return failure(dir.status());
  const std::string path = *dir + "/" + program;
  std::vector<char*> args = {const_cast<char*>(path.c_str())};
  for (int i = first; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  ::execv(path.c_str(), args.data());
  return failure(Status::Error(path + ": cannot run " + what + ": " + std::strerror(errno) +
                               " (it is built beside trestle; build the " + program + " target)"));
}

Outcome forward_to_bench(int argc, char** argv) {
  return exec_sibling("trestle-bench", "the benchmarks' program", 1, argc, argv);
}
// trestle-train takes the command's name too, as its workers are started with it. The options are read here first:
// --help and --nproc-per-node are answered here, and a job's workers started without a launcher that loads LibTorch.
Outcome forward_to_train(int argc, char** argv) {
  cxxopts::Options spec = train_options();
  try {
    const auto args = parse_train_options(spec, argc, argv);
    if (args.count("help")) {
      std::cout << train_help(spec) << "\n";
      return finished();
    }
    if (args.count("nproc-per-node") && !args.count("print-groups")) {
      auto dir = self_exe_dir();
      if (!dir.ok()) return failure(dir.status());
      return finished(launch_train_workers(args, argc, argv, *dir + "/trestle-train"));
    }
  } catch (const cxxopts::exceptions::exception& e) {
    return usage_error(describe_parse_error(e, argc, argv));
  }
  return exec_sibling("trestle-train", "the trainer's program", 0, argc, argv);
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

const CommandSpec kTrainCommand = {
    .name = "train",
    .summary = "launch a training job's workers and set up its parallel state (tp/pp/cp/ep/dp) (runs trestle-train)",
    .description = "",
    .declare = nullptr,
    .run = nullptr,
    .forward = forward_to_train,
};

}  // namespace trestle::cli
