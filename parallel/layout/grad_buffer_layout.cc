#include "parallel/layout/grad_buffer_layout.h"

#include <algorithm>
#include <numeric>

namespace trestle {
namespace {

std::int64_t pad(std::int64_t n, std::int64_t divisor) { return (n + divisor - 1) / divisor * divisor; }

}  // namespace

std::pair<std::int64_t, std::int64_t> GradBufferLayout::shard(int bucket, int rank, int dp) const {
  const auto [start, end] = buckets.at(static_cast<std::size_t>(bucket));
  const std::int64_t size = (end - start) / dp;
  return {start + size * rank, start + size * (rank + 1)};
}

std::vector<OwnedParamRange> owned_param_ranges(const GradBufferLayout& layout, int bucket, int rank, int dp) {
  const auto [shard_start, shard_end] = layout.shard(bucket, rank, dp);
  const std::int64_t bucket_start = layout.buckets.at(static_cast<std::size_t>(bucket)).first;
  std::vector<OwnedParamRange> owned;
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const BufferParam& p = layout.params[i];
    const std::int64_t start = std::max(p.start, shard_start), end = std::min(p.end, shard_end);
    if (end <= start) continue;
    OwnedParamRange r;
    r.param = i;
    r.world = {start, end};
    r.world_in_bucket = {start - bucket_start, end - bucket_start};
    r.local = {start - shard_start, end - shard_start};
    r.in_param = {start - p.start, end - p.start};
    owned.push_back(r);
  }
  std::sort(owned.begin(), owned.end(), [](const auto& a, const auto& b) { return a.world < b.world; });
  return owned;
}

GradBufferLayout grad_buffer_layout(const std::vector<std::int64_t>& numels, const std::vector<bool>& shared_embedding,
                                    const GradBufferOptions& o) {
  const bool dist_opt = o.distributed_optimizer;
  std::int64_t divisor = std::lcm<std::int64_t>(o.dp, 128);
  if (o.pad_for_high_nccl_busbw) divisor = std::lcm<std::int64_t>(divisor, std::int64_t{1} << 16);
  auto pad_bucket_end = [&](std::int64_t end) { return dist_opt ? pad(end, divisor) : end; };
  auto pad_param_start = [&](std::int64_t start) { return dist_opt ? pad(start, 64) : start; };
  auto own_bucket = [&](std::size_t i) { return dist_opt && !shared_embedding.empty() && shared_embedding[i]; };

  GradBufferLayout layout;
  layout.params.resize(numels.size());
  std::int64_t param_start = 0, bucket_start = 0, param_end = 0;
  int bucket = 0, in_bucket = 0;
  auto close_bucket = [&](std::int64_t end) {
    layout.numel_unpadded += end - bucket_start;
    layout.bucket_numel_unpadded.push_back(end - bucket_start);
    const std::int64_t padded = pad_bucket_end(end);
    layout.buckets.emplace_back(bucket_start, padded);
    bucket_start = padded;
    in_bucket = 0;
    ++bucket;
    return padded;
  };
  for (std::size_t k = numels.size(); k-- > 0;) {  // reverse order: gradients become ready back to front
    param_start = pad_param_start(param_start);
    if (own_bucket(k) && in_bucket > 0) param_start = close_bucket(param_start);
    param_end = param_start + numels[k];
    layout.params[k] = {param_start, param_end, bucket};
    ++in_bucket;
    const bool full = o.bucket_size && param_end - bucket_start >= *o.bucket_size;
    param_start = full || own_bucket(k) ? close_bucket(param_end) : param_end;
  }
  if (in_bucket > 0) close_bucket(param_end);
  layout.numel = layout.buckets.empty() ? 0 : layout.buckets.back().second;
  return layout;
}

}  // namespace trestle
