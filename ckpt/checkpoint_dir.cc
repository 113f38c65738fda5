#include "ckpt/checkpoint_dir.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "ckpt/atomic_file.h"

namespace trestle {
namespace fs = std::filesystem;

std::string iteration_dir_name(std::int64_t iteration) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "iter_%07lld", static_cast<long long>(iteration));
  return buf;
}

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank_%05d.bin", rank);
  return buf;
}

Result<std::optional<std::int64_t>> read_latest_iteration(const std::string& root) {
  const std::string path = root + "/" + kTrackerFile;
  std::ifstream in(path);
  if (!in) return std::optional<std::int64_t>();
  std::string text;
  std::getline(in, text);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\r')) text.pop_back();
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value < 0)
    return Status::Error(path + ": expected an iteration number, found '" + text + "'");
  return std::optional<std::int64_t>(value);
}

std::vector<std::int64_t> list_iterations(const std::string& root) {
  std::vector<std::int64_t> out;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    std::error_code type_ec;
    if (!it->is_directory(type_ec) || !name.starts_with("iter_") ||
        !fs::is_regular_file(it->path() / kManifestFile, type_ec))
      continue;
    char* rest = nullptr;
    const long long value = std::strtoll(name.c_str() + 5, &rest, 10);
    if (*rest == '\0') out.push_back(value);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<std::string> resolve_iteration_dir(const std::string& root, std::optional<std::int64_t> iteration) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return Status::Error(root + ": no such checkpoint directory");
  if (!iteration) {
    TRESTLE_ASSIGN_OR_RETURN(iteration, read_latest_iteration(root));
    if (!iteration) return Status::Error(root + ": no " + kTrackerFile + " (no committed checkpoint here)");
  }
  const std::string dir = root + "/" + iteration_dir_name(*iteration);
  if (!fs::exists(fs::path(dir) / kManifestFile, ec)) {
    std::string have;
    for (auto i : list_iterations(root)) have += (have.empty() ? "" : ", ") + std::to_string(i);
    return Status::Error(dir + ": iteration " + std::to_string(*iteration) + " is not a committed checkpoint" +
                         (have.empty() ? "" : " (committed: " + have + ")"));
  }
  return dir;
}

Result<std::string> begin_iteration(const std::string& root, std::int64_t iteration, const std::string& save_id) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return Status::Error(root + ": cannot create checkpoint directory: " + ec.message());
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    std::error_code remove_ec;
    if (it->is_directory(remove_ec) && (name.starts_with(".tmp.iter_") || name.starts_with(".old.iter_")))
      fs::remove_all(it->path(), remove_ec);
  }
  ec.clear();
  const std::string temp = root + "/.tmp." + iteration_dir_name(iteration) + "." + save_id;
  fs::create_directory(temp, ec);
  if (ec) return Status::Error(temp + ": cannot create: " + ec.message());
  return temp;
}

Status commit_iteration(const std::string& root, const std::string& temp_dir, const Manifest& manifest,
                        bool overwrite) {
  TRESTLE_RETURN_IF_ERROR(write_file_atomically(temp_dir + "/" + kManifestFile, to_json(manifest).dump(1) + "\n"));
  TRESTLE_RETURN_IF_ERROR(fsync_directory(temp_dir));
  const std::string final_dir = root + "/" + iteration_dir_name(manifest.iteration);
  std::string aside;
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    if (!overwrite)
      return Status::Error(final_dir + ": iteration " + std::to_string(manifest.iteration) +
                           " already exists (the new save is left in " + temp_dir + ")");
    aside = root + "/.old." + iteration_dir_name(manifest.iteration) + "." +
            fs::path(temp_dir).extension().string().substr(1);
    fs::rename(final_dir, aside, ec);
    if (ec) return Status::Error(final_dir + ": cannot move aside: " + ec.message());
  }
  TRESTLE_RETURN_IF_ERROR(commit_rename(temp_dir, final_dir));
  TRESTLE_RETURN_IF_ERROR(write_file_atomically(root + "/" + kTrackerFile, std::to_string(manifest.iteration) + "\n"));
  if (!aside.empty()) fs::remove_all(aside, ec);
  return OkStatus();
}

}  // namespace trestle
