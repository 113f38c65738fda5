#include "tools/isolated_run.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <new>
#include <optional>
#include <string>

namespace trestle::cli {
namespace {

constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP};
volatile sig_atomic_t forward_to = 0;  // the child's pid while one runs

void forward_signal(int signal) {
  const int saved = errno;
  if (forward_to > 0) ::kill(static_cast<pid_t>(forward_to), signal);
  errno = saved;
}

// Passes SIGINT, SIGTERM and SIGHUP on to `child` while it lives, for the signals whose action is the default here.
class ForwardedSignals {
 public:
  explicit ForwardedSignals(pid_t child) {
    forward_to = child;
    for (std::size_t i = 0; i < std::size(kForwarded); ++i) {
      struct sigaction current {};
      if (::sigaction(kForwarded[i], nullptr, &current) != 0 || current.sa_handler != SIG_DFL) continue;
      struct sigaction forward {};
      forward.sa_handler = forward_signal;
      sigemptyset(&forward.sa_mask);
      installed_[i] = ::sigaction(kForwarded[i], &forward, &previous_[i]) == 0;
    }
  }
  ~ForwardedSignals() {
    for (std::size_t i = 0; i < std::size(kForwarded); ++i)
      if (installed_[i]) ::sigaction(kForwarded[i], &previous_[i], nullptr);
    forward_to = 0;
  }
  ForwardedSignals(const ForwardedSignals&) = delete;
  ForwardedSignals& operator=(const ForwardedSignals&) = delete;

 private:
  bool installed_[std::size(kForwarded)] = {};
  struct sigaction previous_[std::size(kForwarded)] = {};
};

}  // namespace

Outcome run_isolated(const std::function<Outcome()>& work, const std::function<Outcome(int signal)>& on_fault,
                     const std::function<void(int signal)>& after_kill) {
  int message_pipe[2];
  if (::pipe2(message_pipe, O_CLOEXEC) != 0)
    return {kExitFailure, std::string("cannot create a pipe: ") + std::strerror(errno)};
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) {
    const int err = errno;
    ::close(message_pipe[0]);
    ::close(message_pipe[1]);
    return {kExitFailure, std::string("cannot start a process: ") + std::strerror(err)};
  }
  if (child == 0) {
    ::close(message_pipe[0]);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(kExitFailure);  // (the parent died before the line above)
    Outcome outcome;
    try {
      outcome = work();
    } catch (const std::bad_alloc&) {
      outcome = {kExitFailure, "out of memory (an allocation failed)"};
    } catch (const std::exception& e) {
      outcome = {kExitFailure, e.what()};
    }
    std::fflush(stdout);
    std::fflush(stderr);
    for (std::size_t at = 0; at < outcome.message.size();) {
      const ssize_t n = ::write(message_pipe[1], outcome.message.data() + at, outcome.message.size() - at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      at += static_cast<std::size_t>(n);
    }
    ::_exit(outcome.code);
  }
  ::close(message_pipe[1]);
  std::optional<ForwardedSignals> forwarded(std::in_place, child);
  std::string message;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(message_pipe[0], buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    message.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(message_pipe[0]);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0) {
    if (errno != EINTR)
      return {kExitFailure, std::string("cannot wait for the work's process: ") + std::strerror(errno)};
  }
  forwarded.reset();
  if (WIFSIGNALED(status)) {
    const int signal = WTERMSIG(status);
    if (signal == SIGSEGV || signal == SIGBUS || signal == SIGILL || signal == SIGFPE || signal == SIGABRT ||
        signal == SIGSYS)
      return on_fault(signal);
    // Killed from outside (SIGKILL by the OOM killer or a user, SIGTERM, SIGINT): so is this process, as if the
    // work had run in it, once `after_kill` has removed what the work began.
    if (after_kill) after_kill(signal);
    std::signal(signal, SIG_DFL);
    ::kill(::getpid(), signal);
    ::pause();
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : kExitFailure, message};
}

}  // namespace trestle::cli
