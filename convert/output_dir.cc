#include "convert/output_dir.h"

#include <filesystem>

namespace trestle {

Status check_new_destination(const std::string& dst) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dst, ec) && (!fs::is_directory(dst, ec) || !fs::is_empty(dst, ec)))
    return Status::Error(dst + ": destination exists and is not an empty directory; choose a new path");
  return OkStatus();
}

}  // namespace trestle
