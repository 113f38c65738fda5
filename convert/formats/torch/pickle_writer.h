// Writes a PickleValue tree as CPython's pickle module would write the same Python objects: the same opcodes, memo
// (a value reached twice through the same pointer is written once and fetched from the memo, as Python memoizes by
// identity; class references are memoized by name, as Python's classes are singletons), batching of APPENDS/SETITEMS,
// and protocol 4 framing. Protocol 2 is what torch.save writes, protocol 4 what DCP's .metadata uses.
#pragma once

#include <string>

#include "convert/formats/torch/pickle_value.h"

namespace trestle {

// Fails for values the protocol cannot express (protocol < 4 sets) and for trees deeper than kPickleMaxDepth.
Result<std::string> write_pickle(const PickleValue* root, int protocol);

}  // namespace trestle
