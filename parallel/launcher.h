// Local launcher (torchrun's role for one machine): binds the job's c10d store port and starts N worker processes with
// torchrun's variables, rank 0 serving the store on that socket; forwards their output line by line with a rank
// prefix, and when one fails terminates the others and reports which rank. Links no LibTorch.
// Without OMP_NUM_THREADS set, workers get the CPUs divided among them (torchrun gives each one thread).
#pragma once

#include <chrono>
#include <csignal>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::parallel {

struct LaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // the store's port; 0: one the system chooses
  // After the first failure, how long the other workers get between SIGTERM and SIGKILL.
  std::chrono::milliseconds grace = std::chrono::seconds(5);
  // The workers handle SIGTERM and SIGINT themselves (--exit-signal-handler): the first such signal the launcher gets
  // is passed on to them and the launcher waits for them as usual (the job exits 0 when they all do); a repeat is
  // handled as ExitSignalRequests says, and a force kill is announced on stderr.
  bool forward_signals = false;
  // With forward_signals: after a later repeat, how long the workers get to finish their save before SIGKILL.
  std::chrono::milliseconds exit_signal_grace = std::chrono::seconds(60);
  // With forward_signals: one more signal handled as SIGTERM and SIGINT are (Megatron's --exit-signal, e.g. SIGUSR1).
  int exit_signal = SIGTERM;
};

// With --exit-signal-handler, what each SIGTERM or SIGINT the launcher receives asks for. The first is passed on to
// the workers, which finish the step, save and commit. A repeat within `same_request` of the first is the same
// request (a scheduler's process-group kill and `timeout`'s own copy of it arrive together) and changes nothing. A
// later one starts the deadline for the workers: they are killed if still running exit_signal_grace after it.
class ExitSignalRequests {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Action { kForward, kSameRequest, kStartDeadline };
  explicit ExitSignalRequests(std::chrono::milliseconds same_request = std::chrono::seconds(2))
      : same_request_(same_request) {}
  Action receive(Clock::time_point now);

 private:
  std::chrono::milliseconds same_request_;
  std::optional<Clock::time_point> first_;
};

struct LaunchOutcome {
  int exit_code = 0;    // 0, the first failed worker's exit code, or 128 + its signal
  std::string failure;  // "rank R exited with code C" / "rank R exited with signal S"; empty when all succeeded
};

// Set in each worker's environment to the launcher's pid: a worker that finds it makes itself die with the launcher
// (die_with_launcher), whatever ends the launcher.
inline constexpr const char* kLauncherPidVariable = "TRESTLE_LAUNCHER_PID";

// Runs `command` (argv[0] is the executable's path) as ranks 0..nproc-1 with RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and kLauncherPidVariable set, and rank 0 with the store's listening
// socket (kStoreListenFdVariable, parallel/launch_environment.h), until every worker has exited.
// Errors only when the store's port cannot be bound or a worker cannot be started (those already started are killed).
Result<LaunchOutcome> launch_local_workers(const std::vector<std::string>& command, const LaunchOptions& options);

// In a worker this launcher started (kLauncherPidVariable set), or a worker of torchrun's agent (TORCHELASTIC_RUN_ID
// and RANK set: tied to its parent): the kernel kills it when the launcher exits, by any signal (SIGKILL included: no
// worker trains on, holding the save lock, after its launcher is gone). An error when the launcher is already gone;
// nothing for other workers (Slurm's tasks, a hand-started rank).
Status die_with_launcher();

// `arguments` without the named options and their values ("--name V" or "--name=V").
std::vector<std::string> remove_options(const std::vector<std::string>& arguments,
                                        const std::vector<std::string>& names);

}  // namespace trestle::parallel
