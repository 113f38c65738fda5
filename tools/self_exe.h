// Where the running executable lies (/proc/self/exe), to find the programs and files installed beside it.
#pragma once

#include <string>

#include "ckpt/status.h"

namespace trestle::cli {

// The running executable's absolute path.
Result<std::string> self_exe();
// The folder holding the running executable.
Result<std::string> self_exe_dir();

}  // namespace trestle::cli
