#include "ckpt/checkpoint_dir.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "ckpt/atomic_file.h"
#include "ckpt/fault_point.h"
#include "ckpt/json_file.h"
#include "ckpt/printable_text.h"
#include "ckpt/regular_file.h"

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

Result<std::int64_t> parse_tracker_iteration(std::string_view text, const std::string& path) {
  constexpr std::string_view kSpace = " \t\n\r\f\v";
  std::string_view number = text;
  number.remove_prefix(std::min(number.size(), number.find_first_not_of(kSpace)));
  number.remove_suffix(number.size() - (number.find_last_not_of(kSpace) + 1));
  std::string_view signed_digits = number;
  const bool negative = signed_digits.starts_with('-');
  if (signed_digits.starts_with('+') || negative) signed_digits.remove_prefix(1);
  // Python's int() also takes single underscores between digits ("1_000"), and "-0".
  std::string digits;
  bool grouped = !signed_digits.empty() && !signed_digits.starts_with('_') && !signed_digits.ends_with('_') &&
                 signed_digits.find("__") == std::string_view::npos;
  for (const char c : signed_digits)
    if (c != '_') digits += c;
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (grouped && !digits.empty() && std::isdigit(static_cast<unsigned char>(digits.front())) &&
      end == digits.data() + digits.size() && ec == std::errc() && !(negative && value != 0))
    return value;
  std::string quoted;  // on one line: "0\n1" shows as 0\n1
  for (const char c : text.substr(0, 64))
    quoted += c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : std::string(1, c);
  return Status::Error(path + ": expected one iteration number (0 or more), found '" + quoted +
                       (text.size() > 64 ? "...'" : "'") +
                       (ec == std::errc::result_out_of_range ? " (too large)" : ""));
}

Result<Tracker> read_tracker(const std::string& root) {
  const std::string path = root + "/" + kTrackerFile;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return Tracker{};
  TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link(path));
  // Megatron's trackers hold a few characters; a bigger file is no tracker, and is not read whole.
  constexpr std::uint64_t kMaxTrackerBytes = 4096;
  TRESTLE_ASSIGN_OR_RETURN(const std::string text, read_text_file(path, kMaxTrackerBytes));
  Tracker tracker{.present = true};
  constexpr std::string_view kSpace = " \t\n\r\f\v";
  const std::size_t first = text.find_first_not_of(kSpace);
  if (first != std::string::npos &&
      std::string_view(text).substr(first, text.find_last_not_of(kSpace) + 1 - first) == "release") {
    tracker.release = true;
    return tracker;
  }
  TRESTLE_ASSIGN_OR_RETURN(tracker.iteration, parse_tracker_iteration(text, path));
  return tracker;
}

std::string tracked_iteration_dir(const std::string& root, const Tracker& tracker) {
  return (fs::path(root) / (tracker.release ? std::string("release") : iteration_dir_name(tracker.iteration))).string();
}

namespace {

// Whether the lock's holder, "host H, pid P" as lock_save_root writes it, is a process of this host that is exiting
// (killed, its files not yet closed: SIGKILL'd workers tear down their I/O rings first) or already gone, so that its
// lock is about to be released.
bool holder_is_exiting(const std::string& who) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string prefix = "host " + printable_text(host) + ", pid ";
  if (!who.starts_with(prefix)) return false;
  const std::string pid = who.substr(prefix.size());
  if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) return false;
  std::ifstream stat("/proc/" + pid + "/stat");
  std::string text;
  if (!stat || !std::getline(stat, text)) return true;  // gone
  const std::size_t close = text.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream fields(text.substr(close + 1));
  std::string state;
  unsigned long long value = 0, flags = 0;
  fields >> state;
  for (int i = 0; i < 5 && fields >> value; ++i) {  // ppid, pgrp, session, tty_nr, tpgid
  }
  fields >> flags;
  constexpr unsigned long long kExiting = 0x4;  // PF_EXITING
  return state == "Z" || state == "X" || (fields && (flags & kExiting) != 0);
}

}  // namespace

