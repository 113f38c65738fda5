// libFuzzer target: a PEFT adapter_config.json through parse_peft_config, then its target, rank and alpha patterns
// matched against module names as an import matches them (a hostile pattern must be refused, not run for minutes).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "convert/peft_files.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto config =
      trestle::parse_peft_config(std::string_view(reinterpret_cast<const char*>(data), size), "adapter_config.json");
  if (!config.ok()) return 0;
  for (const std::string name : {"model.layers.0.self_attn.q_proj", "model.layers.17.mlp.experts.gate_up_proj",
                                 "model.language_model.layers.12.self_attn.q_proj",
                                 "model.vision_tower.vision_model.encoder.layers.26.self_attn.out_proj"}) {
    (void)trestle::peft_targets(*config, name);
    (void)trestle::peft_targets_parameter(*config, name);
    (void)trestle::peft_rank(*config, name);
    (void)trestle::peft_alpha(*config, name);
  }
  (void)trestle::peft_config_json(*config).dump();
  return 0;
}
