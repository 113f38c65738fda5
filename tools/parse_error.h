// cxxopts' messages for a value it cannot read ("Argument 'abc' failed to parse") do not say which option had it:
// describe_parse_error names the option from the command line, and passes any other message on unchanged.
#pragma once

#include <cxxopts.hpp>
#include <string>

namespace trestle::cli {

// e's message, with the option that carried the value cxxopts could not read ("--tp: 'abc' is not a value it takes")
// where argv shows one ("--tp abc", "--tp=abc", "-t abc").
std::string describe_parse_error(const cxxopts::exceptions::exception& e, int argc, const char* const* argv);

}  // namespace trestle::cli
