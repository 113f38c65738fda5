// The trestle CLI's subcommands and the one runner they all go through: options declared once (cxxopts, also the
// --help text), exit 0 on success and --help, 2 on a usage error, 1 on a failure, and no exception escapes.
#pragma once

#include <cxxopts.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/status.h"

namespace trestle::cli {

enum ExitCode : int { kExitOk = 0, kExitFailure = 1, kExitUsage = 2 };

// How a command ended: its exit code and, when not empty, the message printed to stderr after "trestle NAME: ".
struct Outcome {
  int code = kExitOk;
  std::string message;
};
inline Outcome finished(int code = kExitOk) { return {code, {}}; }
inline Outcome usage_error(std::string message) { return {kExitUsage, std::move(message)}; }
inline Outcome usage_error(const Status& status) { return {kExitUsage, status.message()}; }
inline Outcome failure(const Status& status) { return {kExitFailure, status.message()}; }

struct CommandSpec {
  const char* name;         // "convert"
  const char* summary;      // its line in `trestle --help`
  const char* description;  // the head of `trestle NAME --help`
  // Adds the command's options and positionals (-h/--help is added by the runner).
  void (*declare)(cxxopts::Options& spec);
  Outcome (*run)(const cxxopts::ParseResult& args);
  // Set instead of declare/run for a command that hands its arguments on unparsed (bench: to trestle-bench).
  Outcome (*forward)(int argc, char** argv) = nullptr;
  // Flags that take several words, as Megatron's nargs '+' ("--json-keys text title"): joined by commas (see
  // list_flag_words.h) before parsing, so the option is a list option.
  std::vector<std::string> list_flags = {};
  // An option given twice with different values: the last wins (argparse's rule, for a command that mirrors a
  // Megatron-LM script) rather than a usage error.
  bool last_wins = false;
};

// Runs one subcommand with the arguments after `trestle` (argv[0] is the command's name). For every command, an
// argument beyond its declared positionals and a negative --iteration / --iteration-a / --iteration-b are usage errors
// found before it runs.
int run_command(const CommandSpec& command, int argc, char** argv);

// A usage error for the first of `paths` given as an empty string, or a finished outcome. Each entry is an option's
// key and how to name it ("path" named "PATH", "against" named "--against").
Outcome check_paths_not_empty(const cxxopts::ParseResult& args,
                              const std::vector<std::pair<const char*, const char*>>& paths);
// The value of a positional that must be given, or a usage error naming it.
Result<std::string> required_positional(const cxxopts::ParseResult& args, const char* name, const char* what);
// Fails when the option's value (given, or its default) is below `min` ("--tp must be at least 1, not 0").
template <class T>
Status check_at_least(const cxxopts::ParseResult& args, const char* option, T min) {
  if (!args.count(option) && !args[option].has_default()) return OkStatus();
  const T value = args[option].as<T>();
  if (value >= min) return OkStatus();
  return Status::Error(std::string("--") + option + " must be at least " + std::to_string(min) + ", not " +
                       std::to_string(value));
}

extern const CommandSpec kBenchCommand;
extern const CommandSpec kConvertCommand;
extern const CommandSpec kDiffCommand;
extern const CommandSpec kExportCommand;
extern const CommandSpec kImportCommand;
extern const CommandSpec kInspectCommand;
extern const CommandSpec kPreprocessCommand;
extern const CommandSpec kReshardCommand;
extern const CommandSpec kTrainCommand;
extern const CommandSpec kVerifyCommand;

}  // namespace trestle::cli
