// Test hooks for the crash and fault harnesses: every write, sync, rename and commit step of a save or conversion
// passes a fault point, named after the step, for the file it acts on. Driven by the environment (all unset: a no-op):
//   TRESTLE_TEST_KILL_POINT=N     SIGKILL at the Nth point passed (counted over all threads)
//   TRESTLE_TEST_FAIL_POINT=N     the Nth point fails as its I/O call would, with TRESTLE_TEST_FAIL_ERRNO (ENOSPC,
//                                 EIO, EDQUOT or EROFS; default EIO)
//   TRESTLE_TEST_HANG_POINT=N     the Nth point never returns (a hung rank)
//   TRESTLE_TEST_HOLD_AT=NAME     hold_point(NAME) notes "hold NAME" in the trace and waits there until the file
//                                 TRESTLE_TEST_HOLD_FILE exists (a test acts on the parked process, then lets it go on)
//   TRESTLE_TEST_FAULT_RANK=R     only the worker whose RANK is R kills, fails or hangs
//   TRESTLE_TEST_KILL_TRACE=FILE  each point's name is appended to FILE ("%p" in FILE: the process id)
//   TRESTLE_TEST_MAX_TRANSFER=N   every file read and write call asks for at most N bytes (N rounded up to 4096 for an
//                                 O_DIRECT file), as a kernel returning short counts would; 0: no call moves anything
#pragma once

#include <cstddef>
#include <string>

#include "ckpt/status.h"

namespace trestle {

// OkStatus unless this is the point chosen to fail: then "<path>: <what>: <strerror> (injected fault)".
Status fault_point(const char* what, const std::string& path);

// A place a test may park the process at (TRESTLE_TEST_HOLD_AT); not a fault point, and not counted as one.
void hold_point(const char* what);

// How many of `length` bytes one read or write call on `fd` may ask for: `length` unless TRESTLE_TEST_MAX_TRANSFER
// is set.
std::size_t transfer_length(std::size_t length, int fd);

}  // namespace trestle
