#include "parallel/parallel_state.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef TRESTLE_HAVE_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <numeric>
#include <string>
#include <thread>

namespace trestle::parallel {
namespace {

// Megatron's order tp-cp-ep-dp-pp; a generator's sizes in that order.
enum Dim { kTp, kCp, kEp, kDp, kPp, kDims };
using Sizes = std::array<int, kDims>;

// Mixed-radix digits of `index` over `shape` (first dimension fastest).
std::vector<int> decompose(int index, const std::vector<int>& shape) {
  std::vector<int> digits;
  for (int size : shape) {
    digits.push_back(index % size);
    index /= size;
  }
  return digits;
}

// generate_masked_orthogonal_rank_groups: the groups spanning the masked dimensions, one per combination of the others.
std::vector<std::vector<int>> masked_groups(const Sizes& sizes, const std::array<bool, kDims>& mask) {
  std::vector<int> masked_shape, unmasked_shape, masked_stride, unmasked_stride;
  int stride = 1;
  for (int d = 0; d < kDims; ++d) {
    (mask[d] ? masked_shape : unmasked_shape).push_back(sizes[d]);
    (mask[d] ? masked_stride : unmasked_stride).push_back(stride);
    stride *= sizes[d];
  }
  const int world = stride;
  const int group_size = std::accumulate(masked_shape.begin(), masked_shape.end(), 1, std::multiplies<>());
  std::vector<std::vector<int>> groups;
  for (int g = 0; g < world / group_size; ++g) {
    const auto outer = decompose(g, unmasked_shape);
    const int base = std::inner_product(outer.begin(), outer.end(), unmasked_stride.begin(), 0);
    std::vector<int> ranks;
    for (int r = 0; r < group_size; ++r) {
      const auto inner = decompose(r, masked_shape);
      ranks.push_back(base + std::inner_product(inner.begin(), inner.end(), masked_stride.begin(), 0));
    }
    groups.push_back(std::move(ranks));
  }
  return groups;
}

std::array<bool, kDims> mask_of(std::initializer_list<Dim> dims) {
  std::array<bool, kDims> mask{};
  for (Dim d : dims) mask[d] = true;
  return mask;
}

Status check_sizes(const ParallelLayout& layout) {
  for (const auto& [name, size] :
       {std::pair{"tensor", layout.tp}, std::pair{"pipeline", layout.pp}, std::pair{"context", layout.cp},
        std::pair{"expert", layout.ep}, std::pair{"data", layout.dp()}})
    if (size < 1)
      return Status::Error(std::string(name) + "-parallel size " + std::to_string(size) + " is not positive");
  if (layout.expert_tp() < 1)
    return Status::Error("expert-tensor-parallel size " + std::to_string(layout.expert_tp()) + " is not positive");
  const int expert_model_pipeline = layout.expert_tp() * layout.ep * layout.pp;
  if (layout.world_size() % expert_model_pipeline != 0)
    return Status::Error("world size " + std::to_string(layout.world_size()) + " is not divisible by " +
                         (layout.expert_tp() == layout.tp ? "tensor" : "expert-tensor") + " x expert x " +
                         "pipeline parallel size " + std::to_string(expert_model_pipeline));
  return OkStatus();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

// An exception's message without c10's C++ backtrace.
std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

// Every rank sets its key, then waits for all others; on timeout, names the ranks whose keys never appeared. Rank 0
// serves the store, so it waits (briefly) for the other arrived ranks to have read the missing ones before it returns.
// Every rank arrives, each saying what job it was started for (`job`: its world size and layout); a rank started
// for another (other launch variables or parallel flags on its node), or a rank number two processes claim, is named.
Status await_all_ranks(const Rendezvous& rendezvous, std::chrono::milliseconds timeout, const std::string& job) {
  const auto key = [](const char* what, int r) {
    return std::string("trestle/state/") + what + "/" + std::to_string(r);
  };
  const auto& store = rendezvous.store;
  try {
    if (store->add(key("claims", rendezvous.rank), 1) > 1)
      return Status::Error("rank " + std::to_string(rendezvous.rank) +
                           ": another process of this job already claims this rank (two given the same RANK or "
                           "SLURM_PROCID?)");
    store->set(key("arrived", rendezvous.rank), std::vector<uint8_t>(job.begin(), job.end()));
    std::vector<std::string> keys;
    for (int r = 0; r < rendezvous.world_size; ++r) keys.push_back(key("arrived", r));
    try {
      store->wait(keys, timeout);
      for (int r = 0; r < rendezvous.world_size; ++r) {
        const auto theirs = store->get(key("arrived", r));
        if (std::string(theirs.begin(), theirs.end()) != job)
          return Status::Error("rank " + std::to_string(rendezvous.rank) + " was started for a job of " + job +
                               ", rank " + std::to_string(r) + " for one of " +
                               std::string(theirs.begin(), theirs.end()) +
                               ": every node needs the same launch variables and parallel flags");
      }
      return OkStatus();
    } catch (const c10::Error&) {
      std::vector<int> missing;
      std::vector<std::string> reported;
      for (int r = 0; r < rendezvous.world_size; ++r) {
        if (!store->check({key("arrived", r)})) missing.push_back(r);
        else if (r != 0) reported.push_back(key("reported", r));
      }
      if (missing.empty()) throw;
      if (rendezvous.rank != 0) {
        store->set(key("reported", rendezvous.rank), std::vector<uint8_t>{1});
      } else {
        try {
          store->wait(reported, std::chrono::seconds(2));
        } catch (const c10::Error&) {
          // A rank that arrived and then died reports nothing; rank 0 has its own answer either way.
        }
      }
      std::string names;
      for (int r : missing) names += (names.empty() ? "" : ", ") + std::to_string(r);
      return Status::Error("rank " + std::to_string(rendezvous.rank) + ": rank(s) " + names +
                           " never arrived at the rendezvous of " + std::to_string(rendezvous.world_size) +
                           " ranks within " + std::to_string(timeout.count() / 1000) + " s");
    }
  } catch (const std::exception& e) {
    return Status::Error("rank " + std::to_string(rendezvous.rank) +
                         ": rendezvous through the c10d store failed: " + message_of(e));
  }
}

Result<c10::intrusive_ptr<c10d::Backend>> make_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                       const ParallelStateOptions& options) {
  if (options.backend == BackendKind::kNccl) {
#ifdef TRESTLE_HAVE_CUDA
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL::Options>();
    nccl->timeout = options.timeout;
    return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, nccl));
#else
    return Status::Error("NCCL process groups need a CUDA build of Trestle");
#endif
  }
  auto gloo = c10d::ProcessGroupGloo::Options::create(options.timeout);
  gloo->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo));
}

