// libFuzzer target: torch.distributed.checkpoint's .metadata pickle through parse_dcp_metadata.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "convert/formats/torch/dcp_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  (void)trestle::parse_dcp_metadata(std::string_view(reinterpret_cast<const char*>(data), size), ".metadata");
  return 0;
}
