#include "parallel/launch_environment.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>

#include "parallel/hostlist.h"
#include "parallel/launcher.h"

namespace trestle::parallel {
namespace {

// A whole non-negative number in int's range, or why not.
Result<int> parse_count(const std::string& name, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || value < 0 || value > INT_MAX || errno == ERANGE)
    return Status::Error("environment variable " + name + "='" + text + "' is not a number");
  return static_cast<int>(value);
}

Result<int> read_int(const EnvironmentLookup& lookup, const std::string& name, std::optional<int> fallback) {
  const auto text = lookup(name);
  if (!text) {
    if (fallback) return *fallback;
    return Status::Error("environment variable " + name + " is not set");
  }
  return parse_count(name, *text);
}

// The id of the srun step that started this process (SLURM_STEP_ID, or the older SLURM_STEPID); nothing in a batch
// script, which has SLURM_PROCID but is no task of a step, or in one of Slurm's own steps (batch, extern,
// interactive: ids from 0xfffffffa up).
std::optional<std::string> slurm_step_id(const EnvironmentLookup& lookup) {
  auto step = lookup("SLURM_STEP_ID");
  if (!step) step = lookup("SLURM_STEPID");
  if (!step) return std::nullopt;
  const unsigned long long id = std::strtoull(step->c_str(), nullptr, 10);
  if (id >= 0xfffffffaULL) return std::nullopt;
  return step;
}

// Slurm's store address: MASTER_ADDR/MASTER_PORT when the script sets them, else task 0's host (the first of the
// step's nodes) and a port derived from the job id.
Status read_slurm_store(const EnvironmentLookup& lookup, LaunchEnvironment& out) {
  if (const auto addr = lookup("MASTER_ADDR")) {
    out.master_addr = *addr;
  } else {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      const auto hostlist = lookup(name);
      if (!hostlist) continue;
      auto host = first_host_of_hostlist(*hostlist);
      if (!host.ok()) return host.status().with_context(std::string("environment variable ") + name);
      out.master_addr = *host;
      break;
    }
    if (out.master_addr.empty())
      return Status::Error("a Slurm job of " + std::to_string(out.world_size) +
                           " tasks needs its store's host: set MASTER_ADDR, or run under srun (which sets "
                           "SLURM_STEP_NODELIST / SLURM_JOB_NODELIST)");
  }
  if (const auto port = lookup("MASTER_PORT")) {
    TRESTLE_ASSIGN_OR_RETURN(out.master_port, parse_count("MASTER_PORT", *port));
  } else if (const auto job = lookup("SLURM_JOB_ID")) {
    auto port_of_job = slurm_job_port(*job, slurm_step_id(lookup).value_or("0"));
    if (!port_of_job.ok()) return port_of_job.status();
    out.master_port = *port_of_job;
  } else {
    return Status::Error("a Slurm job of " + std::to_string(out.world_size) +
                         " tasks needs its store's port: set MASTER_PORT, or SLURM_JOB_ID to derive it from");
  }
  return OkStatus();
}

Result<LaunchEnvironment> read_torchrun(const EnvironmentLookup& lookup) {
  LaunchEnvironment out;
  // Who set RANK and WORLD_SIZE: torchrun's agent (its TORCHELASTIC_* variables), `trestle train --nproc-per-node`
  // (which also names its pid), or whoever started the process by hand.
  out.launcher =
      lookup(kLauncherPidVariable) ? "trestle train"
      : lookup("TORCHELASTIC_RUN_ID") || lookup("TORCHELASTIC_RESTART_COUNT") || lookup("TORCHELASTIC_USE_AGENT_STORE")
          ? "torchrun"
          : "the RANK / WORLD_SIZE environment";
  TRESTLE_ASSIGN_OR_RETURN(out.rank, read_int(lookup, "RANK", std::nullopt));
  TRESTLE_ASSIGN_OR_RETURN(out.world_size, read_int(lookup, "WORLD_SIZE", 1));
  TRESTLE_ASSIGN_OR_RETURN(out.local_rank, read_int(lookup, "LOCAL_RANK", 0));
  TRESTLE_ASSIGN_OR_RETURN(out.node, read_int(lookup, "GROUP_RANK", out.rank - std::min(out.rank, out.local_rank)));
  TRESTLE_ASSIGN_OR_RETURN(out.local_world_size, read_int(lookup, "LOCAL_WORLD_SIZE", 0));
  if (out.world_size == 1) return out;
  const auto addr = lookup("MASTER_ADDR");
  const auto port = lookup("MASTER_PORT");
  if (!addr || !port)
    return Status::Error("MASTER_ADDR and MASTER_PORT must be set for a job of " + std::to_string(out.world_size) +
                         " ranks");
  out.master_addr = *addr;
  TRESTLE_ASSIGN_OR_RETURN(out.master_port, parse_count("MASTER_PORT", *port));
  out.store_served_by_agent = lookup("TORCHELASTIC_USE_AGENT_STORE") == std::optional<std::string>("True");
  if (const auto fd = lookup(kStoreListenFdVariable)) {
    if (out.rank != 0 || out.store_served_by_agent)
      return Status::Error(std::string(kStoreListenFdVariable) + " is set for rank " + std::to_string(out.rank) +
                           (out.store_served_by_agent ? " under torchrun's agent store" : "") +
                           ": only rank 0 of a local launch serves the store");
    TRESTLE_ASSIGN_OR_RETURN(out.store_listen_fd, parse_count(kStoreListenFdVariable, *fd));
  }
  if (const auto restarts = lookup("TORCHELASTIC_RESTART_COUNT")) {
    TRESTLE_ASSIGN_OR_RETURN(const int attempt, parse_count("TORCHELASTIC_RESTART_COUNT", *restarts));
    out.store_prefix = "/worker/attempt_" + std::to_string(attempt);
  }
  return out;
}

