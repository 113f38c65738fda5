#include "tools/command.h"

#include <exception>
#include <iostream>

#include "ckpt/printable_text.h"

namespace trestle::cli {

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
    const auto args = spec.parse(argc, argv);
    if (args.count("help")) {
      std::cout << spec.help() << "\n";
      return kExitOk;
    }
    return finish(command.run(args));
  } catch (const cxxopts::exceptions::exception& e) {
    return finish(usage_error(std::string(e.what()) + " (trestle " + command.name + " --help lists the options)"));
  } catch (const std::exception& e) {
    return finish({kExitFailure, e.what()});
  }
}

Result<std::string> required_positional(const cxxopts::ParseResult& args, const char* name, const char* what) {
  if (!args.count(name)) return Status::Error(std::string(what) + " is required");
  return args[name].as<std::string>();
}

}  // namespace trestle::cli
