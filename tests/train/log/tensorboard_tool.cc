// Test entry point: writes a few iterations' reports as TensorBoard event files into DIR, for the interop test that
// reads them with TensorBoard's own event reader. usage: tensorboard_tool DIR ITERATIONS
#include <cstdio>
#include <cstdlib>

#include "train/log/train_log.h"

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  auto writer = trestle::TensorBoardWriter::open(argv[1]);
  if (!writer.ok()) {
    std::fprintf(stderr, "%s\n", writer.status().message().c_str());
    return 1;
  }
  const long long iterations = std::atoll(argv[2]);
  for (long long i = 1; i <= iterations; ++i) {
    trestle::IterationReport r;
    r.iteration = i;
    r.train_iters = iterations;
    r.consumed_samples = 8 * i;
    r.global_batch_size = 8;
    r.learning_rate = 1e-4 * static_cast<double>(i);
    r.lm_loss = 11.0 - 0.25 * static_cast<double>(i);
    r.grad_norm = 0.5 * static_cast<double>(i);
    r.seconds_per_iteration = 0.01;
    r.tokens_per_second = 1000.0;
    r.world_size = 4;
    trestle::TensorBoardChoices every;  // the optional scalars too
    every.timers = true;
    every.world_size = true;
    const auto s = trestle::write_tensorboard(*writer, r, every);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.message().c_str());
      return 1;
    }
  }
  std::printf("%s\n", writer->path().c_str());
  return 0;
}
