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
    if (o.distributed_optimizer) {  // owned[bucket][rank]: [param, world, world_in_bucket, local, in_param]
      for (std::size_t b = 0; b < layout.buckets.size(); ++b) {
        nlohmann::json ranks = nlohmann::json::array();
        for (int r = 0; r < o.dp; ++r) {
          nlohmann::json pieces = nlohmann::json::array();
          for (const auto& p : trestle::owned_param_ranges(layout, static_cast<int>(b), r, o.dp))
            pieces.push_back({p.param, p.world, p.world_in_bucket, p.local, p.in_param});
          ranks.push_back(pieces);
        }
        out["owned"].push_back(ranks);
      }
    }
    std::cout << out.dump() << "\n";
  }
  return 0;
}
