#include "tools/bench/bench_fio.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "tools/bench/bench_process.h"

namespace trestle::cli {
namespace {

constexpr const char* kHowToSkip = "install fio (apt-get install fio) or pass --no-fio";

Result<double> parse_bandwidth(const std::string& output, const std::string& direction) {
  // fio can print notes before the report; the JSON starts at the first brace.
  const auto start = output.find('{');
  const auto report = nlohmann::json::parse(start == std::string::npos ? "" : output.substr(start), nullptr, false);
  if (report.is_discarded() || !report.contains("jobs") || report["jobs"].empty())
    return Status::Error("fio printed no JSON report: " + last_lines(output));
  const auto& job = report["jobs"][0];
  if (job.value("error", 0) != 0) return Status::Error("fio job failed with error " + job["error"].dump());
  if (!job.contains(direction) || !job[direction].contains("bw_bytes"))
    return Status::Error("fio's report has no " + direction + ".bw_bytes");
  const double bw = job[direction]["bw_bytes"].get<double>();
  if (bw <= 0) return Status::Error("fio reports no " + direction + " bandwidth");
  return bw;
}

}  // namespace

Result<std::string> fio_version() {
  auto run = run_child({"fio", "--version"});
  if (!run.ok()) return Status::Error(run.status().message() + "; " + kHowToSkip);
  if (run->exit_code != 0) return Status::Error("fio --version failed: " + last_lines(run->err) + "; " + kHowToSkip);
  std::string version = run->out;
  while (!version.empty() && (version.back() == '\n' || version.back() == ' ')) version.pop_back();
  return version;
}

Result<double> run_fio(const FioJob& job) {
  const std::vector<std::string> argv = {"fio",
                                         "--name=trestle-bench",
                                         "--filename=" + job.file,
                                         "--size=" + std::to_string(job.bytes),
                                         "--bs=" + std::to_string(job.block_bytes),
                                         "--ioengine=io_uring",
                                         "--direct=1",
                                         "--iodepth=" + std::to_string(job.iodepth),
                                         "--rw=" + job.rw,
                                         "--output-format=json"};
  auto run = run_child(argv);
  if (!run.ok()) return Status::Error(run.status().message() + "; " + kHowToSkip);
  if (run->exit_code != 0)
    return Status::Error("fio --rw=" + job.rw + " on " + job.file + " failed (exit " + std::to_string(run->exit_code) +
                         "): " + last_lines(run->err + run->out));
  const bool reads = job.rw.find("read") != std::string::npos;
  auto bw = parse_bandwidth(run->out, reads ? "read" : "write");
  if (!bw.ok()) return bw.status().with_context("fio --rw=" + job.rw + " on " + job.file);
  return bw;
}

Result<FioCeiling> measure_fio_ceiling(const std::string& file, std::uint64_t bytes) {
  auto ceiling = [&]() -> Result<FioCeiling> {
    TRESTLE_ASSIGN_OR_RETURN(const double write, run_fio({file, bytes, "write"}));
    TRESTLE_ASSIGN_OR_RETURN(const double read, run_fio({file, bytes, "read"}));
    return FioCeiling{write, read};
  }();
  ::unlink(file.c_str());
  return ceiling;
}

}  // namespace trestle::cli
