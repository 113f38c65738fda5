#include "ckpt/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "ckpt/fault_point.h"

namespace trestle {
namespace {

Status errno_error(const std::string& path, const char* what) {
  return Status::Error(path + ": " + what + ": " + std::strerror(errno));
}

std::string parent_of(const std::string& path) {
  auto parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? "." : parent.string();
}

}  // namespace

std::string temporary_sibling(const std::string& path) {
  const std::filesystem::path p(path);
  return (p.parent_path() / ("." + p.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
}

void remove_dead_temporaries(const std::string& path) {
  const std::filesystem::path p(path);
  const std::filesystem::path parent = p.parent_path().empty() ? "." : p.parent_path();
  const std::string prefix = "." + p.filename().string() + ".tmp.";
  std::error_code ec;
  for (std::filesystem::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix)) continue;
    char* rest = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &rest, 10);
    if (*rest != '\0' || pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)) {
      std::error_code remove_ec;
      std::filesystem::remove(it->path(), remove_ec);
    }
  }
}

Status fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_error(dir, "cannot open directory");
  const int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0 ? OkStatus() : errno_error(dir, "cannot fsync directory");
}

Status commit_rename(const std::string& temp, const std::string& path, FaultPoints points,
                     const std::function<void()>& renamed) {
  const bool counted = points == FaultPoints::kCounted;
  if (counted) TRESTLE_RETURN_IF_ERROR(fault_point("rename", path));
  if (std::rename(temp.c_str(), path.c_str()) != 0) return errno_error(path, "cannot rename into place");
  if (renamed) renamed();
  if (counted) TRESTLE_RETURN_IF_ERROR(fault_point("fsync directory", parent_of(path)));
  return fsync_directory(parent_of(path));
}

Status write_file_atomically(const std::string& path, std::string_view content, FaultPoints points) {
  const std::string temp = temporary_sibling(path);
  // A fresh file: whatever is at the temporary's (predictable) name, a link included, is removed, never written
  // through.
  ::unlink(temp.c_str());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return errno_error(temp, "cannot create");
  std::size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, transfer_length(content.size() - done, fd));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Status error = n < 0 ? errno_error(temp, "cannot write")
                           : Status::Error(temp + ": cannot write: nothing written at byte " + std::to_string(done));
      ::close(fd);
      ::unlink(temp.c_str());
      return error;
    }
    done += static_cast<std::size_t>(n);
  }
  Status synced = points == FaultPoints::kCounted ? fault_point("fsync", temp) : OkStatus();
  if (synced.ok() && ::fsync(fd) != 0) synced = errno_error(temp, "cannot fsync");
  if (!synced.ok()) {
    ::close(fd);
    ::unlink(temp.c_str());
    return synced;
  }
  ::close(fd);
  Status renamed = commit_rename(temp, path, points);
  if (!renamed.ok()) ::unlink(temp.c_str());
  return renamed;
}

std::string set_aside_name(const std::string& path) { return path + ".trestle-old"; }

void remove_staged(const std::vector<StagedFile>& files) {
  for (const StagedFile& f : files) ::unlink(f.temp.c_str());
}

Status commit_renames(const std::vector<StagedFile>& files) {
  std::vector<const StagedFile*> aside, placed;
  auto sync_all = [&]() -> Status {
    std::vector<std::string> dirs;
    for (const StagedFile& f : files) dirs.push_back(parent_of(f.path));
    std::sort(dirs.begin(), dirs.end());
    dirs.erase(std::unique(dirs.begin(), dirs.end()), dirs.end());
    for (const std::string& dir : dirs) TRESTLE_RETURN_IF_ERROR(fsync_directory(dir));
    return OkStatus();
  };
  // Undoes what was done: the new files out, the old ones back, the temporaries gone.
  auto roll_back = [&](Status error) {
    for (const StagedFile* f : placed) ::unlink(f->path.c_str());
    for (const StagedFile* f : aside) std::rename(set_aside_name(f->path).c_str(), f->path.c_str());
    remove_staged(files);
    (void)sync_all();
    return error;
  };
  for (const StagedFile& f : files) {
    if (std::rename(f.path.c_str(), set_aside_name(f.path).c_str()) == 0) aside.push_back(&f);
    else if (errno != ENOENT) return roll_back(errno_error(f.path, "cannot set the old file aside"));
  }
  if (Status s = sync_all(); !s.ok()) return roll_back(s);
  for (const StagedFile& f : files) {
    if (std::rename(f.temp.c_str(), f.path.c_str()) != 0)
      return roll_back(errno_error(f.path, "cannot rename into place"));
    placed.push_back(&f);
  }
  if (Status s = sync_all(); !s.ok()) return roll_back(s);
  // Committed: the old files (and any an interrupted earlier commit left) go.
  for (const StagedFile& f : files) ::unlink(set_aside_name(f.path).c_str());
  return OkStatus();
}

}  // namespace trestle
