// The RMSNorm CUDA kernel against its CPU reference on the same inputs (a CUDA build with a GPU; skipped otherwise).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "kernels/rmsnorm.h"

#if defined(TRESTLE_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace trestle::kernels {
namespace {

#if defined(TRESTLE_HAVE_CUDA)

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// The kernel's output for `x` and `w` ([rows, cols] and [cols]), copied back to the host.
std::vector<float> run_kernel(const std::vector<float>& x, const std::vector<float>& w, std::int64_t rows,
                              std::int64_t cols, float eps) {
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  float *dx = nullptr, *dw = nullptr, *dy = nullptr;
  EXPECT_EQ(cudaMalloc(&dx, std::max<std::size_t>(n, 1) * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dw, std::max<std::size_t>(w.size(), 1) * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dy, std::max<std::size_t>(n, 1) * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(dw, w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  rmsnorm_forward_cuda(dx, dw, dy, rows, cols, eps, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> y(n);
  EXPECT_EQ(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
  return y;
}

TEST(RmsNormCuda, MatchesReference) {
  if (!have_gpu()) GTEST_SKIP() << "needs a CUDA GPU, and the CUDA runtime sees none";
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  // Widths below, at and above one block of 256 threads and one warp, ragged ones, and a model's hidden sizes.
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{1, 1},    {3, 64},   {5, 1000},  {0, 8},
                                                                     {7, 31},   {4, 255},  {4, 256},   {4, 257},
                                                                     {2, 4096}, {3, 5120}, {1, 65537}, {1024, 2048}};
  for (auto [rows, cols] : shapes) {
    std::vector<float> x(static_cast<std::size_t>(rows * cols)), w(static_cast<std::size_t>(cols));
    for (auto& v : x) v = 3.f * normal(rng);
    for (auto& v : w) v = normal(rng);
    std::vector<float> expected(x.size());
    rmsnorm_forward_reference(x.data(), w.data(), expected.data(), rows, cols, 1e-5f);
    const std::vector<float> y = run_kernel(x, w, rows, cols, 1e-5f);
    double worst = 0;
    for (std::size_t i = 0; i < y.size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(y[i]) - expected[i]) / (std::abs(expected[i]) + 1e-3));
    EXPECT_LT(worst, 1e-5) << rows << "x" << cols;
  }
}

TEST(RmsNormCuda, TinyAndLargeRows) {
  if (!have_gpu()) GTEST_SKIP() << "needs a CUDA GPU, and the CUDA runtime sees none";
  const std::int64_t cols = 300;
  std::vector<float> x(2 * cols), w(cols);
  for (std::int64_t c = 0; c < cols; ++c) {
    x[c] = 1e-20f * static_cast<float>(c + 1);            // mean square far below eps: y = x * w / sqrt(eps)
    x[cols + c] = 1e15f * static_cast<float>(c % 7 - 3);  // squares near 1e31, still finite in float32
    w[c] = 0.5f + static_cast<float>(c) / cols;
  }
  std::vector<float> expected(x.size());
  rmsnorm_forward_reference(x.data(), w.data(), expected.data(), 2, cols, 1e-5f);
  const std::vector<float> y = run_kernel(x, w, 2, cols, 1e-5f);
  for (std::size_t i = 0; i < y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << i;
    EXPECT_NEAR(y[i], expected[i], 1e-5 * std::abs(expected[i]) + 1e-30) << i;
  }
}

#else

TEST(RmsNormCuda, MatchesReference) { GTEST_SKIP() << "built without CUDA (TRESTLE_CUDA)"; }

#endif

}  // namespace
}  // namespace trestle::kernels
