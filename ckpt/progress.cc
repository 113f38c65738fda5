#include "ckpt/progress.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>

#include "ckpt/byte_size.h"

namespace trestle {
namespace {

std::mutex sink_owner;  // held by the ScopedProgressSink in force
ProgressSink installed_sink;
std::mutex check_owner;  // held by the ScopedCancelCheck in force
CancelCheck installed_check;
std::atomic<bool> cancel_asked{false};

}  // namespace

ScopedCancelCheck::ScopedCancelCheck(CancelCheck check) {
  check_owner.lock();
  installed_check = std::move(check);
  cancel_asked = false;
}

ScopedCancelCheck::~ScopedCancelCheck() {
  installed_check = nullptr;
  cancel_asked = false;
  check_owner.unlock();
}

void cancel() { cancel_asked = true; }

Status cancelled() { return cancel_asked ? Status::Error("cancelled") : OkStatus(); }

ScopedProgressSink::ScopedProgressSink(ProgressSink sink) {
  sink_owner.lock();
  installed_sink = std::move(sink);
}

ScopedProgressSink::~ScopedProgressSink() {
  installed_sink = nullptr;
  sink_owner.unlock();
}

Progress::Progress(std::string label, std::uint64_t total_bytes, bool enabled)
    : label_(std::move(label)), total_(total_bytes), enabled_(enabled), tty_(::isatty(STDERR_FILENO) != 0) {}

Status Progress::advance(std::uint64_t bytes) {
  done_ += bytes;
  const auto now = std::chrono::steady_clock::now();
  if (installed_check && !cancel_asked && now - last_check_ >= std::chrono::milliseconds(100)) {
    last_check_ = now;
    if (installed_check()) cancel();
  }
  if (Status stopped = cancelled(); !stopped.ok()) return stopped.with_context(label_);
  if (!enabled_) return OkStatus();
  if (installed_sink) {
    if (now - last_sink_ < std::chrono::milliseconds(100)) return OkStatus();
    last_sink_ = now;
    installed_sink(label_, done_, total_, false);
    return cancelled().with_context(label_);  // the sink may have cancelled
  }
  if (tty_) {
    if (now - last_draw_ < std::chrono::milliseconds(100)) return OkStatus();
    last_draw_ = now;
    draw(false);
    return OkStatus();
  }
  const int decile = total_ ? static_cast<int>(done_ * 10 / total_) : 10;
  if (decile != last_decile_ && decile < 10) {
    last_decile_ = decile;
    draw(false);
  }
  return OkStatus();
}

void Progress::finish() {
  if (!enabled_) return;
  if (installed_sink) installed_sink(label_, done_, total_, true);
  else draw(true);
}

void Progress::draw(bool final) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = seconds > 0 ? static_cast<double>(done_) / seconds / 1e9 : 0.0;
  const double fraction = total_ ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::fprintf(stderr, "\r%s [%.*s%*s] %3.0f%%  %s  %.2f GB/s%s", label_.c_str(), filled,
                 "##############################", kWidth - filled, "", fraction * 100, format_bytes(done_).c_str(),
                 rate, final ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s: %3.0f%%  %s of %s  %.1f s  %.2f GB/s\n", label_.c_str(), fraction * 100,
                 format_bytes(done_).c_str(), format_bytes(total_).c_str(), seconds, rate);
  }
  std::fflush(stderr);
}

}  // namespace trestle
