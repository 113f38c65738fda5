// The disk's ceiling as DESIGN.md ("Performance model") defines it: fio with O_DIRECT, 1 MiB requests, the io_uring
// engine and queue depth 32, writing then reading one file of the benchmark's size in the benchmark's directory.
#pragma once

#include <cstdint>
#include <string>

#include "ckpt/status.h"

namespace trestle::cli {

struct FioJob {
  std::string file;
  std::uint64_t bytes = 0;
  std::string rw = "write";  // fio's --rw: write, read, randread, ...
  std::uint64_t block_bytes = std::uint64_t{1} << 20;
  unsigned iodepth = 32;
};

// fio's version ("fio-3.33"), or an error saying how to get it or skip it.
Result<std::string> fio_version();
// Runs one fio job and returns its bandwidth in bytes per second (fio's bw_bytes for the job's direction).
Result<double> run_fio(const FioJob& job);

struct FioCeiling {
  double write_bytes_per_s = 0;
  double read_bytes_per_s = 0;
};

// Writes `file` (bytes long) with fio, reads it back, then removes it.
Result<FioCeiling> measure_fio_ceiling(const std::string& file, std::uint64_t bytes);

}  // namespace trestle::cli
