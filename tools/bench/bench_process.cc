#include "tools/bench/bench_process.h"

#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "tools/bench/bench_report.h"

extern char** environ;

namespace trestle::cli {
namespace {

struct Pipe {
  int read = -1;
  int write = -1;
};

Result<Pipe> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::Error(std::string("cannot create a pipe: ") + std::strerror(errno));
  return Pipe{fds[0], fds[1]};
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// A child's ru_maxrss starts from the peak of the memory it was spawned from (Linux keeps the old mm's high-water
// mark across exec, and posix_spawn shares ours until then), so this process's peak (the generated model it wrote,
// say) would be charged to every child. Writing 5 to clear_refs resets our peak to our current RSS first, and that
// RSS is first made small: freed memory glibc still holds (378 MiB after generating a 1.5 GiB model, which every
// child's peak then read as its own) goes back to the system.
void reset_peak_rss() {
  malloc_trim(0);
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return;
  [[maybe_unused]] const ssize_t n = ::write(fd, "5", 1);
  ::close(fd);
}

// Starts argv with the given descriptors as its stdin/stdout/stderr (-1: inherit ours).
Result<pid_t> spawn(const std::vector<std::string>& argv, int in, int out, int err) {
  reset_peak_rss();
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (in >= 0) posix_spawn_file_actions_adddup2(&actions, in, STDIN_FILENO);
  if (out >= 0) posix_spawn_file_actions_adddup2(&actions, out, STDOUT_FILENO);
  if (err >= 0) posix_spawn_file_actions_adddup2(&actions, err, STDERR_FILENO);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc == ENOENT) return Status::Error(argv[0] + ": not found in PATH");
  if (rc != 0) return Status::Error(argv[0] + ": cannot start: " + std::strerror(rc));
  return pid;
}

// Waits for pid; its own peak RSS goes to *peak_rss when given.
int wait_exit_code(pid_t pid, std::uint64_t* peak_rss = nullptr) {
  int status = 0;
  struct rusage usage {};
  while (::wait4(pid, &status, 0, &usage) < 0 && errno == EINTR) {
  }
  if (peak_rss != nullptr) *peak_rss = static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

// A "<field>: N kB" line of /proc/<pid>/status in bytes (0 when unreadable: the process is gone).
std::uint64_t status_kb_field(const std::string& pid, const char* field) {
  std::ifstream in("/proc/" + pid + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with(field)) return std::strtoull(line.c_str() + std::strlen(field), nullptr, 10) * 1024;
  return 0;
}

// Reads both pipes until each reaches end of file, so a chatty stderr cannot block the child; meanwhile samples the
// child's VmHWM (its own mm's high-water mark) into *hwm.
void drain(int out_fd, int err_fd, std::string& out, std::string& err, pid_t pid, std::uint64_t* hwm) {
  pollfd fds[2] = {{out_fd, POLLIN, 0}, {err_fd, POLLIN, 0}};
  std::string* sinks[2] = {&out, &err};
  int open = 2;
  char buf[65536];
  const std::string id = std::to_string(pid);
  while (open > 0) {
    *hwm = std::max(*hwm, status_kb_field(id, "VmHWM:"));
    if (::poll(fds, 2, 10) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        fds[i].fd = -1;
        --open;
      } else {
        sinks[i]->append(buf, static_cast<std::size_t>(n));
      }
    }
  }
}

}  // namespace

Result<ChildRun> run_child(const std::vector<std::string>& argv) {
  Stopwatch clock;
  TRESTLE_ASSIGN_OR_RETURN(Pipe out, make_pipe());
  auto err = make_pipe();
  if (!err.ok()) {
    close_fd(out.read);
    close_fd(out.write);
    return err.status();
  }
  auto pid = spawn(argv, -1, out.write, err->write);
  const std::uint64_t floor = status_kb_field("self", "VmRSS:");  // where the child's ru_maxrss starts
  close_fd(out.write);
  close_fd(err->write);
  ChildRun result;
  std::uint64_t sampled = 0;
  if (pid.ok()) drain(out.read, err->read, result.out, result.err, *pid, &sampled);
  close_fd(out.read);
  close_fd(err->read);
  if (!pid.ok()) return pid.status();
  result.exit_code = wait_exit_code(*pid, &result.peak_rss);
  if (result.peak_rss <= floor + (std::uint64_t{4} << 20) && sampled > 0) result.peak_rss = sampled;
  result.seconds = clock.seconds();
  return result;
}

Result<ChildRun> run_child_ok(const std::vector<std::string>& argv) {
  TRESTLE_ASSIGN_OR_RETURN(ChildRun run, run_child(argv));
  if (run.exit_code != 0) {
    std::string command;
    for (const auto& a : argv) command += (command.empty() ? "" : " ") + a;
    return Status::Error(command + " failed (exit " + std::to_string(run.exit_code) +
                         "): " + last_lines(run.err + run.out));
  }
  return run;
}

std::string last_lines(const std::string& text) {
  const auto start = text.size() > 600 ? text.size() - 600 : 0;
  return text.substr(start);
}

Result<std::unique_ptr<PeerProcess>> PeerProcess::start(const std::vector<std::string>& argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a peer that dies must show up as an error from write(), not kill us
  TRESTLE_ASSIGN_OR_RETURN(Pipe to_child, make_pipe());
  auto from_child = make_pipe();
  if (!from_child.ok()) {
    close_fd(to_child.read);
    close_fd(to_child.write);
    return from_child.status();
  }
  auto pid = spawn(argv, to_child.read, from_child->write, -1);
  close_fd(to_child.read);
  close_fd(from_child->write);
  if (!pid.ok()) {
    close_fd(to_child.write);
    close_fd(from_child->read);
    return pid.status();
  }
  return std::unique_ptr<PeerProcess>(
      new PeerProcess(argv.size() > 1 ? argv[1] : argv[0], *pid, to_child.write, from_child->read));
}

PeerProcess::~PeerProcess() {
  close_fd(to_child_);
  close_fd(from_child_);
  (void)wait_exit_code(pid_);
}

std::string PeerProcess::exit_description() {
  close_fd(to_child_);
  const int code = wait_exit_code(pid_);
  pid_ = -1;
  return name_ + " exited with status " + std::to_string(code) + " (its messages are above)";
}

Result<std::string> PeerProcess::read_line() {
  for (;;) {
    const auto newline = buffered_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffered_.substr(0, newline);
      buffered_.erase(0, newline + 1);
      return line;
    }
    if (pid_ < 0) return Status::Error(name_ + " is no longer running");
    char buf[4096];
    const ssize_t n = ::read(from_child_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::Error(exit_description());
    buffered_.append(buf, static_cast<std::size_t>(n));
  }
}

Result<std::string> PeerProcess::request(const std::string& line) {
  const std::string message = line + "\n";
  std::size_t sent = 0;
  while (sent < message.size() && pid_ >= 0) {
    const ssize_t n = ::write(to_child_, message.data() + sent, message.size() - sent);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::Error(exit_description());
    sent += static_cast<std::size_t>(n);
  }
  return read_line();
}

}  // namespace trestle::cli
