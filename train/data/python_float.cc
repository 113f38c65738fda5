#include "train/data/python_float.h"

#include <cctype>
#include <cstdlib>
#include <string>

namespace trestle::data {

std::optional<double> python_float(std::string_view text) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!text.empty() && space(text.front())) text.remove_prefix(1);
  while (!text.empty() && space(text.back())) text.remove_suffix(1);
  std::string digits;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '_') {  // only between two digits
      const auto digit = [&](std::size_t at) {
        return at < text.size() && std::isdigit(static_cast<unsigned char>(text[at])) != 0;
      };
      if (i == 0 || !digit(i - 1) || !digit(i + 1)) return std::nullopt;
      continue;
    }
    // strtod's hexadecimal floats and nan(chars) are not Python's.
    if (c == 'x' || c == 'X' || c == '(' || c == ')') return std::nullopt;
    digits += c;
  }
  if (digits.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(digits.c_str(), &end);
  if (end != digits.c_str() + digits.size()) return std::nullopt;
  return value;
}

}  // namespace trestle::data
