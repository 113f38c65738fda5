// Says a thing once per process: the first log_once(key, ...) writes "trestle: <message>" to stderr, later calls
// with the same key are silent. Thread-safe. Used for fallbacks (io_uring refused, O_DIRECT refused, ...).
#pragma once

#include <string_view>

namespace trestle {

// Returns true when this call wrote the message.
bool log_once(std::string_view key, std::string_view message);

}  // namespace trestle
