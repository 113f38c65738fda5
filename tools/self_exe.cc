#include "tools/self_exe.h"

#include <filesystem>
#include <system_error>

namespace trestle::cli {

Result<std::string> self_exe() {
  std::error_code ec;
  const auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return Status::Error("/proc/self/exe: cannot find the running executable: " + ec.message());
  return path.string();
}

Result<std::string> self_exe_dir() {
  TRESTLE_ASSIGN_OR_RETURN(const std::string exe, self_exe());
  return std::filesystem::path(exe).parent_path().string();
}

}  // namespace trestle::cli
