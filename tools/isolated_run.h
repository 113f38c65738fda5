// Running a command's work in a child process, so that a library that crashes on a damaged input file (HDF5 1.10
// dereferences some damaged object headers) ends the work with an error naming the file instead of killing trestle.
#pragma once

#include <functional>

#include "tools/command.h"

namespace trestle::cli {

// Runs `work` in a forked child (which dies with this process) and returns its outcome: its exit code and message,
// stdout and stderr passing through as they are written. Where the child dies by a fault (SIGSEGV, SIGBUS, SIGILL,
// SIGFPE, SIGABRT, SIGSYS), returns `on_fault(signal)` instead. SIGINT, SIGTERM and SIGHUP sent to this process while
// the child runs are passed on to it (where their action here is still the default), so the work's own handlers
// (ckpt/removed_on_signal.h) clean up; where the child is killed from outside (SIGKILL, SIGTERM, SIGINT, ...),
// `after_kill(signal)` runs and this process dies by the same signal, as it would have with the work in it. Call it
// before this process starts threads.
Outcome run_isolated(const std::function<Outcome()>& work, const std::function<Outcome(int signal)>& on_fault,
                     const std::function<void(int signal)>& after_kill = {});

}  // namespace trestle::cli
