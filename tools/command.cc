#include "tools/command.h"

#include <cctype>
#include <cstdint>
#include <exception>
#include <iostream>
#include <map>
#include <new>

#include "ckpt/printable_text.h"
#include "tools/list_flag_words.h"
#include "tools/parse_error.h"

namespace trestle::cli {
namespace {

// "--tp" for an option; "A (-a)" for a positional, which --help shows in capitals and cxxopts also takes as an option.
std::string quoted_option(const std::string& key) {
  const std::string dashed = (key.size() == 1 ? "-" : "--") + key;
  for (const char* positional : {"path", "a", "b", "in", "out", "src", "dst"})
    if (key == positional) {
      std::string name = key;
      for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      return name + " (" + dashed + ")";
    }
  return dashed;
}

// Rules every command shares, checked before it reads anything: no argument left over after the options and
// positionals it declares, and an iteration number (it names iter_N) that is not negative.
Outcome check_common_usage(const CommandSpec& command, const cxxopts::ParseResult& args) {
  if (!args.unmatched().empty())
    return usage_error("unexpected argument '" + args.unmatched().front() + "' (" +
                       std::to_string(args.unmatched().size()) + " more than the command takes)");
  for (const auto& option : args.arguments())
    if ((option.key() == "iteration" || option.key() == "iteration-a" || option.key() == "iteration-b") &&
        option.as<std::int64_t>() < 0)
      return usage_error("--" + option.key() + " must be 0 or more, not " + option.value());
  if (!command.last_wins) {
    std::map<std::string, std::string> given;
    for (const auto& option : args.arguments())
      if (auto [at, first] = given.emplace(option.key(), option.value()); !first && at->second != option.value())
        return usage_error(quoted_option(option.key()) + " given twice ('" + at->second + "' and '" + option.value() +
                           "'): give it once");
  }
  return finished();
}

}  // namespace

int run_command(const CommandSpec& command, int argc, char** argv) {
  const std::string name = std::string("trestle ") + command.name;
  auto finish = [&](const Outcome& outcome) {
    if (!outcome.message.empty()) std::cerr << name << ": " << printable_text(outcome.message) << "\n";
    return outcome.code;
  };
  try {
    if (command.forward != nullptr) return finish(command.forward(argc, argv));
    cxxopts::Options spec(name, command.description);
    command.declare(spec);
    spec.add_options()("h,help", "show this help");
    std::vector<std::string> words = join_list_flag_words(argc, argv, command.list_flags);
    std::vector<char*> word_pointers;
    for (std::string& w : words) word_pointers.push_back(w.data());
    const auto args = spec.parse(static_cast<int>(word_pointers.size()), word_pointers.data());
    if (args.count("help")) {
      std::cout << spec.help() << "\n";
      return kExitOk;
    }
    if (Outcome usage = check_common_usage(command, args); usage.code != kExitOk) return finish(usage);
    return finish(command.run(args));
  } catch (const cxxopts::exceptions::exception& e) {
    return finish(
        usage_error(describe_parse_error(e, argc, argv) + " (trestle " + command.name + " --help lists the options)"));
  } catch (const std::bad_alloc&) {
    return finish({kExitFailure,
                   "out of memory (an allocation failed: the input or its sizes may be larger than this "
                   "machine can hold)"});
  } catch (const std::exception& e) {
    return finish({kExitFailure, e.what()});
  }
}

Outcome check_paths_not_empty(const cxxopts::ParseResult& args,
                              const std::vector<std::pair<const char*, const char*>>& paths) {
  for (const auto& [key, shown] : paths)
    if (args.count(key) && args[key].as<std::string>().empty())
      return usage_error(std::string(shown) + " is an empty path");
  return finished();
}

Result<std::string> required_positional(const cxxopts::ParseResult& args, const char* name, const char* what) {
  if (!args.count(name)) return Status::Error(std::string(what) + " is required");
  return args[name].as<std::string>();
}

}  // namespace trestle::cli
