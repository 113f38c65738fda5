// Megatron's parallel state in process: the group arithmetic (the jobs over real processes:
// jobs/parallel_state_job_test.cc).
#include "parallel/parallel_state.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "tests/support/status_matchers.h"

namespace {

using trestle::ParallelLayout;
using trestle::parallel::GroupKind;

TEST(ParallelStateGroups, EveryKindPartitionsTheWorldAndAgreesWithCoordinates) {
  ParallelLayout layout;
  layout.tp = 2;
  layout.cp = 2;
  layout.pp = 2;
  layout.data_parallel = 2;
  for (GroupKind kind : {GroupKind::kTensor, GroupKind::kData, GroupKind::kContext, GroupKind::kPipeline,
                         GroupKind::kModel, GroupKind::kDataWithContext, GroupKind::kTensorAndContext}) {
    auto groups = trestle::parallel::group_ranks(layout, kind);
    ASSERT_TRUE(groups.ok()) << groups.status().message();
    std::set<int> seen;
    for (const auto& g : *groups)
      for (int r : g)
        EXPECT_TRUE(seen.insert(r).second) << trestle::parallel::group_name(kind) << " repeats rank " << r;
    EXPECT_EQ(seen.size(), 16u) << trestle::parallel::group_name(kind);
  }
  // A dp group's ranks share tp, cp and pp coordinates and have dp ranks 0, 1, ... in order.
  const auto data = trestle::parallel::group_ranks(layout, GroupKind::kData);
  ASSERT_TRUE(data.ok()) << data.status().message();
  for (const auto& g : *data)
    for (std::size_t i = 0; i < g.size(); ++i) {
      const auto c = trestle::rank_coordinates(layout, g[i]), first = trestle::rank_coordinates(layout, g[0]);
      EXPECT_EQ(c.dp_rank, static_cast<int>(i));
      EXPECT_EQ(c.tp_rank, first.tp_rank);
      EXPECT_EQ(c.cp_rank, first.cp_rank);
      EXPECT_EQ(c.pp_rank, first.pp_rank);
    }
  layout.ep = 3;
  EXPECT_TRUE(trestle::fails_with(trestle::parallel::group_ranks(layout, GroupKind::kExpert),
                                  "world size 16 is not divisible by tensor x expert x pipeline parallel size 12"));
}

}  // namespace
