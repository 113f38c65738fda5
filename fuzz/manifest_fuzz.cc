// libFuzzer target: a Trestle manifest.json's text through manifest_from_text: the strict JSON reader, the manifest's
// own checksum when it has one, and manifest_from_json (names, dtypes, shapes, chunk boxes, flat ranges and exact
// coverage).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ckpt/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  (void)trestle::manifest_from_text(std::string_view(reinterpret_cast<const char*>(data), size), "manifest.json");
  return 0;
}
