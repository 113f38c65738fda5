#include "parallel/launcher.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "parallel/launch_environment.h"
#include "parallel/seconds_text.h"

extern char** environ;

namespace trestle::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// One worker's output stream: bytes are forwarded a whole line at a time, each line prefixed with the rank.
struct Stream {
  int fd = -1;
  std::FILE* out = nullptr;
  std::string pending;
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  Stream streams[2];
};

void emit(const std::string& prefix, std::FILE* out, std::string_view line) {
  std::fprintf(out, "%s%.*s\n", prefix.c_str(), static_cast<int>(line.size()), line.data());
  std::fflush(out);
}

// Forwards what is available; at end of stream flushes the partial last line and closes the fd.
void pump(Stream& stream, const std::string& prefix) {
  char buffer[65536];
  const ssize_t n = ::read(stream.fd, buffer, sizeof(buffer));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {
    if (!stream.pending.empty()) emit(prefix, stream.out, stream.pending);
    stream.pending.clear();
    ::close(stream.fd);
    stream.fd = -1;
    return;
  }
  stream.pending.append(buffer, static_cast<std::size_t>(n));
  std::size_t start = 0;
  for (std::size_t end; (end = stream.pending.find('\n', start)) != std::string::npos; start = end + 1)
    emit(prefix, stream.out, std::string_view(stream.pending).substr(start, end - start));
  stream.pending.erase(0, start);
}

// Where rank 0 finds the store's listening socket (kStoreListenFdVariable): the first descriptor after stderr.
constexpr int kStoreFdInWorker = 3;

std::vector<std::string> worker_environment(const LaunchOptions& options, int port, int rank) {
  std::vector<std::pair<std::string, std::string>> ours = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(options.nproc)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {std::string(kLauncherPidVariable), std::to_string(::getpid())}};
  if (rank == 0) ours.emplace_back(kStoreListenFdVariable, std::to_string(kStoreFdInWorker));
  // (Variables of an enclosing launch that would tell the workers another store's story.)
  const std::vector<std::string> dropped = {kStoreListenFdVariable, "TORCHELASTIC_USE_AGENT_STORE"};
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    bool replaced = false;
    for (const auto& [name, value] : ours) replaced = replaced || entry.substr(0, name.size() + 1) == name + "=";
    for (const auto& name : dropped) replaced = replaced || entry.substr(0, name.size() + 1) == name + "=";
    if (!replaced) env.emplace_back(entry);
  }
  for (const auto& [name, value] : ours) env.push_back(name + "=" + value);
  // As torchrun: without an explicit OMP_NUM_THREADS, the workers share the CPUs instead of each taking all of them.
  if (options.nproc > 1 && !std::getenv("OMP_NUM_THREADS")) {
    const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
    env.push_back("OMP_NUM_THREADS=" + std::to_string(std::max(1u, cpus / static_cast<unsigned>(options.nproc))));
  }
  return env;
}

// The job's store port, bound and listening on every interface (as c10d's TCPStore server binds: IPv6 with IPv4
// mapped, else IPv4) before any worker starts, so that no other process can take it between being chosen and being
// served; rank 0 serves the store on this socket. Returns the descriptor (close-on-exec) and the port.
Result<std::pair<int, int>> bind_store_port(int port) {
  auto failed = [port](const std::string& what) {
    return Status::Error("the launcher cannot bind the job's c10d store port " + std::to_string(port) + ": " + what +
                         ": " + std::strerror(errno));
  };
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1, zero = 0;
  if (fd >= 0) {
    sockaddr_in6 address{};
    address.sin6_family = AF_INET6;
    address.sin6_addr = in6addr_any;
    address.sin6_port = htons(static_cast<std::uint16_t>(port));
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
      if (errno == EADDRINUSE) {
        const Status s = failed("bind");
        ::close(fd);
        return s;
      }
      ::close(fd);  // no IPv6 here: IPv4
      fd = -1;
    }
  }
  if (fd < 0) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return failed("socket");
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_ANY);
    address.sin_port = htons(static_cast<std::uint16_t>(port));
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
      const Status s = failed("bind");
      ::close(fd);
      return s;
    }
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::listen(fd, SOMAXCONN) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    const Status s = failed("listen");
    ::close(fd);
    return s;
  }
  const int chosen = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                 : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return std::pair<int, int>{fd, chosen};
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Starts `worker`; rank 0 gets the store's listening socket `store_fd` as kStoreFdInWorker.
Status spawn(const std::vector<std::string>& command, const LaunchOptions& options, int port, int store_fd,
             Worker& worker) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return Status::Error(std::string("pipe: ") + std::strerror(errno));
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    return Status::Error(std::string("pipe: ") + std::strerror(errno));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);
  if (worker.rank == 0) posix_spawn_file_actions_adddup2(&actions, store_fd, kStoreFdInWorker);
  std::vector<std::string> args = command;
  std::vector<std::string> env = worker_environment(options, port, worker.rank);
  const int error =
      posix_spawn(&worker.pid, args[0].c_str(), &actions, nullptr, pointers(args).data(), pointers(env).data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  ::close(err[1]);
  if (error != 0) {
    ::close(out[0]);
    ::close(err[0]);
    return Status::Error("cannot start rank " + std::to_string(worker.rank) + " (" + args[0] +
                         "): " + std::strerror(error));
  }
  worker.running = true;
  worker.streams[0] = Stream{out[0], stdout, {}};
  worker.streams[1] = Stream{err[0], stderr, {}};
  return OkStatus();
}

