// Writing Adam's state as Megatron-Core's distributed optimizer saves it by default ('dp_reshardable', read back by
// sources/dp_reshardable.h): the flat bucket tensors of every gradient buffer
// ("[chained_<i>.]optimizer.distributed.dp_group_idx_<G>.gbuf_idx_<chunk>.dtype_(<param>, <grad>).bucket_idx_<k>.
// <param | exp_avg | exp_avg_sq>", fp32, the bucket's elements up to its last parameter, cut into one chunk per
// parameter piece and padding gap of each data-parallel rank's shard as Megatron cuts them, padding zero), and per
// data-parallel group the pickled objects its load asks for (`optimizer` with the param groups and step,
// `per_bucket_numel`, `per_bucket_numel_unpadded`; with a loss
// scaler, constant or an fp16 model's, `grad_scaler`). The buffers are laid out for the run that will load it: its
// data-parallel size and bucketing (Megatron-LM's --overlap-grad-reduce / --ddp-bucket-size), which fix the bucket
// sizes Megatron-Core checks on load.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "convert/formats/torch/dcp_checkpoint.h"
#include "convert/formats/torch/pickle_value.h"
#include "convert/sources/canonical_source.h"
#include "parallel/layout/megatron_buffer_params.h"

namespace trestle {

// The loading run's settings, under Megatron-LM's argument names.
struct DpReshardableWriteOptions {
  int dp = 0;                        // data-parallel size (0: the written layout's, at least its expert-parallel size)
  bool overlap_grad_reduce = false;  // --overlap-grad-reduce: buckets (else one bucket per buffer)
  std::optional<std::int64_t> bucket_size;  // --ddp-bucket-size (default max(40M, 1M x dp) elements)
  bool grad_reduce_in_bf16 = false;         // --grad-reduce-in-bf16 (bf16 models reduce gradients in fp32 otherwise)
  std::optional<double> lr;                 // --lr: the param groups' max_lr (required)
  double min_lr = 0.0;                      // --min-lr
  double weight_decay = 0.01;               // --weight-decay
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  // --transformer-impl: the layer specification that orders the run's parameters (Transformer Engine's puts the input
  // norm after linear_proj); written to args.transformer_impl. Default: the source's.
  std::optional<NormNaming> transformer_impl;
  // --loss-scale: the run keeps a constant loss scale (Megatron-Core's ConstantGradScaler, built with the distributed
  // optimizer whatever the dtype), whose state {} its load asks for as each group's 'grad_scaler'.
  bool constant_loss_scale = false;
};

// Checks the values (a learning rate given, sizes at least 1, hyper-parameters finite and in range); errors name the
// Megatron-LM argument.
Status check_dp_reshardable_options(const DpReshardableWriteOptions& options);

// Megatron-Core's param groups of one optimizer (its dense or its experts' one), as its state_dict keeps them
// without their params: one per (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) it builds (weights with
// decay, norms and biases without), each with the hyper-parameters its load takes over (lr, max_lr, min_lr, betas,
// eps, weight_decay, TE's bias_correction, torch AdamW's flags) and the step.
std::vector<PickleValue*> megatron_param_groups(PickleDocument& doc, bool experts, std::int64_t step,
                                                const DpReshardableWriteOptions& options);

// One chunk of a bucket tensor: elements [offset, offset + size) of `key`, holding elements [param_offset, ...) of the
// parameter's flat values (its boxes of `source_tensor`, stacked; zeros past them: vocabulary padding), or zeros when
// source_tensor is empty (padding between parameters).
struct FlatChunk {
  std::string key;
  std::int64_t global = 0, offset = 0, size = 0;
  std::string source_tensor;
  std::vector<Box> boxes;
  std::int64_t param_offset = 0;
};

struct DpReshardablePlan {
  std::vector<MegatronOptimizerBuffer> buffers;
  std::vector<std::vector<FlatChunk>> ranks;         // per rank of the written layout
  std::vector<std::vector<DcpObjectPiece>> objects;  // per rank
  bool chained = false;
  std::uint64_t bytes = 0;
  std::size_t buckets = 0;
  std::string dtypes;  // "(torch.float32, torch.float32)"
};

// `tensors`: the model's canonical tensors (they must outlive the plan); `layout`: the written checkpoint's (its
// data-parallel size is options.dp); `step`: Adam's step. Every tensor needs exp_avg and exp_avg_sq in `source` and
// an fp32 master (optimizer.fp32_param.<name>, or the weight itself when it is fp32); a layout Megatron-Core cannot
// save this way (a data-parallel shard holding no parameter) is refused.
Result<DpReshardablePlan> plan_dp_reshardable(const CanonicalSource& source,
                                              const std::vector<const CanonicalTensor*>& tensors,
                                              const ParallelLayout& layout, std::int64_t padded_vocab, NormNaming norms,
                                              std::int64_t step, const DpReshardableWriteOptions& options);

// The chunk's values as fp32, read from the source.
Status read_flat_chunk(const CanonicalSource& source, const FlatChunk& chunk, std::span<float> out);

// Adds to common.pt what Megatron-LM's load reads before the sharded state: the optimizer's sharding type
// ('optimizer') and the content metadata naming it, and to its args the settings of the run it was laid out for.
void add_dp_reshardable_common(PickleDocument& doc, PickleValue* common, PickleValue* args, bool chained,
                               const DpReshardableWriteOptions& options);

}  // namespace trestle
