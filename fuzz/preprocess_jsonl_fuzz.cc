// libFuzzer target: the JSON-lines input of `trestle preprocess` through read_documents, which splits it into lines
// and reads each one's "text" key (a string or a list of strings), as the preprocessing pass does for each batch.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "train/data/preprocess.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  trestle::data::PreprocessOptions options;
  options.input = "input.jsonl";
  (void)trestle::data::read_documents(std::string_view(reinterpret_cast<const char*>(data), size), /*json=*/true,
                                      /*first_line=*/1, options, /*workers=*/1);
  return 0;
}
