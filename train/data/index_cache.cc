#include "train/data/index_cache.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ckpt/regular_file.h"

namespace trestle::data {

Result<bool> cache_complete(const std::string& base, std::span<const char* const> affixes) {
  bool complete = true;
  for (const char* affix : affixes) {
    const std::string path = base + "-" + affix;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno != ENOENT) return Status::Error(path + ": cannot stat: " + std::strerror(errno));
      complete = false;
    } else if (S_ISLNK(st.st_mode)) {
      return Status::Error(path + ": a symbolic link where a cache file should be; refused without following it " +
                           "(delete it to rebuild the cache)");
    } else if (!S_ISREG(st.st_mode)) {
      return Status::Error(path + ": not a regular file (" + file_kind(st.st_mode) +
                           ") where a cache file should be; refused without reading it (delete it to rebuild the " +
                           "cache)");
    }
  }
  return complete;
}

std::string first_difference(const std::string& found, const std::string& expected) {
  std::size_t at = 0;
  while (at < found.size() && at < expected.size() && found[at] == expected[at]) ++at;
  const std::size_t line_start = at == 0 ? 0 : found.rfind('\n', at - 1) + 1;  // npos + 1 == 0
  const auto line_of = [&](const std::string& text) {
    if (line_start >= text.size()) return std::string("the end of the file");
    return "'" + text.substr(line_start, text.find('\n', line_start) - line_start) + "'";
  };
  const auto line = std::count(found.begin(), found.begin() + static_cast<std::ptrdiff_t>(line_start), '\n') + 1;
  return "line " + std::to_string(line) + " is " + line_of(found) + ", expected " + line_of(expected);
}

}  // namespace trestle::data
