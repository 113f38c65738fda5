// Megatron-Core's parallel state for one rank: its coordinates in the layout and every Megatron process group
// (memberships exactly as megatron/core/parallel_state.py builds them for the order tp-cp-ep-dp-pp), each a c10d
// backend.
#pragma once

#include <array>
#include <chrono>
#include <string_view>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "ckpt/status.h"
#include "parallel/layout/parallel_layout.h"
#include "parallel/store_collective.h"

namespace trestle::parallel {

// Megatron's groups, in the order initialize_model_parallel creates them (every rank creates them in this order).
enum class GroupKind {
  kDataWithContext,    // 'dp-cp': data-and-context (gradient reduction with context parallel)
  kData,               // 'dp': ranks sharing tp, cp and pp coordinates
  kContext,            // 'cp'
  kModel,              // 'tp-pp': model-parallel
  kTensor,             // 'tp'
  kPipeline,           // 'pp'
  kEmbedding,          // first and last rank of each pipeline group
  kPositionEmbedding,  // first rank of each pipeline group
  kTensorAndContext,   // 'tp-cp'
  kExpert,             // expert generator's 'ep'
  kExpertTensor,       // expert generator's 'tp': the routed experts' tensor parallelism (the 'tp' group at etp = tp)
  kExpertData,         // expert generator's 'dp': ranks holding the same experts
};
inline constexpr std::array<GroupKind, 12> kAllGroupKinds = {
    GroupKind::kDataWithContext,  GroupKind::kData,     GroupKind::kContext,      GroupKind::kModel,
    GroupKind::kTensor,           GroupKind::kPipeline, GroupKind::kEmbedding,    GroupKind::kPositionEmbedding,
    GroupKind::kTensorAndContext, GroupKind::kExpert,   GroupKind::kExpertTensor, GroupKind::kExpertData};
// Short names ("tp", "dp", "dp-cp", "embedding", "ep", "expert-dp", ...).
std::string_view group_name(GroupKind kind);

// Every group of one kind, each a list of global ranks, in Megatron's order. Expert groups come from Megatron's expert
// rank generator (tensor parallel = the layout's expert_tp(), cp folded into the expert-data dimension): with cp 1 and
// etp = tp the ep rank is dp_rank % ep. Errors when the sizes do not divide the world.
Result<std::vector<std::vector<int>>> group_ranks(const ParallelLayout& layout, GroupKind kind);

// One process group as seen by one rank: `backend` is null and rank -1 when the rank is not a member.
struct ProcessGroup {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<int> ranks;  // global ranks, in group-rank order
  int rank = -1;           // this rank's place in `ranks`
  int size() const { return static_cast<int>(ranks.size()); }
  bool member() const { return rank >= 0; }
};

enum class BackendKind { kGloo, kNccl };

struct ParallelStateOptions {
  BackendKind backend = BackendKind::kGloo;                      // kNccl needs a CUDA build
  std::chrono::milliseconds timeout = std::chrono::minutes(10);  // Megatron's --distributed-timeout-minutes
};

class ParallelState {
 public:
  // Collective over all ranks of the rendezvous: checks that every rank arrives within the timeout (naming the
  // missing ranks otherwise), that the world size matches the layout, then creates every group in Megatron's order.
  static Result<ParallelState> create(const ParallelLayout& layout, const Rendezvous& rendezvous,
                                      const ParallelStateOptions& options = {});

  const ParallelLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int world_size() const { return layout_.world_size(); }
  const RankCoordinates& coordinates() const { return coordinates_; }
  const ProcessGroup& world_group() const { return world_; }

  const ProcessGroup& group(GroupKind kind) const { return groups_[static_cast<std::size_t>(kind)]; }
  const ProcessGroup& tp_group() const { return group(GroupKind::kTensor); }
  const ProcessGroup& pp_group() const { return group(GroupKind::kPipeline); }
  const ProcessGroup& dp_group() const { return group(GroupKind::kData); }
  const ProcessGroup& cp_group() const { return group(GroupKind::kContext); }
  const ProcessGroup& dp_cp_group() const { return group(GroupKind::kDataWithContext); }
  const ProcessGroup& mp_group() const { return group(GroupKind::kModel); }
  const ProcessGroup& tp_cp_group() const { return group(GroupKind::kTensorAndContext); }
  const ProcessGroup& embedding_group() const { return group(GroupKind::kEmbedding); }
  const ProcessGroup& position_embedding_group() const { return group(GroupKind::kPositionEmbedding); }
  const ProcessGroup& ep_group() const { return group(GroupKind::kExpert); }
  const ProcessGroup& expert_tp_group() const { return group(GroupKind::kExpertTensor); }
  const ProcessGroup& expert_dp_group() const { return group(GroupKind::kExpertData); }

  // After a collective of this rank failed or timed out: says so through the job's store, then waits up to `wait`
  // for the other ranks to say the same and returns the ranks that did not (they stopped answering or died: the
  // ones the collective missed). Empty when all reported, or when the store itself cannot be reached.
  std::vector<int> ranks_not_reporting_failure(std::chrono::milliseconds wait) const;

  // Ends every group's backend, in the order they were made (the same on every rank), as destroy_process_group does:
  // NCCL communicators finalized after their pending collectives and destroyed, so none outlives the CUDA context
  // into the process's exit (where NCCL's threads, left running, corrupted the heap on a GPU machine). With `abort`,
  // torn down at once instead, for a job that failed and whose peers may never finish a collective. Once, at the end.
  void shutdown(bool abort) const;

  bool is_first_pipeline_stage() const { return coordinates_.pp_rank == 0; }
  bool is_last_pipeline_stage() const { return coordinates_.pp_rank == layout_.pp - 1; }

 private:
  ParallelLayout layout_;
  int rank_ = 0;
  RankCoordinates coordinates_;
  ProcessGroup world_;
  std::array<ProcessGroup, kAllGroupKinds.size()> groups_;
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace trestle::parallel
