#include "parallel/layout/grad_buffer_layout.h"

#include <gtest/gtest.h>

namespace trestle {
namespace {

TEST(GradBufferLayout, DistributedOptimizerPadsParamsTo64AndBucketsToDpAnd128) {
  GradBufferOptions o;
  o.dp = 4;
  o.bucket_size = 300;
  o.distributed_optimizer = true;
  // reverse order: 1000 first, then 3 (start 1024, a new bucket), 640 (start 1088), ...
  const auto layout = grad_buffer_layout({70, 33, 640, 3, 1000}, {}, o);
  EXPECT_EQ(layout.params[4].start, 0);
  EXPECT_EQ(layout.params[4].end, 1000);
  EXPECT_EQ(layout.params[3].start, 1024);
  EXPECT_EQ(layout.params[2].start, 1088);
  ASSERT_EQ(layout.buckets.size(), 3u);
  EXPECT_EQ(layout.buckets[0], (std::pair<std::int64_t, std::int64_t>{0, 1024}));
  EXPECT_EQ(layout.numel, 2048);
  // equal contiguous shards of each bucket
  EXPECT_EQ(layout.shard(1, 1, 4), (std::pair<std::int64_t, std::int64_t>{1216, 1408}));
  for (const auto& [start, end] : layout.buckets) EXPECT_EQ((end - start) % 4, 0);
}

TEST(GradBufferLayout, WithoutDistributedOptimizerNothingIsPadded) {
  GradBufferOptions o;
  o.dp = 8;
  const auto layout = grad_buffer_layout({5, 7, 11}, {}, o);
  EXPECT_EQ(layout.numel, 23);
  EXPECT_EQ(layout.numel_unpadded, 23);
  EXPECT_EQ(layout.params[2].start, 0);
  EXPECT_EQ(layout.params[0].start, 18);
  EXPECT_EQ(layout.buckets.size(), 1u);
}

}  // namespace
}  // namespace trestle
