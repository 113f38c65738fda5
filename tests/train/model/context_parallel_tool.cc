// Test-only: `trestle_context_parallel_tool SEQ CP` prints, as JSON, the global token positions each context-parallel
// rank holds (cp_positions), for the comparison with megatron-core (tests/interop/test_context_parallel_megatron.py).
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "train/model/context_parallel.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: trestle_context_parallel_tool SEQ CP\n";
    return 2;
  }
  try {
    const std::int64_t seq = std::stoll(argv[1]);
    const int cp = std::stoi(argv[2]);
    nlohmann::json out = nlohmann::json::array();
    for (int rank = 0; rank < cp; ++rank) {
      const at::Tensor pos = trestle::train::cp_positions(seq, cp, rank);
      const std::int64_t* first = pos.data_ptr<std::int64_t>();
      out.push_back(std::vector<std::int64_t>(first, first + pos.numel()));
    }
    std::cout << out.dump() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "context_parallel_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
