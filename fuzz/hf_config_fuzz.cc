// libFuzzer target: a Hugging Face config.json, through the strict JSON reader and parse_hf_config.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ckpt/json_file.h"
#include "convert/bridge/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto json = trestle::parse_json_text(std::string_view(reinterpret_cast<const char*>(data), size), "config.json");
  if (json.ok()) (void)trestle::parse_hf_config(*json, "config.json");
  return 0;
}
