// The parameters of one of Megatron-Core's gradient buffers, in the order its modules register them (named_parameters:
// in a layer the input norm, linear_proj, linear_qkv's norm, weight and bias, the q/k norms, the pre-MLP norm, fc1's
// norm and weight, fc2; in an MoE layer the router, each local expert's fc1 and fc2, the shared expert's gate, fc1,
// fc2). A buffer holds one model chunk of one model-parallel rank: its dense parameters, or under expert parallelism
// (which gives experts buffers of their own) its experts'. The distributed optimizer lays these out with
// grad_buffer_layout and its 'dp_reshardable' checkpoints store their state that way.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/box.h"
#include "ckpt/status.h"
#include "parallel/layout/model_spec.h"
#include "parallel/layout/parallel_layout.h"

namespace trestle {

struct MegatronBufferParam {
  const CanonicalTensor* tensor = nullptr;  // the canonical tensor whose values it holds
  std::vector<Box> boxes;                   // this rank's boxes of the tensor, stacked from the parameter's start
  std::int64_t numel = 0;                   // the parameter's elements (vocabulary padding included, after the boxes)
  bool shared_embedding = false;            // a tied embedding split over pipeline stages: a bucket of its own
  bool tied_copy = false;  // the last stage's copy of a tied embedding (tensor: the embedding, whose state it shares)
};

enum class BufferKind { kAll, kDense, kExperts };

struct BufferOwner {
  int tp_rank = 0, pp_rank = 0, chunk = 0, ep_rank = 0;
};

// `tensors`: the model's canonical tensors; `tied_embeddings`: the output layer is the embedding;
// `padded_vocab`: the vocabulary rows of the embedding (and output layer) over all tp ranks; `stored_norms`: the
// layer specification of the Megatron model (its norm naming: Transformer Engine's puts the input norm inside
// linear_qkv, after linear_proj). Errors name a tensor whose place in Megatron's modules is not known.
Result<std::vector<MegatronBufferParam>> megatron_buffer_params(const std::vector<const CanonicalTensor*>& tensors,
                                                                const ParallelLayout& layout, std::int64_t num_layers,
                                                                std::int64_t num_experts, bool tied_embeddings,
                                                                std::int64_t padded_vocab, NormNaming stored_norms,
                                                                const BufferOwner& owner, BufferKind kind);

// One gradient buffer of Megatron-Core's distributed optimizer and the parameters it holds, in registration order.
// Under expert parallelism the experts have an optimizer of their own: chain 1 beside the dense chain 0 (Megatron's
// `chained_<i>.` key prefix); otherwise one optimizer, chain -1 (no prefix).
struct MegatronOptimizerBuffer {
  int chain = -1;
  int group = 0;      // dp_group_idx: the rank in the model-parallel group (tp x pp; for the experts' tp x ep x pp)
  BufferOwner owner;  // owner.chunk: the buffer's index (gbuf_idx) within its group
  BufferKind kind = BufferKind::kAll;
  int dp = 1;  // the data-parallel ranks that shard it: dp x cp, divided by ep for the experts'
  std::vector<MegatronBufferParam> params;
};

// Every buffer of every model-parallel rank of `layout`, ordered by chain, group and chunk (arguments as above).
Result<std::vector<MegatronOptimizerBuffer>> megatron_optimizer_buffers(
    const std::vector<const CanonicalTensor*>& tensors, const ParallelLayout& layout, std::int64_t num_layers,
    std::int64_t num_experts, bool tied_embeddings, std::int64_t padded_vocab, NormNaming stored_norms);

// How a 'dp_reshardable' checkpoint names a buffer's state: "[chained_<chain>.]optimizer.distributed.dp_group_idx_<group>."
// prefixes the group's objects (optimizer, per_bucket_numel, ...); the bucket's flat tensors follow it with
// "gbuf_idx_<chunk>.dtype_<dtypes>.bucket_idx_<bucket>.<state>" (dtypes: Megatron's spelling of the buffer's
// (param, grad) dtype pair).
std::string dp_reshardable_group_prefix(int chain, int group);
std::string dp_reshardable_bucket_key(int chain, int group, int chunk, std::string_view dtypes, std::int64_t bucket);

}  // namespace trestle
