// A conversion's output: a new or empty directory, so nothing already on disk is overwritten.
#pragma once

#include <string>

#include "ckpt/status.h"

namespace trestle {

// Fails naming `dst` when it exists and is not an empty directory.
Status check_new_destination(const std::string& dst);

}  // namespace trestle
