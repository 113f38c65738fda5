// trestle-train: the trainer's program, run by `trestle train` with the command's name first (its local workers are
// started the same way), apart from `trestle` so that the converters do not load LibTorch.
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "tools/train.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "trestle-train: run it as `trestle train [options]`\n");
    return 2;
  }
  // Each line of the log reaches a pipe (the launcher's, torchrun's, Slurm's file) when printed, as Megatron's
  // print_rank_0 flushes, not when a block fills or the process ends.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int code = trestle::cli::train_main(argc - 1, argv + 1);
  // Every file, thread and process group of the run is closed by now (train_main's scope owns them); what is left are
  // LibTorch's static destructors, which unregister its thousands of operators one by one: 0.3 to 0.4 s of CPU in
  // every launcher and every worker, for nothing. The output is flushed and the process ends without them.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}
