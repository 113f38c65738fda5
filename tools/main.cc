// trestle: one command line for checkpoints (inspect, convert, reshard, verify, diff, export, train, bench).
#include <cstdio>
#include <cstring>
#include <string_view>

#include "tools/command.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

constexpr Command kCommands[] = {
    {"bench", trestle::cli::bench_main, "measure Trestle against its Python peers and fio on this machine"},
    {"convert", trestle::cli::convert_main, "convert a model between formats (hf <-> trestle in any Megatron TP/PP/VPP/EP layout, hf -> hf)"},
    {"diff", trestle::cli::diff_main, "compare two checkpoints tensor by tensor in canonical (layout-free) space"},
    {"export", trestle::cli::export_main, "write a Trestle checkpoint as HDF5 (one dataset per tensor)"},
    {"import", trestle::cli::import_main, "read an exported HDF5 file back into a Trestle checkpoint"},
    {"inspect", trestle::cli::inspect_main, "show a checkpoint's architecture, tensors and totals"},
    {"reshard", trestle::cli::reshard_main, "rewrite a checkpoint in another TP/PP/VPP/EP/DP layout, with optimizer state"},
    {"train", trestle::cli::train_main, "launch a training job's workers and set up its parallel state (tp/pp/cp/ep/dp)"},
    {"verify", trestle::cli::verify_main, "check every checksum of a Trestle checkpoint (--against HF_DIR: compare every tensor)"},
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "trestle: native tools for large-model checkpoints (Hugging Face safetensors, Megatron, Trestle)\n\n"
               "usage: trestle <command> [options]   (trestle <command> --help for its options)\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    print_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kCommands)
    if (std::string_view(argv[1]) == c.name) return c.run(argc - 1, argv + 1);
  std::fprintf(stderr, "trestle: unknown command '%s'\n\n", argv[1]);
  print_usage(stderr);
  return 2;
}
