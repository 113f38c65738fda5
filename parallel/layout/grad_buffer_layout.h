// Where each parameter lives in Megatron-Core's contiguous parameter-and-gradient buffer (one per dtype and
// parameter group) and how the buffer is cut into buckets: parameters laid out in reverse order, a bucket closed once
// it holds bucket_size elements; with the distributed optimizer each parameter starts on a multiple of 64 and each
// bucket ends on a multiple of lcm(dp, 128) (and 2^16 for high NCCL bus bandwidth), so every data-parallel rank owns
// an equal contiguous shard of every bucket, and a shared embedding gets a bucket of its own. The same numbers the
// distributed optimizer's sharding, its saved flat state (dp_reshardable) and the gradient reduce-scatter depend on.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace trestle {

struct GradBufferOptions {
  int dp = 1;                                // data-parallel (with context-parallel) size
  std::optional<std::int64_t> bucket_size;   // elements; none: one bucket
  bool distributed_optimizer = false;
  bool pad_for_high_nccl_busbw = false;
};

struct BufferParam {
  std::int64_t start = 0, end = 0;  // [start, end) in the buffer
  int bucket = 0;
};

struct GradBufferLayout {
  std::vector<BufferParam> params;                            // in the order the parameters were given
  std::vector<std::pair<std::int64_t, std::int64_t>> buckets;  // [start, end)
  // Per bucket, its elements before the padding to the bucket multiple (Megatron's numel_unpadded: what a
  // dp_reshardable checkpoint stores of it).
  std::vector<std::int64_t> bucket_numel_unpadded;
  std::int64_t numel = 0, numel_unpadded = 0;
  // Data-parallel rank `rank`'s shard of bucket `bucket` (distributed optimizer: equal shards).
  std::pair<std::int64_t, std::int64_t> shard(int bucket, int rank, int dp) const;
};

// The part of one parameter a data-parallel rank owns under the distributed optimizer (Megatron's param range map):
// where it lies in the buffer, in its bucket, in the rank's shard, and within the parameter itself.
struct OwnedParamRange {
  std::size_t param = 0;  // index into the parameters as given
  std::pair<std::int64_t, std::int64_t> world, world_in_bucket, local, in_param;
};
// Every parameter piece inside rank `rank`'s shard of bucket `bucket`, in buffer order.
std::vector<OwnedParamRange> owned_param_ranges(const GradBufferLayout& layout, int bucket, int rank, int dp);

// numels: the parameters in model order (Megatron's `params` list); shared_embedding: which of them are the
// embedding shared with the output layer (same length, or empty for none).
GradBufferLayout grad_buffer_layout(const std::vector<std::int64_t>& numels, const std::vector<bool>& shared_embedding,
                                    const GradBufferOptions& options);

}  // namespace trestle
