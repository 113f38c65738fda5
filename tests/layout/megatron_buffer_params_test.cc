#include "parallel/layout/megatron_buffer_params.h"

#include <gtest/gtest.h>

namespace trestle {
namespace {

// The keys as megatron-core 0.16's DistributedOptimizer writes them in a 'dp_reshardable' checkpoint.
TEST(DpReshardableKeys, SpellTheGroupPrefixAndBucketKeyAsMegatronCore) {
  EXPECT_EQ(dp_reshardable_group_prefix(-1, 0), "optimizer.distributed.dp_group_idx_0.");
  EXPECT_EQ(dp_reshardable_group_prefix(1, 3), "chained_1.optimizer.distributed.dp_group_idx_3.");
  EXPECT_EQ(dp_reshardable_bucket_key(-1, 2, 1, "(torch.bfloat16, torch.float32)", 4),
            "optimizer.distributed.dp_group_idx_2.gbuf_idx_1.dtype_(torch.bfloat16, torch.float32).bucket_idx_4");
  EXPECT_EQ(dp_reshardable_bucket_key(0, 0, 0, "(torch.float32, torch.float32)", 0),
            "chained_0.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0");
}

}  // namespace
}  // namespace trestle
