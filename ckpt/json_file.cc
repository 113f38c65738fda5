#include "ckpt/json_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <vector>

#include "ckpt/fault_point.h"

namespace trestle {
namespace {

// Strict parsing for files from strangers: a key twice in one object (which plain parsing would silently resolve to
// the last value) or nesting deeper than kMaxJsonDepth is refused, naming the key or the depth.
template <typename Json>
Result<Json> parse_strict(std::string_view text, const std::string& path) {
  std::vector<std::set<std::string>> keys;  // the keys seen so far in each open object
  std::string problem;
  auto on_event = [&](int depth, nlohmann::json::parse_event_t event, Json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (!problem.empty()) return true;
    if (depth > kMaxJsonDepth) problem = "nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels";
    if (event == Event::object_start) keys.emplace_back();
    if (event == Event::object_end && !keys.empty()) keys.pop_back();
    if (event == Event::key && !keys.empty() && !keys.back().insert(parsed.template get<std::string>()).second)
      problem = "the key '" + parsed.template get<std::string>() + "' appears twice in one object";
    return true;
  };
  Json value;
  try {
    value = Json::parse(text, on_event);
  } catch (const nlohmann::json::exception& e) {
    return Status::Error(path + ": not valid JSON: " + e.what());
  }
  if (!problem.empty()) return Status::Error(path + ": " + problem);
  return value;
}

template <typename Json>
Result<Json> parse_json_file(const std::string& path, std::uint64_t max_bytes) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string text, read_text_file(path, max_bytes));
  return parse_strict<Json>(text, path);
}

}  // namespace

Result<nlohmann::json> parse_json_text(std::string_view text, const std::string& source) {
  return parse_strict<nlohmann::json>(text, source);
}

Result<std::string> read_text_file(const std::string& path, std::uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  std::string text;
  Status status = OkStatus();
  if (::fstat(fd, &st) != 0) {
    status = Status::Error(path + ": cannot stat: " + std::strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    status = Status::Error(path + ": not a regular file");
  } else if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    status = Status::Error(path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                           std::to_string(max_bytes) + " a file of this kind may have");
  } else {
    text.resize(static_cast<std::size_t>(st.st_size));
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::read(fd, text.data() + done, transfer_length(text.size() - done, fd));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        status = Status::Error(path + ": read failed: " + (n < 0 ? std::strerror(errno) : "file shrank while read"));
        break;
      }
      done += static_cast<std::size_t>(n);
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  return text;
}

Result<nlohmann::json> read_json_file(const std::string& path, std::uint64_t max_bytes) {
  return parse_json_file<nlohmann::json>(path, max_bytes);
}

Result<nlohmann::ordered_json> read_ordered_json_file(const std::string& path, std::uint64_t max_bytes) {
  return parse_json_file<nlohmann::ordered_json>(path, max_bytes);
}

}  // namespace trestle