Result<LaunchEnvironment> read_slurm(const EnvironmentLookup& lookup) {
  LaunchEnvironment out;
  out.launcher = "Slurm";
  TRESTLE_ASSIGN_OR_RETURN(out.rank, read_int(lookup, "SLURM_PROCID", std::nullopt));
  // The step's tasks (srun -n fewer than the allocation's sets SLURM_STEP_NUM_TASKS to them).
  const std::string tasks = lookup("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS"
                            : lookup("SLURM_NTASKS")       ? "SLURM_NTASKS"
                                                           : "SLURM_NPROCS";
  TRESTLE_ASSIGN_OR_RETURN(out.world_size, read_int(lookup, tasks, std::nullopt));
  TRESTLE_ASSIGN_OR_RETURN(out.local_rank, read_int(lookup, "SLURM_LOCALID", 0));
  TRESTLE_ASSIGN_OR_RETURN(out.node, read_int(lookup, "SLURM_NODEID", out.rank - std::min(out.rank, out.local_rank)));
  if (out.world_size > 1) TRESTLE_RETURN_IF_ERROR(read_slurm_store(lookup, out));
  // Two jobs whose ids end in the same four digits share a port: each job's keys apart, so that a task of one never
  // joins the other (it waits for its own task 0, which could not serve the port, and says so).
  if (const auto job = lookup("SLURM_JOB_ID")) {
    out.store_prefix = "/slurm_job_" + *job;
    if (const auto step = slurm_step_id(lookup)) out.store_prefix += "." + *step;
  }
  return out;
}

}  // namespace

Result<int> slurm_job_port(const std::string& job_id, const std::string& step_id) {
  auto id = parse_count("SLURM_JOB_ID", job_id);
  if (!id.ok()) return id.status();
  auto step = parse_count("SLURM_STEP_ID", step_id);
  if (!step.ok()) return step.status();
  return static_cast<int>(15000 + (*id + *step) % 10000);
}

Result<LaunchEnvironment> read_launch_environment(const EnvironmentLookup& lookup) {
  Result<LaunchEnvironment> out = lookup("RANK") ? read_torchrun(lookup)
                                  : lookup("SLURM_PROCID") && slurm_step_id(lookup)
                                      ? read_slurm(lookup)
                                      : Result<LaunchEnvironment>(LaunchEnvironment{});
  if (!out.ok()) return out;
  if (out->world_size < 1) return Status::Error(out->launcher + " gives a world size of 0");
  if (out->rank >= out->world_size)
    return Status::Error(out->launcher + " gives rank " + std::to_string(out->rank) + ", not below the world size " +
                         std::to_string(out->world_size));
  if (out->local_world_size > 0 &&
      (out->local_rank >= out->local_world_size || out->local_world_size > out->world_size))
    return Status::Error(out->launcher + " gives LOCAL_RANK " + std::to_string(out->local_rank) +
                         " of LOCAL_WORLD_SIZE " + std::to_string(out->local_world_size) + " in a world of " +
                         std::to_string(out->world_size) +
                         ": a node's ranks must number 0 to LOCAL_WORLD_SIZE - 1, within the world");
  if (out->local_rank > out->rank)  // ranks number node by node: a node's local rank never exceeds the global one
    return Status::Error(out->launcher + " gives local rank " + std::to_string(out->local_rank) + " to rank " +
                         std::to_string(out->rank) + ": a local rank cannot exceed its global rank");
  if (out->world_size > 1 && (out->master_port < 1 || out->master_port > 65535))
    return Status::Error("the store's port " + std::to_string(out->master_port) + " is not in 1-65535");
  return out;
}

Result<LaunchEnvironment> read_launch_environment() {
  return read_launch_environment([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    return value && *value ? std::optional<std::string>(value) : std::nullopt;
  });
}

}  // namespace trestle::parallel
