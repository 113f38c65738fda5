// A Hugging Face PEFT LoRA adapter directory: adapter_config.json (rank, alpha, target modules, base model) and
// adapter_model.safetensors with base_model.model.<module>.lora_A.weight [r, in] and .lora_B.weight [out, r] per
// adapted linear; a fused expert parameter [E, ...] (target_parameters) has one ParamWrapper's lora_A [E·r, in] and
// lora_B [out, r·E]. read_peft_config() accepts only what maps exactly onto Trestle's adapters (plain LoRA: no DoRA,
// rsLoRA, biases, modules_to_save, layer_replication, aLoRA, initialisations that change the base weights such as
// PiSSA) and refuses the rest by name; target_modules may be a list or a regular expression (as PEFT writes for a model
// where a list would select too much); rank_pattern and alpha_pattern give some modules their own rank and alpha.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

inline constexpr const char* kPeftConfigFile = "adapter_config.json";
inline constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";

struct PeftAdapterConfig {
  std::int64_t r = 0;
  double alpha = 0;
  double dropout = 0;
  std::vector<std::string> target_modules;  // module names or their last components, as PEFT matches them
  // Or target_modules as one string: a regular expression PEFT full-matches against each module's name, or PEFT's
  // "all-linear" (every linear but the output layer); target_modules is then empty.
  std::string target_string;
  std::shared_ptr<const std::regex> target_regex;  // target_string compiled (not for all-linear)
  std::string base_model;                          // base_model_name_or_path
  // Fused parameters PEFT adapts (target_parameters): their names or endings, as PEFT matches them.
  std::vector<std::string> target_parameters;
  // rank_pattern / alpha_pattern: a regular expression PEFT matches against the end of a module's (or parameter's)
  // name, at a component boundary, and the rank or alpha it gives there; in the file's order, the first match wins.
  struct Pattern {
    std::string key;
    std::shared_ptr<const std::regex> regex;
    double value = 0;
  };
  std::vector<Pattern> rank_pattern, alpha_pattern;
  // layers_to_transform: the layer indices adapted (an int is one); empty: every layer. Trestle's adapters are on every
  // decoder layer, so the import takes a list only where it names them all.
  std::vector<std::int64_t> layers_to_transform;
};

// Whether read_peft_config reads `pattern` as a regular expression of target_modules: one std::regex can match in
// bounded time and stack (no nested repetition, no repeated or optional group that can itself match in more than one
// way, at most three unbounded repetitions in a row, groups at most 32 deep,
// at most 4000 terms and 1000 alternatives in all, no backreferences).
bool peft_pattern_readable(const std::string& pattern);
// Whether it reads `key` as a key of rank_pattern / alpha_pattern (matched as "(?:.*\\.)?(?:key)").
bool peft_pattern_key_readable(const std::string& key);

// Whether `dir` holds an adapter_config.json.
bool is_peft_dir(const std::string& dir);
// Reads and checks DIR/adapter_config.json; errors name the file and the field.
Result<PeftAdapterConfig> read_peft_config(const std::string& dir);
// The same checks of an adapter_config.json's text, read from `path`.
Result<PeftAdapterConfig> parse_peft_config(std::string_view text, const std::string& path);
nlohmann::ordered_json peft_config_json(const PeftAdapterConfig& config);

// Whether PEFT's target list selects module `name` (equal, or ending in "." + target).
bool peft_targets(const std::vector<std::string>& targets, const std::string& name);
// Whether the configuration's targets select module `name` (a linear of the model): the list as above, the regular
// expression matching all of the name, or all-linear.
bool peft_targets(const PeftAdapterConfig& config, const std::string& name);

// Whether target_parameters selects fused parameter `name` (equal, or ending in "." + an entry).
bool peft_targets_parameter(const PeftAdapterConfig& config, const std::string& name);
// The rank and alpha of module (or parameter) `name`: rank_pattern's and alpha_pattern's, else r and lora_alpha.
std::int64_t peft_rank(const PeftAdapterConfig& config, const std::string& name);
double peft_alpha(const PeftAdapterConfig& config, const std::string& name);

// "base_model.model.<module>.lora_A.weight" (a) or ".lora_B.weight".
std::string peft_key(const std::string& module, bool a);
struct PeftKey {
  std::string module;
  bool a = true;
};
// The module and matrix of a PEFT LoRA key; nullopt for anything else.
std::optional<PeftKey> parse_peft_key(const std::string& key);

}  // namespace trestle
