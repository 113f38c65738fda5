// `trestle train`'s options (the trainer's and Megatron-LM's flags) and its local launch: shared by `trestle`, which
// launches a job's workers without loading LibTorch, and trestle-train, the workers' program.
#pragma once

#include <cxxopts.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::cli {

// Every option of `trestle train`, its help text included.
cxxopts::Options train_options();
// `spec`'s help, group by group.
std::string train_help(const cxxopts::Options& spec);
// argv (argv[0] the command's name) parsed by `spec`, Megatron's list flags' words joined first; throws cxxopts's
// exceptions for what it refuses.
cxxopts::ParseResult parse_train_options(cxxopts::Options& spec, int argc, char** argv);

// Megatron's --exit-signal: a signal's name as Python's signal.Signals spells it, of those a job can be asked to stop
// with (the others are the system's or cannot be caught); SIGTERM when not given.
Result<int> exit_signal(const cxxopts::ParseResult& args);

// Copies of a torch_dist --load (trestle_load_* in `dir`) whose job is gone, killed before it could remove them:
// their lock is free.
void remove_abandoned_loads(const std::filesystem::path& dir);

// --nproc-per-node N: starts N local workers of `worker_program` (trestle-train) with argv's options less the
// launcher's own (argv[0] the command's name), forwards their output and returns the job's exit code.
int launch_train_workers(const cxxopts::ParseResult& args, int argc, char** argv, const std::string& worker_program);

// The launch flags a usage error can be found in before anything starts (a word without its option, --master-port
// out of range, a timeout below 1): false, after saying which on stderr.
bool check_launch_flags(const cxxopts::ParseResult& args);

}  // namespace trestle::cli
