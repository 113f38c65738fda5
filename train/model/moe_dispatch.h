// Expert-parallel token dispatch as Megatron-Core's all-to-all dispatcher does it, without token dropping. A rank's
// routed rows, grouped by (global) expert (permute_tokens, moe_router.h), go by an all-to-all over the expert-parallel
// group to the rank that holds their expert (experts in contiguous blocks of num_experts / ep); under sequence
// parallelism they are then gathered over the tensor-parallel group, so each tensor-parallel piece of an expert sees
// every row routed to it. The received rows are grouped by local expert. combine() is the way back: the experts'
// partial outputs summed over the tensor-parallel group (each rank keeping the rows it sent), returned by the reverse
// all-to-all in the order dispatch() took them. Both run through autograd: each exchange's backward is the reverse
// exchange. Every rank of both groups must construct, dispatch and combine in the same order.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

#include "train/model/tp_group.h"

namespace trestle::train {

// All-to-all along dim 0 through autograd: rank r sends rows [Σ input_splits[<j], +input_splits[j]) to rank j and
// receives output_splits[j] rows from rank j, in rank order.
at::Tensor all_to_all(const at::Tensor& x, const TpGroup& group, std::vector<std::int64_t> output_splits,
                      std::vector<std::int64_t> input_splits);

class TokenDispatcher {
 public:
  // tokens_per_expert: [num_experts] (any integer dtype and device): the rows this rank dispatches to each expert.
  // `ep`: the expert-parallel group; `tp`: the tensor-parallel group to gather over (size 1: none). Exchanges every
  // rank's counts (all-gathers over ep, then tp). Throws std::invalid_argument when ep does not divide the experts.
  TokenDispatcher(const at::Tensor& tokens_per_expert, const TpGroup& ep, const TpGroup& tp);

  // rows: [Σ tokens_per_expert, h], grouped by expert in expert order -> the rows of this rank's local experts from
  // every rank, grouped by local expert ([Σ rows_per_local_expert(), h]).
  at::Tensor dispatch(const at::Tensor& rows) const;
  // outputs: this rank's (tensor-parallel partial) outputs of dispatch()'s rows -> the summed outputs of the rows
  // given to dispatch(), in their order.
  at::Tensor combine(const at::Tensor& outputs) const;

  const std::vector<std::int64_t>& rows_per_local_expert() const { return rows_per_local_expert_; }
  std::int64_t first_local_expert() const { return first_local_expert_; }

 private:
  const TpGroup* ep_;
  const TpGroup* tp_;
  std::vector<std::int64_t> ep_send_, ep_receive_;  // rows per expert-parallel rank
  std::vector<std::int64_t> tp_receive_;            // rows each tensor-parallel rank received from the all-to-all
  std::int64_t received_ = 0;                       // rows this rank received from the all-to-all
  at::Tensor sort_, unsort_;  // (tp rank, ep rank, local expert) order <-> (local expert, tp rank, ep rank) order
  std::vector<std::int64_t> rows_per_local_expert_;
  std::int64_t first_local_expert_ = 0;
};

}  // namespace trestle::train
