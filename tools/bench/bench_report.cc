#include "tools/bench/bench_report.h"

#include <sched.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace trestle::cli {

void Samples::add(double seconds, std::uint64_t bytes) {
  seconds_.push_back(seconds);
  rates_.push_back(seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0);
}

double Samples::best() const { return rates_.empty() ? 0.0 : *std::max_element(rates_.begin(), rates_.end()); }

double Samples::median() const {
  if (rates_.empty()) return 0.0;
  std::vector<double> sorted = rates_;
  std::sort(sorted.begin(), sorted.end());
  const std::size_t n = sorted.size();
  return n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

nlohmann::json Samples::to_json() const {
  nlohmann::json out = {{"gb_per_s", rates_}, {"best", best()}, {"median", median()}};
  if (!seconds_.empty()) out["seconds"] = seconds_;
  return out;
}

std::string format_rate(const Samples& samples, bool with_median) {
  if (samples.empty()) return "-";
  char buf[48];
  if (with_median) std::snprintf(buf, sizeof buf, "%.2f / %.2f", samples.best(), samples.median());
  else std::snprintf(buf, sizeof buf, "%.2f", samples.best());
  return buf;
}

std::string format_ratio(double a, double b) {
  if (a <= 0 || b <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", a / b);
  return buf;
}

namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      std::string model = line.substr(line.find(':') + 1);
      return model.substr(model.find_first_not_of(' '));
    }
  return "";
}

}  // namespace

nlohmann::json machine_facts() {
  utsname names{};
  (void)::uname(&names);
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_size = ::sysconf(_SC_PAGESIZE);
  cpu_set_t usable;
  CPU_ZERO(&usable);
  const int nproc = ::sched_getaffinity(0, sizeof usable, &usable) == 0 ? CPU_COUNT(&usable) : 0;
  return {{"nproc", nproc},
          {"online_cpus", ::sysconf(_SC_NPROCESSORS_ONLN)},
          {"total_ram_bytes", static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page_size)},
          {"kernel", std::string(names.release)},
          {"cpu", cpu_model()}};
}

Status check_report_writable(const std::string& path) {
  if (path.empty()) return OkStatus();
  namespace fs = std::filesystem;
  const fs::path file(path);
  const fs::path dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
  std::error_code error;
  const auto problem = [&](const std::string& why) {
    return Status::Error(path + ": cannot write the JSON report: " + why);
  };
  if (!fs::is_directory(dir, error)) return problem(dir.string() + " is not a folder");
  if (fs::is_directory(file, error)) return problem("it is a folder");
  if (fs::exists(file, error) ? ::access(path.c_str(), W_OK) != 0 : ::access(dir.c_str(), W_OK) != 0)
    return problem(std::string(std::strerror(errno)));
  return OkStatus();
}

Status write_json_file(const std::string& path, const nlohmann::json& report) {
  std::ofstream out(path);
  out << report.dump(2) << "\n";
  out.close();
  if (!out) return Status::Error(path + ": cannot write the JSON report");
  return OkStatus();
}

void progress(const std::string& line) { std::fprintf(stderr, "[bench] %s\n", line.c_str()); }

}  // namespace trestle::cli
