#include "ckpt/json_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <vector>

#include "ckpt/fault_point.h"
#include "ckpt/regular_file.h"

namespace trestle {
namespace {

// The checks of strict parsing, as a SAX pass that builds nothing: each open object's keys (a key twice is refused)
// and the depth. (nlohmann's parse callback would do the same but rescans the parent after every object value it
// keeps, which made a manifest of many tensors quadratic to read.)
class StrictnessCheck final : public nlohmann::json_sax<nlohmann::json> {
 public:
  const JsonStrictness& result() const { return result_; }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return deeper();
  }
  bool key(string_t& key) override {
    if (keys_.back().insert(key).second) return true;
    result_.problem = "the key '" + key + "' appears twice in one object";
    result_.duplicate_key = key;
    result_.duplicate_depth = static_cast<int>(keys_.size());
    return false;
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return deeper(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  bool deeper() {
    if (++depth_ <= kMaxJsonDepth) return true;
    result_.problem = "nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels";
    return false;
  }
  std::vector<std::set<std::string>> keys_;  // the keys seen so far in each open object
  int depth_ = 0;
  JsonStrictness result_;
};

// nlohmann's complaint without its exception's tag: "at line 23, column 19: syntax error while parsing value - ...".
std::string parse_complaint(const nlohmann::json::exception& e) {
  std::string_view what = e.what();
  if (what.starts_with("[json.exception.")) what.remove_prefix(std::min(what.size(), what.find("] ") + 2));
  if (what.starts_with("parse error ")) what.remove_prefix(std::string_view("parse error ").size());
  if (!what.starts_with("at ")) return ": " + std::string(what);
  return " " + std::string(what);
}

// Strict parsing for files from strangers: a key twice in one object (which plain parsing would silently resolve to
// the last value) or nesting deeper than kMaxJsonDepth is refused, naming the key or the depth; both are checked
// before the value is built.
template <typename Json>
Result<Json> parse_strict(std::string_view text, const std::string& path) {
  const JsonStrictness check = check_json_strictness(text);
  if (!check.problem.empty()) return Status::Error(path + ": " + check.problem);
  try {
    return Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return Status::Error(path + ": not valid JSON" + parse_complaint(e));
  }
}

template <typename Json>
Result<Json> parse_json_file(const std::string& path, std::uint64_t max_bytes) {
  TRESTLE_ASSIGN_OR_RETURN(const std::string text, read_text_file(path, max_bytes));
  return parse_strict<Json>(text, path);
}

}  // namespace

JsonStrictness check_json_strictness(std::string_view text) {
  StrictnessCheck check;
  nlohmann::json::sax_parse(text, &check);
  return check.result();
}

Result<nlohmann::json> parse_json_text(std::string_view text, const std::string& source) {
  return parse_strict<nlohmann::json>(text, source);
}

Result<nlohmann::ordered_json> parse_ordered_json_text(std::string_view text, const std::string& source) {
  return parse_strict<nlohmann::ordered_json>(text, source);
}

Result<std::string> read_text_file(const std::string& path, std::uint64_t max_bytes) {
  TRESTLE_ASSIGN_OR_RETURN(const int fd, open_regular_file(path));
  struct stat st {};
  std::string text;
  Status status = OkStatus();
  if (::fstat(fd, &st) != 0) {
    status = Status::Error(path + ": cannot stat: " + std::strerror(errno));
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
