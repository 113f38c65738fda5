// Opening a file Trestle reads from a stranger's directory: only a regular file is opened, and anything else at the
// path (a FIFO, a device, a directory, a socket) is refused without blocking, naming the file and what it is.
#pragma once

#include <string>

#include "ckpt/status.h"

namespace trestle {

// A descriptor of the regular file at `path`, opened O_RDONLY | O_CLOEXEC | flags in blocking mode. The open itself
// is non-blocking so that a FIFO put where a file should be is refused rather than waited on forever. When the open
// call fails, `open_error` (if given) gets its errno (EINVAL: a file system or sandbox refusing O_DIRECT).
Result<int> open_regular_file(const std::string& path, int flags = 0, int* open_error = nullptr);

// "a FIFO", "a directory", ... for an st_mode that is not a regular file's.
const char* file_kind(unsigned mode);

// A file or directory inside a checkpoint, which is the checkpoint's own: an error naming it when it is a symbolic
// link (which could lead out of the checkpoint; links are not followed); ok when it is absent (its reader says so).
Status refuse_checkpoint_link(const std::string& path);

}  // namespace trestle
