// Test hook for the crash-consistency harness: each write, sync, rename and commit step of a save or conversion calls
// kill_point(). With TRESTLE_TEST_KILL_POINT=N the process SIGKILLs itself at the Nth point it passes (counted over
// all threads); with TRESTLE_TEST_KILL_TRACE=FILE it appends each point's name to FILE ("%p" in FILE: the process
// id). Both unset: a no-op.
#pragma once

namespace trestle {

void kill_point(const char* what);

}  // namespace trestle
