// TpGroup's collectives over real Gloo groups (one thread per rank): small CPU sums and maxima (gathered and reduced
// in rank order) equal the rank-order reduction bit for bit on every rank; large ones (Gloo's ring) equal it within
// rounding.
#include "train/model/tp_group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <vector>

namespace trestle::train {
namespace {

// Runs `body(group)` on `size` threads, each rank of one Gloo group; returns each rank's result.
std::vector<at::Tensor> on_every_rank(int size, const std::string& name,
                                      const std::function<at::Tensor(const TpGroup&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<at::Tensor> results(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
      TpGroup group{c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options), rank, size};
      results[rank] = body(group);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// Rank r's input: [rows, cols] of values in rank-seeded random order, in `dtype`.
at::Tensor input_of(int rank, std::int64_t rows, std::int64_t cols, at::ScalarType dtype) {
  at::Generator generator = at::detail::createCPUGenerator(1000 + rank);
  return at::randn({rows, cols}, generator, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

// inputs[0] + inputs[1] + ... in rank order (or their maximum).
at::Tensor rank_order(int size, std::int64_t rows, std::int64_t cols, at::ScalarType dtype, bool max) {
  at::Tensor out = input_of(0, rows, cols, dtype);
  for (int r = 1; r < size; ++r) {
    const at::Tensor next = input_of(r, rows, cols, dtype);
    out = max ? at::maximum(out, next) : out + next;
  }
  return out;
}

struct Case {
  int size;
  std::int64_t cols;  // 5: a few bytes, gathered; 65536: over 1 MiB gathered, Gloo's own collectives
  at::ScalarType dtype;
};

class TpGroupCollectives : public ::testing::TestWithParam<Case> {};

TEST_P(TpGroupCollectives, AllReduceSumAndMaxEqualTheRankOrderReduction) {
  const auto [size, cols, dtype] = GetParam();
  const bool gathered = cols == 5;
  for (bool max : {false, true}) {
    auto results = on_every_rank(size, max ? "max" : "sum", [&](const TpGroup& group) {
      at::Tensor t = input_of(group.rank, 6, cols, dtype);
      max ? group.all_reduce_max(t) : group.all_reduce_sum(t);
      return t;
    });
    const at::Tensor expected = rank_order(size, 6, cols, dtype, max);
    for (int r = 0; r < size; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + (max ? " max" : " sum"));
      ASSERT_EQ(results[r].scalar_type(), dtype);
      if (gathered || max) {
        EXPECT_TRUE(at::equal(results[r], expected));
      } else {
        EXPECT_TRUE(at::allclose(results[r].to(at::kFloat), expected.to(at::kFloat), 2e-2, 1e-5));
      }
      EXPECT_TRUE(at::equal(results[r], results[0])) << "the ranks hold different sums";
    }
  }
}

TEST_P(TpGroupCollectives, ReduceScatterKeepsEachRanksRowsOfTheSum) {
  const auto [size, cols, dtype] = GetParam();
  const bool gathered = cols == 5;
  auto results = on_every_rank(size, "reduce-scatter", [&](const TpGroup& group) {
    return group.reduce_scatter_dim0(input_of(group.rank, 6, cols, dtype));
  });
  const at::Tensor expected = rank_order(size, 6, cols, dtype, false);
  const std::int64_t rows = 6 / size;
  for (int r = 0; r < size; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const at::Tensor mine = expected.narrow(0, r * rows, rows);
    ASSERT_EQ(results[r].sizes(), mine.sizes());
    if (gathered) {
      EXPECT_TRUE(at::equal(results[r], mine));
    } else {
      EXPECT_TRUE(at::allclose(results[r].to(at::kFloat), mine.to(at::kFloat), 2e-2, 1e-5));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, TpGroupCollectives,
                         ::testing::Values(Case{2, 5, at::kFloat}, Case{3, 5, at::kFloat}, Case{2, 5, at::kBFloat16},
                                           Case{3, 5, at::kBFloat16}, Case{2, 65536, at::kFloat},
                                           Case{3, 65536, at::kFloat}),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return std::to_string(param_info.param.size) + "ranks_" +
                                  std::to_string(param_info.param.cols) + "cols_" +
                                  (param_info.param.dtype == at::kBFloat16 ? "bf16" : "fp32");
                         });

}  // namespace
}  // namespace trestle::train
