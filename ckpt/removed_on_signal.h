// Paths a process is writing and has not committed yet (a staging directory, its lock file, a temporary file) are
// removed when SIGINT, SIGTERM or SIGHUP ends the process, so an interrupted conversion, export or preprocess leaves
// nothing behind. For each of the three signals whose action is still the default (ending the process) when a path
// is registered, a handler is installed that removes every registered path (a directory with its contents) and then
// lets the same signal end the process. A signal the process handles itself (the trainer's --exit-signal-handler,
// Python's SIGINT) or ignores is left alone; so is a path beyond kMaxRemovedOnSignal at once (the next run's cleanup
// of abandoned staging removes it, as after SIGKILL). Paths are made absolute when registered, and only the process
// that registered a path removes it (a child forked without exec inherits the handler, not the paths).
#pragma once

#include <string>

namespace trestle {

inline constexpr int kMaxRemovedOnSignal = 64;

class RemovedOnSignal {
 public:
  RemovedOnSignal() = default;
  explicit RemovedOnSignal(const std::string& path);  // registers it (nothing if all slots are taken)
  // Unregisters the path (committed, removed or handed on: it is no longer this process's to remove).
  ~RemovedOnSignal() { release(); }
  RemovedOnSignal(RemovedOnSignal&& other) noexcept : slot_(other.slot_) { other.slot_ = -1; }
  RemovedOnSignal& operator=(RemovedOnSignal&& other) noexcept;
  RemovedOnSignal(const RemovedOnSignal&) = delete;
  RemovedOnSignal& operator=(const RemovedOnSignal&) = delete;

  bool registered() const { return slot_ >= 0; }
  void release();

 private:
  int slot_ = -1;
};

}  // namespace trestle
