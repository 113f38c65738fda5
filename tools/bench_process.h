// Child processes for benchmarks: run a tool (fio) and capture what it prints, or keep a peer (a Python script) alive
// and talk to it one line at a time, so that its start-up cost stays out of the timings.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::cli {

struct CommandOutput {
  int exit_code = 0;  // 128 + signal number when killed by a signal
  std::string out;
  std::string err;
};

// Runs argv[0] (looked up in PATH) to completion. Fails only when it cannot be started ("fio: not found in PATH").
Result<CommandOutput> run_command(const std::vector<std::string>& argv);

// A long-lived child reading requests on stdin and answering each with one line on stdout; its stderr is ours.
class PeerProcess {
 public:
  static Result<std::unique_ptr<PeerProcess>> start(const std::vector<std::string>& argv);
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess();  // closes its stdin and waits for it to exit

  // Reads the next line the peer prints (without the newline); fails when it exits first.
  Result<std::string> read_line();
  // Sends one request line and returns the peer's one-line answer.
  Result<std::string> request(const std::string& line);

 private:
  PeerProcess(std::string name, pid_t pid, int to_child, int from_child)
      : name_(std::move(name)), pid_(pid), to_child_(to_child), from_child_(from_child) {}
  std::string exit_description();
  std::string name_;
  pid_t pid_;
  int to_child_;
  int from_child_;
  std::string buffered_;
};

// The interpreter to run peers with: `option` when given, else $TRESTLE_PYTHON, else $TRESTLE_VENV/bin/python,
// else ~/.cache/trestle/venv/bin/python (where scripts/setup puts the venv). Fails when it is not executable.
Result<std::string> find_python(const std::string& option);

}  // namespace trestle::cli
