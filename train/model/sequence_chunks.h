// The chunked scans' (gated_delta_rule.h, mamba_scan.h) cut of a sequence into chunks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace trestle::train {

// t [b, h, s, ...] as fp32 [b, h, ceil(s / chunk), chunk, ...], the last chunk padded with zeros.
inline at::Tensor sequence_chunks(const at::Tensor& t, std::int64_t chunk) {
  at::Tensor x = t.to(at::kFloat);
  const std::int64_t s = x.size(2), n = (s + chunk - 1) / chunk, pad = n * chunk - s;
  if (pad > 0) {
    std::vector<std::int64_t> shape = x.sizes().vec();
    shape[2] = pad;
    x = at::cat({x, at::zeros(shape, x.options())}, 2);
  }
  std::vector<std::int64_t> shape = x.sizes().vec();
  shape[2] = chunk;
  shape.insert(shape.begin() + 2, n);
  return x.reshape(shape);
}

}  // namespace trestle::train
