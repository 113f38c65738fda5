// Megatron's list flags take several words (argparse's nargs '+': "--json-keys text title"); cxxopts takes one
// comma-separated value. join_list_flag_words rewrites a command line so that each of `list_flags` carries its words
// joined by commas, before cxxopts parses it.
#pragma once

#include <string>
#include <vector>

namespace trestle::cli {

// argv with the words after each list flag (up to the next "--" word) joined into one value. As argparse's nargs, a
// list flag given again replaces its earlier words (a script's override appended to a base command) rather than adding
// to them; "--flag=value" stays one word.
std::vector<std::string> join_list_flag_words(int argc, char** argv, const std::vector<std::string>& list_flags);

}  // namespace trestle::cli
