// libFuzzer target: a safetensors file's first bytes (8-byte length + JSON header) as parse_safetensors_header sees
// them.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "convert/formats/safetensors/safetensors_header.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  (void)trestle::parse_safetensors_header(bytes, size);
  return 0;
}
