// Where a worker stands in its job, as its launcher says through the environment: torchrun (and `trestle train
// --nproc-per-node`, which sets the same variables), Slurm's srun, or nothing (a single process). Pure: reads
// variables through a lookup, so the rules are tested without touching the process's environment.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "ckpt/status.h"

namespace trestle::parallel {

// Set in the environment of rank 0 of `trestle train --nproc-per-node` to the descriptor of the store's listening
// socket, which that rank serves the job's c10d store on.
inline constexpr const char* kStoreListenFdVariable = "TRESTLE_STORE_LISTEN_FD";

struct LaunchEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 0;  // the workers on this node, when the launcher says (torchrun's LOCAL_WORLD_SIZE); else 0
  // This process's node within the job: torchrun's GROUP_RANK, Slurm's SLURM_NODEID; without them the rank of the
  // node's first worker (RANK - LOCAL_RANK, ranks being numbered node by node). Per-node scratch files are named by it,
  // so two "nodes" on one machine do not share them.
  int node = 0;
  // The c10d TCPStore of the job (empty for a single process).
  std::string master_addr;
  int master_port = 0;
  // torchrun's agent already serves the store at master_addr:master_port (TORCHELASTIC_USE_AGENT_STORE=True, the
  // c10d rendezvous): every rank is a client. Otherwise rank 0 serves it.
  bool store_served_by_agent = false;
  // Rank 0 of `trestle train --nproc-per-node`: the store's socket, already bound and listening on master_port, which
  // the launcher passed down (kStoreListenFdVariable), so that no other process can take the port; else nothing.
  std::optional<int> store_listen_fd;
  // Prefix of every key this attempt writes: torchrun keeps its store across restarts (--max-restarts), so a restarted
  // job must not read the dead attempt's keys. "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>" as torch's
  // elastic workers used; under Slurm "/slurm_job_<SLURM_JOB_ID>[.<SLURM_STEP_ID>]", so that jobs whose derived ports
  // collide keep their keys apart; empty otherwise.
  std::string store_prefix;
  // "torchrun", "Slurm" or "a single process", for messages.
  std::string launcher = "a single process";
};

// The value of an environment variable, nothing when it is unset or empty.
using EnvironmentLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The rules, in order:
// - RANK set (torchrun): RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
//   TORCHELASTIC_USE_AGENT_STORE and TORCHELASTIC_RESTART_COUNT; LOCAL_WORLD_SIZE, when set, bounds LOCAL_RANK; rank 0
//   of `trestle train --nproc-per-node` also kStoreListenFdVariable.
// - else SLURM_PROCID and SLURM_STEP_ID set (a task srun started; a batch script has SLURM_PROCID but no step id, and
//   is a single process as torchrun takes it): SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS),
//   SLURM_LOCALID, SLURM_NODEID; MASTER_ADDR, else the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST,
//   SLURM_NODELIST): the host of task 0; MASTER_PORT, else slurm_job_port(SLURM_JOB_ID, SLURM_STEP_ID).
// - else a single process.
// A job of more than one rank without a store address fails naming the variables to set; so does a local rank above
// the global one (ranks number node by node).
Result<LaunchEnvironment> read_launch_environment(const EnvironmentLookup& lookup);
// The same from this process's environment.
Result<LaunchEnvironment> read_launch_environment();

// The store's port of a Slurm step that sets no MASTER_PORT: 15000 + the last four digits of the job id plus the step
// id (15000-24999; PyTorch Lightning's rule with the step added), so every task of a step derives the same port, two
// steps of one job running side by side on a node do not take the same one, and jobs sharing a node rarely collide.
Result<int> slurm_job_port(const std::string& job_id, const std::string& step_id);

}  // namespace trestle::parallel
