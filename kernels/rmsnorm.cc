#include "kernels/rmsnorm.h"

#include <cmath>

namespace trestle::kernels {

void rmsnorm_forward_reference(const float* x, const float* weight, float* y, std::int64_t rows, std::int64_t cols,
                               float eps) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    double sum_squares = 0;  // accumulate in double: the reference must not be the thing under doubt
    for (std::int64_t c = 0; c < cols; ++c) sum_squares += static_cast<double>(row[c]) * row[c];
    const float inv_rms = static_cast<float>(1.0 / std::sqrt(sum_squares / static_cast<double>(cols) + eps));
    for (std::int64_t c = 0; c < cols; ++c) y[r * cols + c] = row[c] * inv_rms * weight[c];
  }
}

}  // namespace trestle::kernels
