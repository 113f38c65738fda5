// Progress of a long operation on stderr: a redrawn bar on a terminal, a plain line every 10% otherwise; or, while a
// ProgressSink is installed (the Python package's callbacks), to that sink instead, at most every 100 ms and at the
// end. A Progress is not thread-safe: one thread reports. Its advance is also where a cancellation is noticed.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "ckpt/status.h"

namespace trestle {

// Receives (label, bytes done, bytes in all, finished) in place of the stderr lines, from the reporting thread.
using ProgressSink = std::function<void(const std::string& label, std::uint64_t done, std::uint64_t total, bool final)>;

// Installs `sink` for the Progress objects of the whole process while it lives (one at a time: a second waits).
class ScopedProgressSink {
 public:
  explicit ScopedProgressSink(ProgressSink sink);
  ~ScopedProgressSink();
  ScopedProgressSink(const ScopedProgressSink&) = delete;
  ScopedProgressSink& operator=(const ScopedProgressSink&) = delete;
};

// Cooperative cancellation (the Python package's Ctrl-C and raising callbacks): while a ScopedCancelCheck is installed,
// Progress::advance asks it, at most every 100 ms, whether to stop; once it or cancel() says so, Progress::advance and
// cancelled() fail until the check is removed. The operations return that error as any other (nothing half-written).
using CancelCheck = std::function<bool()>;  // true: stop

class ScopedCancelCheck {
 public:
  explicit ScopedCancelCheck(CancelCheck check);
  ~ScopedCancelCheck();
  ScopedCancelCheck(const ScopedCancelCheck&) = delete;
  ScopedCancelCheck& operator=(const ScopedCancelCheck&) = delete;
};

void cancel();       // from any thread: the operation in progress stops at its next check
Status cancelled();  // ok unless cancellation was asked for; cheap enough to call per piece of work

class Progress {
 public:
  Progress(std::string label, std::uint64_t total_bytes, bool enabled = true);
  Status advance(std::uint64_t bytes);  // fails once the operation is cancelled
  void finish();  // final line with the elapsed time and rate

 private:
  void draw(bool final);
  std::string label_;
  std::uint64_t total_;
  std::uint64_t done_ = 0;
  bool enabled_;
  bool tty_;
  int last_decile_ = -1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_draw_{};
  std::chrono::steady_clock::time_point last_sink_{};
  std::chrono::steady_clock::time_point last_check_{};
};

}  // namespace trestle
