// Figures from repeated benchmark runs and how they are reported: GB/s (10^9 bytes per second), best and median,
// ratios, the machine they were taken on, and the JSON file that keeps every measured figure.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::cli {

// The timings of one operation by one contender, one per round, with the bytes each moved.
class Samples {
 public:
  void add(double seconds, std::uint64_t bytes);
  // A figure measured by someone else (fio) as a rate only.
  void add_rate(double bytes_per_s) { rates_.push_back(bytes_per_s / 1e9); }
  bool empty() const { return rates_.empty(); }
  double best() const;             // GB/s; 0 when empty
  double median() const;           // GB/s; 0 when empty
  nlohmann::json to_json() const;  // {"gb_per_s": [...], "seconds": [...], "best": x, "median": y}

 private:
  std::vector<double> rates_;
  std::vector<double> seconds_;
};

class Stopwatch {
 public:
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// "1.23", or "1.23 / 1.10" (best / median) when with_median; "-" when empty.
std::string format_rate(const Samples& samples, bool with_median);
// "0.95x" for a / b, "-" when either is missing.
std::string format_ratio(double a, double b);

// nproc, total RAM, kernel and CPU model, for the JSON report.
nlohmann::json machine_facts();
Status write_json_file(const std::string& path, const nlohmann::json& report);
// Before a benchmark runs: whether write_json_file could write `path` (its folder exists and is writable, and the file,
// if there, is a writable file), so that a long run does not end unable to keep its figures. Empty: no report, ok.
Status check_report_writable(const std::string& path);

// One line on stderr, prefixed "[bench] ", for progress while a benchmark runs.
void progress(const std::string& line);

}  // namespace trestle::cli
