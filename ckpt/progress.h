// Progress of a long operation on stderr: a redrawn bar on a terminal, a plain line every 10% otherwise.
// Not thread-safe: one thread reports.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace trestle {

class Progress {
 public:
  Progress(std::string label, std::uint64_t total_bytes, bool enabled = true);
  void advance(std::uint64_t bytes);
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
};

}  // namespace trestle
