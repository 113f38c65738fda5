#include "ckpt/byte_size.h"

#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <utility>

namespace trestle {

Result<std::uint64_t> parse_byte_size(std::string_view text) {
  static constexpr std::array<std::pair<std::string_view, double>, 10> kUnits = {{
      {"KIB", 1024.0},
      {"MIB", 1048576.0},
      {"GIB", 1073741824.0},
      {"TIB", 1099511627776.0},
      {"KB", 1e3},
      {"MB", 1e6},
      {"GB", 1e9},
      {"TB", 1e12},
      {"B", 1.0},
      {"", 1.0},
  }};
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number(text.substr(0, i));
  std::string unit;
  for (char c : text.substr(i))
    if (c != ' ') unit += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  char* end = nullptr;
  const double value = number.empty() ? -1 : std::strtod(number.c_str(), &end);
  if (value < 0 || end != number.c_str() + number.size())
    return Status::Error("'" + std::string(text) + "' is not a size (expected e.g. 5GB, 500MiB or 1048576)");
  for (const auto& [name, scale] : kUnits) {
    if (unit != name) continue;
    // llround is undefined past 2^63, so larger sizes are refused rather than wrapped.
    if (!(value * scale < 9223372036854775808.0))
      return Status::Error("'" + std::string(text) + "' is too large (at most 2^63 - 1 bytes)");
    return static_cast<std::uint64_t>(std::llround(value * scale));
  }
  return Status::Error("'" + std::string(text) + "' has an unknown unit (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

std::string format_bytes(std::uint64_t bytes) {
  static constexpr std::array<const char*, 5> kNames = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < kNames.size()) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, unit == 0 ? "%.0f %s" : "%.2f %s", value, kNames[unit]);
  return buf;
}

}  // namespace trestle
