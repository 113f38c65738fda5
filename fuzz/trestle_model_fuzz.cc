// libFuzzer target: the model description Trestle keeps in torch_dist directories (trestle_model.json) and in
// manifests, read as its readers read it: bridged_model_from_json (the converter), then gpt_spec_from_json on the
// description as given and on the one written back from the bridged model (what `trestle train` does).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ckpt/json_file.h"
#include "convert/bridge/bridge_model_json.h"
#include "parallel/layout/model_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto json =
      trestle::parse_json_text(std::string_view(reinterpret_cast<const char*>(data), size), "trestle_model.json");
  if (!json.ok()) return 0;
  (void)trestle::gpt_spec_from_json(*json, "trestle_model.json");
  auto bridged = trestle::bridged_model_from_json(*json, "trestle_model.json");
  if (bridged.ok()) (void)trestle::gpt_spec_from_json(trestle::bridged_model_to_json(*bridged), "trestle_model.json");
  return 0;
}