Result<FileLock> lock_save_root(const std::string& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return Status::Error(root + ": cannot create the checkpoint directory: " + ec.message());
  const std::string path = root + "/" + kSaveLockFile;
  TRESTLE_ASSIGN_OR_RETURN(auto lock, FileLock::try_acquire(path));
  // A job killed just before this one started may still hold the lock while its processes exit: wait for that (up to
  // 30 s), never for a live holder.
  for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
       !lock && std::chrono::steady_clock::now() < deadline;) {
    auto holder = read_text_file(path, 4096);
    if (!holder.ok() || !holder_is_exiting(std::string(holder->substr(0, holder->find('\n'))))) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    TRESTLE_ASSIGN_OR_RETURN(lock, FileLock::try_acquire(path));
  }
  if (!lock) {
    std::string who;
    // (a holder that has just taken the lock writes its name a moment later)
    for (int attempt = 0; attempt < 25 && who.empty(); ++attempt) {
      if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto holder = read_text_file(path, 4096);
      if (holder.ok()) who = std::string(holder->substr(0, holder->find('\n')));
    }
    return Status::Error(root + ": another job is saving checkpoints here (" +
                         (who.empty() ? std::string("it holds ") : who + ", holding ") + path +
                         "); two jobs saving into one directory would interleave their checkpoints. Stop it, or "
                         "give this job another directory");
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string who = "host " + printable_text(host) + ", pid " + std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock->fd(), 0) != 0 ||
      ::pwrite(lock->fd(), who.data(), who.size(), 0) != static_cast<ssize_t>(who.size()))
    return Status::Error(path + ": cannot write the lock's holder: " + std::strerror(errno));
  return std::move(*lock);
}

Result<std::optional<std::int64_t>> read_latest_iteration(const std::string& root) {
  TRESTLE_ASSIGN_OR_RETURN(const Tracker tracker, read_tracker(root));
  if (!tracker.present) return std::optional<std::int64_t>();
  if (tracker.release)
    return Status::Error(root + "/" + kTrackerFile +
                         ": says 'release', but a Trestle checkpoint's tracker names an iteration number");
  return std::optional<std::int64_t>(tracker.iteration);
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

bool holds_uncommitted_save(const std::string& root) {
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == kSaveLockFile || name.starts_with(".tmp.iter_")) return true;
  }
  return false;
}

Result<std::string> resolve_iteration_dir(const std::string& root, std::optional<std::int64_t> iteration) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return Status::Error(root + ": no such checkpoint directory");
  const bool tracked = !iteration;
  if (tracked) {
    TRESTLE_ASSIGN_OR_RETURN(iteration, read_latest_iteration(root));
    if (!iteration) return Status::Error(root + ": no " + kTrackerFile + " (no committed checkpoint here)");
  }
  const std::string dir = root + "/" + iteration_dir_name(*iteration);
  if (!fs::exists(fs::path(dir) / kManifestFile, ec)) {
    std::string have;
    for (auto i : list_iterations(root)) have += (have.empty() ? "" : ", ") + std::to_string(i);
    return Status::Error(dir + ": iteration " + std::to_string(*iteration) + " is not a committed checkpoint" +
                         (have.empty() ? "" : " (committed: " + have + ")") +
                         (tracked ? "; " + root + "/" + kTrackerFile + " names it" : ""));
  }
  return dir;
}

Result<std::optional<FileLock>> take_untracked_commit(const std::string& root, std::int64_t iteration) {
  const fs::path dir = fs::path(root) / iteration_dir_name(iteration);
  std::error_code ec;
  if (!fs::is_regular_file(dir / kManifestFile, ec)) return std::optional<FileLock>();
  TRESTLE_ASSIGN_OR_RETURN(const auto latest, read_latest_iteration(root));
  if (latest && *latest >= iteration) return std::optional<FileLock>();
  const std::string prefix = ".tmp." + iteration_dir_name(iteration) + ".";
  std::vector<std::string> locks;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.starts_with(prefix) && name.ends_with(kOwnedDirLockSuffix)) locks.push_back(it->path().string());
  }
  for (const std::string& lock_path : locks) {
    const std::string temp = lock_path.substr(0, lock_path.size() - std::strlen(kOwnedDirLockSuffix));
    std::error_code type_ec;
    if (fs::exists(fs::symlink_status(temp, type_ec))) continue;  // still its directory: an attempt, not a commit
    TRESTLE_ASSIGN_OR_RETURN(auto lock, FileLock::try_acquire(lock_path));
    if (lock) return lock;
  }
  return std::optional<FileLock>();
}

