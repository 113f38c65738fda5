// trestle-train: the trainer's program, run by `trestle train` with the command's name first (its local workers are
// started the same way), apart from `trestle` so that the converters do not load LibTorch.
#include <cstdio>

#include "tools/train.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "trestle-train: run it as `trestle train [options]`\n");
    return 2;
  }
  return trestle::cli::train_main(argc - 1, argv + 1);
}
