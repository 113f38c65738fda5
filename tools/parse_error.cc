#include "tools/parse_error.h"

#include <string_view>

namespace trestle::cli {
namespace {

// The value between cxxopts' quotes in "Argument 'VALUE' failed to parse" (its quotes are ‘ ’, or ' ' when built
// without Unicode), or nothing for any other message.
bool unparsed_value(std::string_view message, std::string& value) {
  constexpr std::string_view kTail = " failed to parse";
  constexpr std::string_view kHead = "Argument ";
  if (message.substr(0, kHead.size()) != kHead || message.size() < kHead.size() + kTail.size() ||
      message.substr(message.size() - kTail.size()) != kTail)
    return false;
  std::string_view quoted = message.substr(kHead.size(), message.size() - kHead.size() - kTail.size());
  for (std::string_view quote : {std::string_view("\u2018"), std::string_view("'")})
    if (quoted.substr(0, quote.size()) == quote) {
      quoted.remove_prefix(quote.size());
      break;
    }
  for (std::string_view quote : {std::string_view("\u2019"), std::string_view("'")})
    if (quoted.size() >= quote.size() && quoted.substr(quoted.size() - quote.size()) == quote) {
      quoted.remove_suffix(quote.size());
      break;
    }
  value = std::string(quoted);
  return true;
}

}  // namespace

std::string describe_parse_error(const cxxopts::exceptions::exception& e, int argc, const char* const* argv) {
  std::string value;
  if (!unparsed_value(e.what(), value)) return e.what();
  for (int i = 1; i < argc; ++i) {
    const std::string_view word = argv[i];
    std::string option;
    if (word.size() > 2 && word.substr(0, 2) == "--" && word.find('=') != std::string_view::npos &&
        word.substr(word.find('=') + 1) == value)
      option = std::string(word.substr(0, word.find('=')));
    else if (word == value && i > 1 && argv[i - 1][0] == '-' && argv[i - 1][1] != '\0') option = argv[i - 1];
    if (!option.empty()) return option + ": '" + value + "' is not a value it takes";
  }
  return e.what();
}

}  // namespace trestle::cli
