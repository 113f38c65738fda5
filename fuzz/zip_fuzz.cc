// libFuzzer target: a torch.save zip archive through ZipArchive::parse, then every entry read (and CRC-checked).
#include <cstddef>
#include <cstdint>
#include <span>

#include "convert/formats/torch/torch_zip.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto zip = trestle::ZipArchive::parse(std::span(reinterpret_cast<const std::byte*>(data), size), "fuzz.pt");
  if (!zip.ok()) return 0;
  for (const auto& entry : zip->entries()) (void)zip->read(entry);
  return 0;
}
