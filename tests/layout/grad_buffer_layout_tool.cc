// Test-only: reads JSON lines {"numels": [...], "shared": [...], "dp": N, "bucket_size": N|null, "dist_opt": bool,
// "high_busbw": bool} and prints, per line, the grad buffer layout as JSON (tests/interop/test_grad_buffer_megatron.py).
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "parallel/layout/grad_buffer_layout.h"

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    const auto in = nlohmann::json::parse(line);
    trestle::GradBufferOptions o;
    o.dp = in["dp"].get<int>();
    if (!in["bucket_size"].is_null()) o.bucket_size = in["bucket_size"].get<std::int64_t>();
    o.distributed_optimizer = in["dist_opt"].get<bool>();
    o.pad_for_high_nccl_busbw = in["high_busbw"].get<bool>();
    const auto layout = trestle::grad_buffer_layout(in["numels"].get<std::vector<std::int64_t>>(),
                                                    in["shared"].get<std::vector<bool>>(), o);
    nlohmann::json out;
    for (const auto& p : layout.params) out["params"].push_back({p.start, p.end, p.bucket});
    out["buckets"] = layout.buckets;
    out["numel"] = layout.numel;
    out["numel_unpadded"] = layout.numel_unpadded;
    std::cout << out.dump() << "\n";
  }
  return 0;
}
