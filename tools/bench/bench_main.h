// The main of a `trestle bench` command: parses argv with the command's option spec, prints --help, turns the parsed
// arguments into its options (a bad value: exit 2) and runs it (a failure: exit 1), every message prefixed with the
// command's name; any other exception is a failure (exit 1), never an abort.
#pragma once

#include <cxxopts.hpp>
#include <exception>
#include <iostream>

#include "ckpt/status.h"
#include "tools/parse_error.h"

namespace trestle::cli {

template <class Options>
int run_bench_main(const char* name, cxxopts::Options& spec, Result<Options> (*parse)(const cxxopts::ParseResult&),
                   Status (*run)(const Options&), int argc, char** argv) {
  try {
    const auto args = spec.parse(argc, argv);
    if (args.count("help")) {
      std::cout << spec.help() << "\n";
      return 0;
    }
    if (!args.unmatched().empty()) {
      std::cerr << name << ": unexpected argument '" << args.unmatched().front() << "'\n";
      return 2;
    }
    auto options = parse(args);
    if (!options.ok()) {
      std::cerr << name << ": " << options.status().message() << "\n";
      return 2;
    }
    const Status status = run(*options);
    if (!status.ok()) {
      std::cerr << name << ": " << status.message() << "\n";
      return 1;
    }
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << name << ": " << describe_parse_error(e, argc, argv) << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 1;
  }
}

}  // namespace trestle::cli
