// trestle: one command line for checkpoints (inspect, convert, reshard, verify, diff, export, import, bench).
#include <malloc.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string_view>

#include "tools/command.h"

namespace {

using trestle::cli::CommandSpec;

const CommandSpec* const kCommands[] = {
    &trestle::cli::kBenchCommand,      &trestle::cli::kConvertCommand, &trestle::cli::kDiffCommand,
    &trestle::cli::kExportCommand,     &trestle::cli::kImportCommand,  &trestle::cli::kInspectCommand,
    &trestle::cli::kPreprocessCommand, &trestle::cli::kReshardCommand, &trestle::cli::kTrainCommand,
    &trestle::cli::kVerifyCommand,
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "trestle: native tools for large-model checkpoints (Hugging Face safetensors, Megatron, Trestle)\n\n"
               "usage: trestle <command> [options]   (trestle <command> --help for its options)\n\ncommands:\n");
  for (const CommandSpec* c : kCommands) std::fprintf(out, "  %-10s %s\n", c->name, c->summary);
  std::fprintf(out, "\nexit status: 0 success, 1 failure (or, for diff and verify, a mismatch), 2 usage error\n");
}

}  // namespace

int main(int argc, char** argv) {
  // Conversions fill and free large buffers (pieces, staging, source tensors) on one thread per rank. glibc raises its
  // mmap threshold to the size of the first such buffer freed (up to 32 MiB) and then keeps later ones in each
  // thread's arena, so peak RSS grew with the number of ranks (405 MiB for 8 ranks of a 1.5 GiB model, 189 MiB for
  // one). A fixed threshold maps every buffer of 1 MiB or more and returns it when freed (272 MiB for the 8 ranks).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  try {
    if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
      print_usage(argc < 2 ? stderr : stdout);
      return argc < 2 ? trestle::cli::kExitUsage : trestle::cli::kExitOk;
    }
    for (const CommandSpec* c : kCommands)
      if (std::string_view(argv[1]) == c->name) return trestle::cli::run_command(*c, argc - 1, argv + 1);
    std::fprintf(stderr, "trestle: unknown command '%s'\n\n", argv[1]);
    print_usage(stderr);
    return trestle::cli::kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trestle: %s\n", e.what());
    return trestle::cli::kExitFailure;
  }
}
