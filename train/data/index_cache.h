// The dataset index caches' files on disk (Megatron's <md5>-<class>-<split>-<affix> names): whether a cache's set is
// there, refusing links and special files by name, and what differs in a description that is not the expected one.
#pragma once

#include <span>
#include <string>

#include "ckpt/status.h"

namespace trestle::data {

// Whether every base + "-" + affix file is there (the cache is then loaded). Only regular files count: a symbolic link
// (which a rebuild would once have written through) or a FIFO (which reading would wait on forever) where a cache
// file should be is an error naming it, rather than followed, waited on or replaced.
Result<bool> cache_complete(const std::string& base, std::span<const char* const> affixes);

// The first line where two texts differ ("line 3 is '...', expected '...'"), for an error about a cache description.
std::string first_difference(const std::string& found, const std::string& expected);

}  // namespace trestle::data
