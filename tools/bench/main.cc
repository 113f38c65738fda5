// trestle-bench <name> (also run as `trestle bench <name>`): measures Trestle against its peers and the disk's ceiling,
// in the same run (DESIGN.md, "Performance model"). A program of its own, so the product binary carries no bench code.
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string_view>

#include "tools/bench/bench.h"

namespace trestle::cli {
namespace {

struct Benchmark {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

constexpr Benchmark kBenchmarks[] = {
    {"convert", bench_convert_main,
     "convert a Llama-shaped bf16 model hf -> tp2/pp2 -> hf: Trestle vs a Python (safetensors+torch) script vs fio"},
    {"kernels", bench_kernels_main,
     "the fused kernels (RMSNorm, SwiGLU/GeGLU, soft-capping, cross-entropy, soft-capped attention, RoPE, "
     "cast-and-pack) vs ATen's composites and the bandwidth floor, CPU + GPU"},
    {"load", bench_load_main,
     "load a Llama-shaped bf16 Trestle checkpoint saved at tp2 into tp4 pieces (cold) vs DCP, torch.load and fio"},
    {"preprocess", bench_preprocess_main,
     "tokenize the shipped corpus into a Megatron indexed dataset: Trestle vs tokenizers + megatron-core (Python)"},
    {"reshard", bench_reshard_main, "reshard a Llama-shaped bf16 checkpoint tp2/pp2 -> tp4/pp1 beside the fio floor"},
    {"safetensors", bench_safetensors_main,
     "write and read a Llama-shaped bf16 state dict as sharded safetensors: Trestle vs safetensors (Python) vs fio"},
    {"save", bench_save_main,
     "save a Llama-shaped bf16 state dict (sync and async) vs DCP, torch.save and fio; save_async's blocking time"},
    {"train", bench_train_main,
     "train a model from scratch (a ~100M-parameter Llama on 2 CPU threads, any family, or --preset llama-1b on a "
     "GPU with MFU): trestle train vs PyTorch eager (transformers)"},
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "trestle bench: measure Trestle against its peers and the disk's ceiling, in the same run\n\n"
               "usage: trestle bench <benchmark> [options]   (trestle bench <benchmark> --help for its options)\n\n"
               "benchmarks:\n");
  for (const auto& b : kBenchmarks) std::fprintf(out, "  %-12s %s\n", b.name, b.summary);
  std::fprintf(out,
               "\nSpeeds are GB/s (10^9 bytes per second), best of --repeat alternating rounds; each benchmark prints\n"
               "a table and can save every figure as JSON (--json-out).\n");
}

}  // namespace
}  // namespace trestle::cli

int main(int argc, char** argv) {
  using trestle::cli::kBenchmarks;
  using trestle::cli::print_usage;
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    print_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& b : kBenchmarks) {
    if (std::string_view(argv[1]) != b.name) continue;
    // A benchmark that fails (a shape its kernels refuse, memory the device lacks) says why and exits 1.
    try {
      return b.run(argc - 1, argv + 1);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "trestle bench %s: %s\n", b.name, e.what_without_backtrace());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "trestle bench %s: %s\n", b.name, e.what());
    }
    return 1;
  }
  std::fprintf(stderr, "trestle bench: unknown benchmark '%s'\n\n", argv[1]);
  print_usage(stderr);
  return 2;
}
