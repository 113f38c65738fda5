// Test-only: Megatron's --pipeline-model-parallel-layout as Trestle parses it, for the comparison with megatron-core's
// PipelineParallelLayerLayout (tests/interop/test_pipeline_layout_megatron.py). Reads lines "PP NUM_LAYERS MTP_LAYERS
// LAYOUT" on stdin and prints, per line, one JSON object: {"stages": [[[begin, end] per chunk] per stage]} (the decoder
// layers of each), or {"error": ...} for a layout refused.
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "parallel/layout/parallel_layout.h"
#include "parallel/layout/pipeline_layout_string.h"

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    int pp = 1;
    std::int64_t num_layers = 0, mtp_layers = 0;
    std::string text;
    in >> pp >> num_layers >> mtp_layers >> text;
    nlohmann::json out;
    trestle::Result<trestle::PipelineLayoutString> parsed = trestle::Status::Error("unparsed");
    if (text.rfind("account:", 0) == 0) {  // "account:VPP:EMBEDDING:LOSS" (0 or 1 each)
      int vpp = 1, embedding = 0, loss = 0;
      char sep = 0;
      std::istringstream a(text.substr(8));
      a >> vpp >> sep >> embedding >> sep >> loss;
      auto layers = trestle::accounted_chunk_layers(num_layers, pp, vpp, embedding != 0, loss != 0);
      if (layers.ok()) parsed = trestle::PipelineLayoutString{vpp, *layers};
      else parsed = layers.status();
    } else {
      parsed = trestle::parse_pipeline_layout(text, pp, num_layers, mtp_layers);
    }
    if (!parsed.ok()) {
      out["error"] = parsed.status().message();
    } else {
      trestle::ParallelLayout layout;
      layout.pp = pp;
      layout.vpp = parsed->vpp;
      layout.chunk_layers = parsed->chunk_layers;
      auto stages = trestle::pipeline_layers(layout, num_layers);
      if (!stages.ok()) {
        out["error"] = stages.status().message();
      } else {
        out["stages"] = nlohmann::json::array();
        for (const auto& chunks : *stages) {
          nlohmann::json row = nlohmann::json::array();
          for (const auto& r : chunks) row.push_back({r.begin, r.end});
          out["stages"].push_back(row);
        }
      }
    }
    std::cout << out.dump() << "\n";
  }
  return 0;
}
