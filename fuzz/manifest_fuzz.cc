// libFuzzer target: a Trestle manifest.json, through the strict JSON reader and manifest_from_json (which checks
// names, dtypes, shapes, chunk boxes, flat ranges and exact coverage).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ckpt/json_file.h"
#include "ckpt/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto json = trestle::parse_json_text(std::string_view(reinterpret_cast<const char*>(data), size), "manifest.json");
  if (json.ok()) (void)trestle::manifest_from_json(*json, "manifest.json");
  return 0;
}
