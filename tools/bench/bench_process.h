// Child processes for benchmarks, one runner for all: run a program to completion (its output captured, its wall time
// and its own peak RSS measured), or keep a peer alive and talk to it one line at a time.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::cli {

struct ChildRun {
  int exit_code = 0;  // 128 + signal number when killed by a signal
  std::string out;
  std::string err;
  double seconds = 0;          // wall time from start to exit
  // The child's own peak resident set. wait4's ru_maxrss starts from this process's resident set at the spawn (Linux
  // carries the spawning mm's high-water mark into the child), so where it does not rise above that, the child's
  // VmHWM sampled every 10 ms while it runs is taken instead.
  std::uint64_t peak_rss = 0;
};

// Runs argv[0] (looked up in PATH unless it holds a '/') to completion with stdout and stderr captured. Fails only
// when it cannot be started ("fio: not found in PATH").
Result<ChildRun> run_child(const std::vector<std::string>& argv);
// The same, failing when the child exits other than 0 (the message ends with the last lines it printed).
Result<ChildRun> run_child_ok(const std::vector<std::string>& argv);
// The last few lines of a child's output, for error messages.
std::string last_lines(const std::string& text);

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

}  // namespace trestle::cli
