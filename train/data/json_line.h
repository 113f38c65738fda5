// One line of a JSON-lines file read as Python's json.loads reads it (Megatron's preprocess_data.py parses each line
// with it): strict JSON, plus what Python also takes: the literals NaN, Infinity and -Infinity, numbers beyond a
// double's range (Python: an int, or ±inf) and lone UTF-16 surrogate escapes in strings. Those values have no
// strict-JSON form: they are parsed as 0 (numbers) or U+FFFD (surrogates), and each top-level key whose value held
// one is listed with what it held, so that a caller using that key's value can refuse it.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ckpt/status.h"

namespace trestle::data {

struct JsonLine {
  nlohmann::json value;
  // Top-level key -> what its value held that strict JSON cannot (for example "NaN"), for the key's last occurrence.
  std::map<std::string, std::string> inexact_keys;
};

// The line parsed; an error is nlohmann's message (without its "[json.exception...]" tag) for what Python's json
// would refuse too.
Result<JsonLine> parse_json_line(std::string_view line);

}  // namespace trestle::data
