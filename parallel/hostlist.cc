#include "parallel/hostlist.h"

#include <cctype>

namespace trestle::parallel {
namespace {

bool all_digits(std::string_view text) {
  if (text.empty()) return false;
  for (char c : text)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

// Numbers of equal or different widths compare by value: "9" < "10", "007" == "7".
bool not_above(std::string_view low, std::string_view high) {
  while (low.size() > 1 && low.front() == '0') low.remove_prefix(1);
  while (high.size() > 1 && high.front() == '0') high.remove_prefix(1);
  return low.size() != high.size() ? low.size() < high.size() : low <= high;
}

// The inside of one bracket, "03-05,9": returns its first number as written, or why it is not a range list.
Result<std::string> first_of_ranges(std::string_view ranges) {
  std::string first;
  while (true) {
    const std::size_t comma = ranges.find(',');
    const std::string_view range = ranges.substr(0, comma);
    const std::size_t dash = range.find('-');
    const std::string_view low = range.substr(0, dash);
    const std::string_view high = dash == std::string_view::npos ? low : range.substr(dash + 1);
    if (!all_digits(low) || !all_digits(high))
      return Status::Error("'[" + std::string(range) + "]' is not a number or a range of numbers (N or N-M)");
    if (!not_above(low, high)) return Status::Error("the range '" + std::string(range) + "' runs backwards");
    if (first.empty()) first = low;
    if (comma == std::string_view::npos) return first;
    ranges.remove_prefix(comma + 1);
  }
}

}  // namespace

Result<std::string> first_host_of_hostlist(std::string_view hostlist) {
  const auto error = [&](const std::string& what) {
    return Status::Error("Slurm host list '" + std::string(hostlist) + "': " + what);
  };
  if (hostlist.empty()) return error("it is empty");
  std::string first;
  std::string host;
  bool first_done = false;
  for (std::size_t i = 0; i <= hostlist.size(); ++i) {
    const char c = i < hostlist.size() ? hostlist[i] : ',';
    if (c == ',') {
      if (host.empty()) return error("an empty host name at offset " + std::to_string(i));
      if (!first_done) first = host;
      first_done = true;
      host.clear();
    } else if (c == '[') {
      const std::size_t close = hostlist.find(']', i);
      const std::size_t nested = hostlist.find('[', i + 1);
      if (close == std::string_view::npos || nested < close)
        return error("the '[' at offset " + std::to_string(i) + " has no matching ']'");
      auto number = first_of_ranges(hostlist.substr(i + 1, close - i - 1));
      if (!number.ok()) return error(number.status().message());
      host += *number;
      i = close;
    } else if (c == ']') {
      return error("the ']' at offset " + std::to_string(i) + " has no matching '['");
    } else if (std::isspace(static_cast<unsigned char>(c)) || !std::isprint(static_cast<unsigned char>(c))) {
      return error("a blank or unprintable character at offset " + std::to_string(i));
    } else {
      host += c;
    }
  }
  return first;
}

}  // namespace trestle::parallel