// SIGINT or SIGTERM sent to the launcher alone (not its process group): passed on to the workers by the main loop.
volatile std::sig_atomic_t launcher_signal = 0;
extern "C" void note_launcher_signal(int sig) { launcher_signal = sig; }

void signal_running(std::vector<Worker>& workers, int sig) {
  for (auto& w : workers)
    if (w.running) ::kill(w.pid, sig);
}

}  // namespace

ExitSignalRequests::Action ExitSignalRequests::receive(Clock::time_point now) {
  if (!first_) {
    first_ = now;
    return Action::kForward;
  }
  return now - *first_ < same_request_ ? Action::kSameRequest : Action::kStartDeadline;
}

Status die_with_launcher() {
  const char* launcher = std::getenv(kLauncherPidVariable);
  if (!launcher && std::getenv("TORCHELASTIC_RUN_ID") && std::getenv("RANK")) {
    // A worker of torchrun's agent (its parent): killed with it too, so that an agent killed outright leaves no
    // workers training on, holding the save lock.
    const std::string agent = std::to_string(::getppid());
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
      return Status::Error(std::string("cannot tie this worker to its torchrun agent: ") + std::strerror(errno));
    if (std::to_string(::getppid()) != agent)
      return Status::Error("the torchrun agent (pid " + agent + ") has exited; this worker stops");
    return OkStatus();
  }
  if (!launcher) return OkStatus();
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0)
    return Status::Error(std::string("cannot tie this worker to its launcher: ") + std::strerror(errno));
  // The launcher may have died before the call above: then this process already has another parent.
  if (std::to_string(::getppid()) != launcher)
    return Status::Error(std::string("the launcher (pid ") + launcher + ") has exited; this worker stops");
  return OkStatus();
}

std::vector<std::string> remove_options(const std::vector<std::string>& arguments,
                                        const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < arguments.size(); ++i) {
    bool drop = false;
    for (const auto& name : names) {
      if (arguments[i] == name) {
        drop = true;
        ++i;  // its value
        break;
      }
      if (arguments[i].rfind(name + "=", 0) == 0) drop = true;
    }
    if (!drop) out.push_back(arguments[i]);
  }
  return out;
}