Result<OwnedDir> begin_iteration(const std::string& root, std::int64_t iteration, const std::string& save_id) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return Status::Error(root + ": cannot create checkpoint directory: " + ec.message());
  // An overwrite interrupted between moving iter_N aside and putting the new one in place (file systems without
  // RENAME_EXCHANGE): the old iteration goes back; one whose replacement did land is removed.
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (!name.starts_with(".old.iter_")) continue;
    const std::string final_name = name.substr(5, name.find('.', 5) - 5);
    std::error_code move_ec;
    if (!fs::exists(fs::path(root) / final_name, move_ec)) fs::rename(it->path(), fs::path(root) / final_name, move_ec);
    else fs::remove_all(it->path(), move_ec);
  }
  TRESTLE_RETURN_IF_ERROR(remove_abandoned_dirs(root, ".tmp.iter_").status());
  remove_dead_temporaries(root + "/" + kTrackerFile);
  TRESTLE_RETURN_IF_ERROR(fault_point("create save directory", root));
  return OwnedDir::create(root + "/.tmp." + iteration_dir_name(iteration) + "." + save_id);
}

Status commit_iteration(const std::string& root, const std::string& temp_dir, const Manifest& manifest,
                        bool overwrite) {
  TRESTLE_RETURN_IF_ERROR(write_file_atomically(temp_dir + "/" + kManifestFile, manifest_file_text(manifest)));
  TRESTLE_RETURN_IF_ERROR(fsync_directory(temp_dir));
  TRESTLE_RETURN_IF_ERROR(fault_point("commit", root));
  const std::string final_dir = root + "/" + iteration_dir_name(manifest.iteration);
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    TRESTLE_RETURN_IF_ERROR(commit_rename(temp_dir, final_dir));
  } else {
    if (!overwrite)
      return Status::Error(final_dir + ": iteration " + std::to_string(manifest.iteration) +
                           " already exists: it is kept, and this save is not committed");
    // Swapped in one step where the file system can: the old iteration lands in the temporary name and is removed.
    if (::renameat2(AT_FDCWD, temp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      TRESTLE_RETURN_IF_ERROR(fault_point("swap iteration", final_dir));
      TRESTLE_RETURN_IF_ERROR(fsync_directory(root));
      fs::remove_all(temp_dir, ec);
    } else if (errno == EINVAL || errno == ENOSYS) {
      const std::string aside =
          root + "/.old." + iteration_dir_name(manifest.iteration) + fs::path(temp_dir).extension().string();
      fs::rename(final_dir, aside, ec);
      if (ec) return Status::Error(final_dir + ": cannot move aside: " + ec.message());
      Status moved = fault_point("move iteration aside", aside);
      if (moved.ok()) moved = commit_rename(temp_dir, final_dir);
      if (!moved.ok()) {
        fs::rename(aside, final_dir, ec);  // the old one back (fails harmlessly if the new one did land)
        return moved;
      }
      fs::remove_all(aside, ec);
    } else {
      return Status::Error(final_dir + ": cannot replace with " + temp_dir + ": " + std::strerror(errno));
    }
  }
  TRESTLE_RETURN_IF_ERROR(fault_point("update tracker", root));
  TRESTLE_RETURN_IF_ERROR(write_file_atomically(root + "/" + kTrackerFile, std::to_string(manifest.iteration) + "\n"));
  TRESTLE_RETURN_IF_ERROR(fault_point("committed", root));
  return OkStatus();
}

}  // namespace trestle
