// Σ x² of a tensor in double, as the gradient clipping's norm and the params norm take it (train/optim/adamw.h): a
// 0-dim double tensor on t's device. Float, bfloat16 and half tensors on the CPU go through the CPU build chosen for
// this CPU (cpu_table.h; cpu::Table::sum_of_squares: each square exact, the same bits on any number of threads, no
// widened copy); any other tensor through ATen, a bounded chunk at a time widened to double (nothing waits for a
// GPU's).
#pragma once

#include <ATen/Tensor.h>

namespace trestle::kernels {

at::Tensor sum_of_squares(const at::Tensor& t);
// The ATen path alone, on any tensor: chunks of 4M elements widened to double, each dotted with itself (what the CPU
// kernel replaces: `bench kernels` times the two).
at::Tensor sum_of_squares_widened(const at::Tensor& t);

}  // namespace trestle::kernels
