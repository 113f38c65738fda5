#include "tools/list_flag_words.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string_view>

namespace trestle::cli {

std::vector<std::string> join_list_flag_words(int argc, char** argv, const std::vector<std::string>& list_flags) {
  auto list_flag = [&](const std::string& word) -> std::optional<std::string> {
    const std::string name = word.substr(0, word.find('='));
    if (std::find(list_flags.begin(), list_flags.end(), name) == list_flags.end()) return std::nullopt;
    return name;
  };
  std::map<std::string, int> last;  // each list flag's last occurrence
  for (int i = 0; i < argc; ++i)
    if (const auto name = list_flag(argv[i])) last[*name] = i;
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    const std::string word = argv[i];
    const auto name = list_flag(word);
    if (!name) {
      out.push_back(word);
      continue;
    }
    const bool kept = last[*name] == i;
    if (kept) out.push_back(word);
    if (word.find('=') != std::string::npos) continue;  // --flag=value: its one word
    std::string joined;
    while (i + 1 < argc && !std::string_view(argv[i + 1]).starts_with("--")) {
      if (!joined.empty()) joined += ',';
      joined += argv[++i];
    }
    if (kept && !joined.empty()) out.push_back(joined);
  }
  return out;
}

}  // namespace trestle::cli
