// Data-parallel gradient reduction as Megatron-Core's DistributedDataParallel does it (without the distributed
// optimizer): every parameter's .grad is a view into one contiguous buffer, cut into buckets of about
// `bucket_elements` in reverse parameter order (the order backward produces them). During the last micro-batch's
// backward, a bucket's all-reduce starts (asynchronously, on the data-parallel group) as soon as every gradient in it
// has been accumulated, so communication overlaps the rest of the backward; finish() waits for all of them. Gradients
// are scaled by 1/dp before the sum (Megatron's gradient_scaling_factor), giving the data-parallel mean.
// Buckets are started in bucket order on every rank, so all ranks issue the same collectives in the same order.
// With the distributed optimizer (Megatron's --use-distributed-optimizer) the buffer has Megatron-Core's layout for it
// (parallel/layout/grad_buffer_layout.h: padded parameter starts and bucket ends, a shared embedding in a bucket of
// its own) and each bucket is reduce-scattered instead: after finish() only this rank's shard of each bucket
// (owned_ranges()) holds the data-parallel mean; all_gather_parameters() then gives every rank the parameters each
// shard's owner updated.
// With a gradient dtype wider than the parameters' (Megatron's accumulate_allreduce_grads_in_fp32, its default for
// bf16), the buffer holds fp32 "main grads": after each backward a parameter's own gradient is added into its main
// grad and released, so micro-batches accumulate and the all-reduce runs in fp32.
// Parameters given a fused sink (Megatron's gradient accumulation fusion, fused_linear.h) get their gradient written
// into their place in the buffer by the layer's backward itself: zero() leaves their place alone (the first
// accumulation writes it), and one that received nothing by finish() is zeroed there.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "ckpt/status.h"
#include "parallel/layout/grad_buffer_layout.h"
#include "train/model/fused_linear.h"

namespace trestle::train {

class GradBuckets {
 public:
  // Megatron's default bucket size: max(40M, 1M × dp) elements.
  static std::int64_t default_bucket_elements(int data_parallel);

  // `params`: leaves that require grad, in the model's order. `dp_backend` null when dp == 1 (then no collectives);
  // `group_description` names its ranks in errors. `grad_dtype`: the buffer's dtype (the parameters' or wider).
  // `gradient_scale`: what gradients are multiplied by before the sum (0: 1 / data_parallel, the mean).
  // `sharded`: the distributed optimizer's layout and reduce-scatter, for data-parallel rank `dp_rank`, with
  // `shared_embedding` marking the embedding tied to the output layer (empty: none).
  struct Sharded {
    int dp_rank = 0;
    std::vector<bool> shared_embedding;
  };
  static Result<std::unique_ptr<GradBuckets>> create(std::vector<at::Tensor> params,
                                                     c10::intrusive_ptr<c10d::Backend> dp_backend, int data_parallel,
                                                     std::int64_t bucket_elements, std::string group_description,
                                                     at::ScalarType grad_dtype,
                                                     std::optional<Sharded> sharded = std::nullopt,
                                                     double gradient_scale = 0);
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;
  ~GradBuckets();

  // The sink through which `param`'s gradient is accumulated straight into the buffer from now on (the same one on
  // every call); null for a tensor that is not one of the parameters.
  WeightGradSink* fused_sink(const at::Tensor& param);

  // Zeroes every gradient (they stay views of the buffer, so backward accumulates into it in place).
  void zero();
  // Call before the last micro-batch's backward: from now on, complete buckets start their all-reduce.
  void arm();
  // Starts the buckets not yet started (and on one rank, scales nothing), waits for every all-reduce and disarms.
  // Errors (a collective failed or timed out) name the bucket.
  Status finish();

  // Distributed optimizer: waits for nothing; copies every parameter into a buffer of the gradient buffer's layout
  // and all-gathers each bucket's shards over the data-parallel group, then copies the gathered values back into the
  // parameters. Errors name the bucket.
  Status all_gather_parameters();
  // Distributed optimizer: the pieces of parameters this rank's shards hold (in buffer order).
  const std::vector<OwnedParamRange>& owned_ranges() const { return owned_; }

  // Megatron's --check-for-nan-in-loss-and-grad: each bucket's local gradients are checked for NaN or Inf as the
  // bucket starts its reduction (on the device, no synchronisation); after finish(), the buckets of this step that
  // held any, in bucket order (reading them waits for the device). Empty when every gradient was finite.
  std::vector<std::size_t> nonfinite_buckets() const;
  // Whether start() checks (off by default: the check reads every gradient once more).
  void check_nonfinite(bool on) { check_nonfinite_ = on; }
  // Test hook: the next step's first bucket gets a NaN gradient before its reduction (a rank's corrupt gradient).
  void poison_next_step_for_test() { poison_ = true; }

  std::size_t bucket_count() const { return buckets_.size(); }
  // Each parameter's accumulated gradient (views of the buffer, in `params` order): what clipping and the optimizer
  // read after finish().
  std::vector<at::Tensor>& grads() { return grads_; }
  const at::Tensor& buffer() const { return buffer_; }

 private:
  struct Bucket {
    at::Tensor data;  // view of buffer_
    std::size_t params = 0;
    std::size_t ready = 0;  // parameters whose gradient is complete
    c10::intrusive_ptr<c10d::Work> work;
    std::int64_t shard_start = 0, shard_numel = 0;  // distributed optimizer: this rank's shard of the bucket
    at::Tensor shard_out;                           // the reduce-scatter's output, copied into the shard by finish()
  };
  class ReadyHook;
  GradBuckets() = default;
  void on_ready(std::size_t param);
  void start_ready_buckets();
  void start(Bucket& bucket);

  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> grads_;       // per parameter: its view of buffer_
  bool separate_grads_ = false;         // grads_ are wider than the parameters: the hook moves each .grad into them
  std::vector<std::size_t> bucket_of_;  // per parameter
  std::vector<bool> ready_;             // per parameter: counted in its bucket's `ready` since arm()
  std::vector<std::unique_ptr<train::WeightGradSink>> sinks_;  // per parameter: null unless fused
  std::vector<Bucket> buckets_;
  std::size_t next_to_start_ = 0;
  at::Tensor buffer_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  int data_parallel_ = 1;
  double gradient_scale_ = 1.0;
  std::string group_description_;
  bool armed_ = false;
  std::optional<GradBufferLayout> sharded_layout_;  // distributed optimizer
  std::vector<OwnedParamRange> owned_;
  at::Tensor gathered_;  // all_gather_parameters' buffer (the parameters in the buffer's layout), kept across steps
  at::Tensor nonfinite_;  // per bucket: 1 when its local gradients held a NaN or Inf at start() this step
  bool poison_ = false;
  bool check_nonfinite_ = false;
};

}  // namespace trestle::train