Result<LaunchOutcome> launch_local_workers(const std::vector<std::string>& command, const LaunchOptions& options) {
  if (command.empty()) return Status::Error("no worker command");
  if (options.nproc < 1)
    return Status::Error("--nproc-per-node must be at least 1, not " + std::to_string(options.nproc));
  // The launcher binds the store's port and rank 0 serves the store on it (the launcher itself loads no LibTorch:
  // that is half a second of start-up): the port is bound before any worker starts, so no other process can take it
  // between being chosen and being served, and the workers' clients wait in its backlog until rank 0 answers.
  TRESTLE_ASSIGN_OR_RETURN(const auto bound, bind_store_port(options.master_port));
  const auto [store_fd, port] = bound;

  std::vector<Worker> workers(static_cast<std::size_t>(options.nproc));
  for (int rank = 0; rank < options.nproc; ++rank) {
    Worker& worker = workers[static_cast<std::size_t>(rank)];
    worker.rank = rank;
    if (Status s = spawn(command, options, port, store_fd, worker); !s.ok()) {
      ::close(store_fd);
      signal_running(workers, SIGKILL);
      for (auto& w : workers)
        if (w.running) ::waitpid(w.pid, nullptr, 0);
      return s;
    }
  }
  ::close(store_fd);  // rank 0 holds it now

  LaunchOutcome outcome;
  constexpr Clock::time_point kNever = Clock::time_point::max();
  Clock::time_point kill_at = kNever;  // SIGKILL for the workers still running after a failure
  Clock::time_point all_exited_at = kNever;
  ExitSignalRequests requests;
  Clock::time_point repeat_kill_at = kNever;  // SIGKILL for the workers still saving after a repeated exit signal
  int repeated_signal = 0;
  launcher_signal = 0;
  struct sigaction action {
  }, old_int{}, old_term{}, old_extra{};
  action.sa_handler = note_launcher_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, &old_int);
  ::sigaction(SIGTERM, &action, &old_term);
  const bool extra = options.forward_signals && options.exit_signal != SIGINT && options.exit_signal != SIGTERM;
  if (extra) ::sigaction(options.exit_signal, &action, &old_extra);
  for (;;) {
    if (const int sig = launcher_signal; sig != 0 && options.forward_signals) {
      launcher_signal = 0;
      switch (requests.receive(Clock::now())) {
        case ExitSignalRequests::Action::kForward:
          std::fprintf(stderr,
                       "trestle launcher: received signal %d (%s); passed on to the workers, which save and exit\n",
                       sig, strsignal(sig));
          signal_running(workers, sig);
          break;
        case ExitSignalRequests::Action::kSameRequest:
          std::fprintf(stderr,
                       "trestle launcher: received signal %d (%s) again right after the first: the same "
                       "request; still waiting for the workers\n",
                       sig, strsignal(sig));
          break;
        case ExitSignalRequests::Action::kStartDeadline:
          if (repeat_kill_at == kNever) {
            repeated_signal = sig;
            repeat_kill_at = Clock::now() + options.exit_signal_grace;
            std::fprintf(stderr,
                         "trestle launcher: received signal %d (%s) again; the workers get %s to finish their save "
                         "before they are killed (--exit-signal-grace)\n",
                         sig, strsignal(sig), seconds_text(options.exit_signal_grace).c_str());
          }
          break;
      }
      std::fflush(stderr);
    }
    if (const int sig = launcher_signal; sig != 0 && !options.forward_signals && outcome.failure.empty()) {
      outcome.exit_code = 128 + sig;
      outcome.failure =
          std::string("the launcher received signal ") + std::to_string(sig) + " (" + strsignal(sig) + ")";
      signal_running(workers, SIGTERM);
      kill_at = Clock::now() + options.grace;
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, Stream*>> owners;
    for (auto& w : workers)
      for (auto& s : w.streams)
        if (s.fd >= 0) {
          fds.push_back(pollfd{s.fd, POLLIN, 0});
          owners.emplace_back(&w, &s);
        }
    const bool any_running = std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.running; });
    // Output still buffered in pipes held open by a worker's own children gets one second after the workers exit.
    if (!any_running && (fds.empty() || Clock::now() - all_exited_at > std::chrono::seconds(1))) break;
    if (!fds.empty()) {
      ::poll(fds.data(), fds.size(), 100);
    } else {  // the workers' pipes are closed and they are about to exit: their exit is a few milliseconds away
      ::usleep(5 * 1000);
    }
    for (std::size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
        pump(*owners[i].second, "[rank " + std::to_string(owners[i].first->rank) + "] ");

    // Of the workers that ended since the last sweep, one killed by a signal is the cause rather than the peers that
    // failed on losing it; otherwise the lowest failed rank is reported.
    const Worker* first = nullptr;
    int first_status = 0;
    for (auto& w : workers) {
      if (!w.running) continue;
      int status = 0;
      if (::waitpid(w.pid, &status, WNOHANG) != w.pid) continue;
      w.running = false;
      const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (failed && (!first || (WIFSIGNALED(status) && !WIFSIGNALED(first_status)))) {
        first = &w;
        first_status = status;
      }
    }
    if (first && outcome.failure.empty()) {
      if (WIFSIGNALED(first_status)) {
        const int sig = WTERMSIG(first_status);
        outcome.exit_code = 128 + sig;
        outcome.failure = "rank " + std::to_string(first->rank) + " exited with signal " + std::to_string(sig) + " (" +
                          strsignal(sig) + ")";
      } else {
        outcome.exit_code = WEXITSTATUS(first_status);
        outcome.failure =
            "rank " + std::to_string(first->rank) + " exited with code " + std::to_string(outcome.exit_code);
      }
      std::fprintf(stderr, "trestle launcher: %s; terminating the other workers\n", outcome.failure.c_str());
      std::fflush(stderr);
      signal_running(workers, SIGTERM);
      kill_at = Clock::now() + options.grace;
    }
    if (Clock::now() >= repeat_kill_at) {
      repeat_kill_at = kNever;
      if (std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.running; })) {
        const std::string late = "workers did not finish within " + seconds_text(options.exit_signal_grace) +
                                 " after the second signal: killing them";
        std::fprintf(stderr, "trestle launcher: %s\n", late.c_str());
        std::fflush(stderr);
        if (outcome.failure.empty()) {
          outcome.exit_code = 128 + repeated_signal;
          outcome.failure = late;
        }
        signal_running(workers, SIGKILL);
      }
    }
    if (Clock::now() >= kill_at) {
      signal_running(workers, SIGKILL);
      kill_at = kNever;
    }
    if (all_exited_at == kNever &&
        std::none_of(workers.begin(), workers.end(), [](const Worker& w) { return w.running; }))
      all_exited_at = Clock::now();
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  if (extra) ::sigaction(options.exit_signal, &old_extra, nullptr);
  for (auto& w : workers)
    for (auto& s : w.streams)
      if (s.fd >= 0) ::close(s.fd);
  return outcome;
}

}  // namespace trestle::parallel
