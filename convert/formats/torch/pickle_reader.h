// Parses pickles (protocols 2 to 5, plus the protocol 0/1 opcodes that appear in them) into a PickleDocument without
// executing anything. Every length is checked against the remaining input before anything is allocated, memo
// references must exist, the mark stack is bounded, and unknown opcodes, extension codes and out-of-band buffers are
// errors that name the opcode and its byte offset.
//
// Two classes are understood while parsing, because they carry plain data: collections.OrderedDict() becomes a dict
// (tagged with its class) and _codecs.encode(str, 'latin1') (protocol 2's spelling of bytes) becomes bytes. Every other
// class stays a generic object.
#pragma once

#include <string_view>

#include "convert/formats/torch/pickle_value.h"

namespace trestle {

// Values a parse may make by default: those that fit in a quarter of this machine's memory.
std::size_t default_max_pickle_values();

struct PickleLimits {
  int max_mark_depth = 1000;         // nested MARKs (each tuple/list/dict under construction)
  std::size_t max_stack = 1u << 24;  // values on the stack at once
  std::size_t max_values = default_max_pickle_values();  // values in the document (a few hundred bytes each)
};

Result<PickleDocument> parse_pickle(std::string_view data, const PickleLimits& limits = {});

}  // namespace trestle