// The group `ranks` as seen by `rank`; only members create a backend, each under its own store prefix.
Result<ProcessGroup> make_group(const Rendezvous& rendezvous, std::vector<int> ranks, const std::string& prefix,
                                const ParallelStateOptions& options) {
  ProcessGroup group;
  group.ranks = std::move(ranks);
  const auto at = std::find(group.ranks.begin(), group.ranks.end(), rendezvous.rank);
  if (at == group.ranks.end()) return group;
  group.rank = static_cast<int>(at - group.ranks.begin());
  try {
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, rendezvous.store);
    TRESTLE_ASSIGN_OR_RETURN(group.backend, make_backend(store, group.rank, group.size(), options));
  } catch (const std::exception& e) {
    return Status::Error("rank " + std::to_string(rendezvous.rank) + ": cannot create process group " + prefix +
                         " of ranks [" + rank_list(group.ranks) + "]: " + message_of(e));
  }
  return group;
}

}  // namespace

std::string_view group_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::kDataWithContext:
      return "dp-cp";
    case GroupKind::kData:
      return "dp";
    case GroupKind::kContext:
      return "cp";
    case GroupKind::kModel:
      return "tp-pp";
    case GroupKind::kTensor:
      return "tp";
    case GroupKind::kPipeline:
      return "pp";
    case GroupKind::kEmbedding:
      return "embedding";
    case GroupKind::kPositionEmbedding:
      return "position-embedding";
    case GroupKind::kTensorAndContext:
      return "tp-cp";
    case GroupKind::kExpert:
      return "ep";
    case GroupKind::kExpertTensor:
      return "expert-tp";
    case GroupKind::kExpertData:
      return "expert-dp";
  }
  return "?";
}

