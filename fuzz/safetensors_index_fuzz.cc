// libFuzzer target: a sharded Hugging Face checkpoint's model.safetensors.index.json through
// parse_safetensors_index, the strict JSON reader and the weight map's rules SafetensorsCheckpoint::open applies.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "convert/formats/safetensors/safetensors_checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  (void)trestle::parse_safetensors_index(std::string_view(reinterpret_cast<const char*>(data), size),
                                         "model.safetensors.index.json");
  return 0;
}
