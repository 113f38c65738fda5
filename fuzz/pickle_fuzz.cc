// libFuzzer target: a pickle (torch.save's data.pkl, DCP's .metadata, Megatron's common.pt) through parse_pickle.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "convert/formats/torch/pickle_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  (void)trestle::parse_pickle(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