Result<std::vector<std::vector<int>>> group_ranks(const ParallelLayout& layout, GroupKind kind) {
  TRESTLE_RETURN_IF_ERROR(check_sizes(layout));
  const Sizes dense = {layout.tp, layout.cp, 1, layout.dp(), layout.pp};
  const int etp = layout.expert_tp();
  const Sizes expert = {etp, 1, layout.ep, layout.world_size() / (etp * layout.ep * layout.pp), layout.pp};
  switch (kind) {
    case GroupKind::kDataWithContext:
      return masked_groups(dense, mask_of({kDp, kCp}));
    case GroupKind::kData:
      return masked_groups(dense, mask_of({kDp}));
    case GroupKind::kContext:
      return masked_groups(dense, mask_of({kCp}));
    case GroupKind::kModel:
      return masked_groups(dense, mask_of({kTp, kPp}));
    case GroupKind::kTensor:
      return masked_groups(dense, mask_of({kTp}));
    case GroupKind::kPipeline:
      return masked_groups(dense, mask_of({kPp}));
    case GroupKind::kTensorAndContext:
      return masked_groups(dense, mask_of({kTp, kCp}));
    case GroupKind::kExpert:
      return masked_groups(expert, mask_of({kEp}));
    case GroupKind::kExpertTensor:
      return masked_groups(expert, mask_of({kTp}));
    case GroupKind::kExpertData:
      return masked_groups(expert, mask_of({kDp}));
    case GroupKind::kEmbedding:
    case GroupKind::kPositionEmbedding: {
      std::vector<std::vector<int>> out;
      for (const auto& stages : masked_groups(dense, mask_of({kPp}))) {
        if (kind == GroupKind::kPositionEmbedding || stages.size() == 1) out.push_back({stages.front()});
        else out.push_back({stages.front(), stages.back()});
      }
      return out;
    }
  }
  return Status::Error("unknown group kind");
}

Result<ParallelState> ParallelState::create(const ParallelLayout& layout, const Rendezvous& rendezvous,
                                            const ParallelStateOptions& options) {
  TRESTLE_RETURN_IF_ERROR(check_sizes(layout));
  if (rendezvous.world_size != layout.world_size())
    return Status::Error("the job has " + std::to_string(rendezvous.world_size) + " ranks but the layout (tp " +
                         std::to_string(layout.tp) + ", pp " + std::to_string(layout.pp) + ", cp " +
                         std::to_string(layout.cp) + ", dp " + std::to_string(layout.dp()) + ") needs " +
                         std::to_string(layout.world_size()));
  const std::string job = std::to_string(rendezvous.world_size) + " ranks (tp " + std::to_string(layout.tp) + ", pp " +
                          std::to_string(layout.pp) + ", cp " + std::to_string(layout.cp) + ", ep " +
                          std::to_string(layout.ep) + ", dp " + std::to_string(layout.dp()) + ")";
  TRESTLE_RETURN_IF_ERROR(await_all_ranks(rendezvous, options.timeout, job));
  ParallelState state;
  state.layout_ = layout;
  state.rank_ = rendezvous.rank;
  state.coordinates_ = rank_coordinates(layout, rendezvous.rank);
  state.store_ = rendezvous.store;
  std::vector<int> everyone(static_cast<std::size_t>(rendezvous.world_size));
  std::iota(everyone.begin(), everyone.end(), 0);
  TRESTLE_ASSIGN_OR_RETURN(state.world_, make_group(rendezvous, everyone, "trestle/group/world", options));
  // Same order on every rank, each group under its own prefix: members of a group meet while the others go on.
  for (GroupKind kind : kAllGroupKinds) {
    TRESTLE_ASSIGN_OR_RETURN(auto all, group_ranks(layout, kind));
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (std::find(all[i].begin(), all[i].end(), rendezvous.rank) == all[i].end()) continue;
      const std::string prefix = "trestle/group/" + std::string(group_name(kind)) + "/" + std::to_string(i);
      TRESTLE_ASSIGN_OR_RETURN(state.groups_[static_cast<std::size_t>(kind)],
                               make_group(rendezvous, std::move(all[i]), prefix, options));
    }
  }
  state.coordinates_.ep_rank = state.ep_group().rank;
  state.coordinates_.etp_rank = state.expert_tp_group().rank;
  state.coordinates_.expert_dp_rank = state.expert_dp_group().rank;
  return state;
}

void ParallelState::shutdown(bool abort) const {
  auto end = [abort](const ProcessGroup& group) {
    if (!group.backend) return;
    try {
      if (abort) group.backend->abort();
      else group.backend->shutdown();
    } catch (const std::exception&) {
      // The job is over either way; a backend that cannot end cleanly has nothing left to lose.
    }
  };
  end(world_);
  for (GroupKind kind : kAllGroupKinds) end(group(kind));
}

std::vector<int> ParallelState::ranks_not_reporting_failure(std::chrono::milliseconds wait) const {
  const auto key = [](int r) { return "trestle/state/collective-failed/" + std::to_string(r); };
  std::vector<int> missing;
  if (!store_ || world_size() <= 1) return missing;
  try {
    store_->set(key(rank_), std::vector<uint8_t>{1});
    const auto deadline = std::chrono::steady_clock::now() + wait;
    for (;;) {
      missing.clear();
      for (int r = 0; r < world_size(); ++r)
        if (!store_->check({key(r)})) missing.push_back(r);
      if (missing.empty() || std::chrono::steady_clock::now() >= deadline) return missing;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    return {};  // the store went with its host (rank 0's process): nothing to tell
  }
}

}  // namespace trestle::parallel
