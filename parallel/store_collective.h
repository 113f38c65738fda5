// Checkpoint collectives over a c10d key-value store (TCPStore under torchrun or Slurm, FileStore for local runs):
// all_gather of small byte strings is set-then-get of per-rank keys, which is all a checkpoint commit exchanges.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ckpt/collective.h"

namespace trestle::parallel {

class StoreCollective final : public Collective {
 public:
  // `prefix` separates independent users of one store (e.g. the checkpoint saver and the trainer).
  StoreCollective(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string prefix = "trestle/ckpt");
  ~StoreCollective() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Result<std::vector<std::string>> all_gather(const std::string& bytes) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  std::string prefix_;
  std::uint64_t round_ = 0;
};

// Where a process stands in the job and the store that connects the ranks.
struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  // This process's node (see LaunchEnvironment::node) and the job's store as "host:port" (empty for one process):
  // together they name per-node scratch files of the job.
  int node = 0;
  std::string store_address;
  c10::intrusive_ptr<c10d::Store> store;
  // Rank 0 serves the store (under `trestle train --nproc-per-node` or Slurm), not torchrun's agent.
  bool store_served_by_rank_0 = false;
};

// torchrun (its c10d rendezvous's agent store included, keys prefixed per restart attempt) or Slurm's srun, by the
// rules of read_launch_environment (parallel/launch_environment.h); a single process when neither is set.
Result<Rendezvous> rendezvous_from_environment(std::chrono::milliseconds timeout = std::chrono::minutes(5));
// The end of a worker's use of the job's store, on every rank whatever its outcome: when rank 0 serves the store and
// `succeeded`, it waits (up to `timeout`) for every rank to have left, so that none loses the store while still using
// it (its last checkpoint commit). A rank 0 that failed does not wait: the job has failed and its peers may be gone.
// Nothing to do under torchrun's agent store or for one process.
Status leave_rendezvous(const Rendezvous& rendezvous, bool succeeded, std::chrono::milliseconds timeout);
// Ranks of one machine meeting through a shared file (tests, local tools).
Result<Rendezvous> rendezvous_with_file(const std::string& path, int rank, int world_size);

}  // namespace trestle::parallel
