#include "convert/peft_files.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

namespace trestle {
namespace {

using json = nlohmann::json;
constexpr std::string_view kPrefix = "base_model.model.";
constexpr std::size_t kMaxTargetPattern = 1 << 16;
constexpr std::string_view kAllLinear = "all-linear";

// A field that must be absent or hold one of the plain-LoRA values.
bool plain(const json& config, const char* field) {
  const auto it = config.find(field);
  if (it == config.end() || it->is_null()) return true;
  if (it->is_boolean()) return !it->get<bool>();
  if (it->is_string()) return it->get<std::string>() == "none" || it->get<std::string>().empty();
  if (it->is_array() || it->is_object()) return it->empty();
  return false;
}

// Whether `pattern` repeats a group that itself repeats something ("(a+)+", "(.*)*"): backtracking through it can
// take time exponential in a module name's length. Such a pattern is refused rather than run.
bool nested_repetition(const std::string& pattern) {
  std::vector<bool> repeats{false};  // per open group (and the whole): whether it holds a repetition
  bool closed_repeating = false;     // the group just closed held one
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    const bool quantifier = c == '*' || c == '+' || c == '{';
    if (quantifier && closed_repeating) return true;
    closed_repeating = false;
    if (c == '\\') {
      ++i;
    } else if (c == '[') {  // a class: up to its closing bracket
      while (i + 1 < pattern.size() && pattern[i + 1] != ']') i += pattern[i + 1] == '\\' ? 2 : 1;
      ++i;
    } else if (c == '(') {
      repeats.push_back(false);
    } else if (c == ')' && repeats.size() > 1) {
      closed_repeating = repeats.back();
      repeats.pop_back();
      repeats.back() = repeats.back() || closed_repeating;
    } else if (quantifier) {
      repeats.back() = true;
    }
  }
  return false;
}

}  // namespace

bool is_peft_dir(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(std::filesystem::path(dir) / kPeftConfigFile, ec);
}

Result<PeftAdapterConfig> read_peft_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kPeftConfigFile).string();
  std::error_code ec;
  if (std::filesystem::is_symlink(path, ec))
    return Status::Error(path + ": a symbolic link; the adapter's files must be in its directory");
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) return Status::Error(path + ": cannot read (" + ec.message() + "); a PEFT adapter directory holds one");
  if (size > (1u << 24)) return Status::Error(path + ": " + std::to_string(size) + " bytes is not an adapter config");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const json config = json::parse(text.str(), nullptr, false);
  if (config.is_discarded() || !config.is_object()) return Status::Error(path + ": not a JSON object");
  auto field = [&](const char* name) { return path + " (" + name + ")"; };
  if (const auto type = config.find("peft_type"); type == config.end() || *type != "LORA")
    return Status::Error(field("peft_type") + ": only LORA adapters are read, not " +
                         (type == config.end() ? std::string("none") : type->dump()));
  PeftAdapterConfig c;
  const auto r = config.find("r");
  if (r == config.end() || !r->is_number_integer() || r->get<std::int64_t>() <= 0)
    return Status::Error(field("r") + ": a positive integer rank is required");
  c.r = r->get<std::int64_t>();
  const auto alpha = config.find("lora_alpha");
  if (alpha == config.end() || !alpha->is_number() || !(alpha->get<double>() > 0) ||
      !std::isfinite(alpha->get<double>()))
    return Status::Error(field("lora_alpha") + ": a positive number is required");
  c.alpha = alpha->get<double>();
  if (const auto dropout = config.find("lora_dropout"); dropout != config.end() && !dropout->is_null()) {
    if (!dropout->is_number() || !(dropout->get<double>() >= 0 && dropout->get<double>() < 1))
      return Status::Error(field("lora_dropout") + ": a number in [0, 1) is required");
    c.dropout = dropout->get<double>();
  }
  const auto targets = config.find("target_modules");
  if (targets == config.end() || targets->is_null())
    return Status::Error(field("target_modules") + ": a list of module names or a regular expression is required");
  if (targets->is_string()) {
    c.target_string = targets->get<std::string>();
    if (c.target_string.empty() || c.target_string.size() > kMaxTargetPattern)
      return Status::Error(field("target_modules") + ": a regular expression of 1 to " +
                           std::to_string(kMaxTargetPattern) + " characters is required");
    if (c.target_string != kAllLinear) {
      if (nested_repetition(c.target_string))
        return Status::Error(field("target_modules") + ": " + json(c.target_string).dump() +
                             " repeats a group that repeats (as (a+)+), which can take exponential time to match; "
                             "list the modules or write the expression without nested repetition");
      try {
        c.target_regex = std::make_shared<const std::regex>(c.target_string, std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        return Status::Error(field("target_modules") + ": " + json(c.target_string).dump() +
                             " is not a regular expression Trestle reads (ECMAScript syntax): " + e.what());
      }
    }
  } else if (!targets->is_array() || targets->empty()) {
    return Status::Error(field("target_modules") + ": an empty list");
  }
  for (const json& t : targets->is_array() ? *targets : json::array()) {
    if (!t.is_string() || t.get<std::string>().empty())
      return Status::Error(field("target_modules") + ": holds " + t.dump() + ", not a module name");
    c.target_modules.push_back(t.get<std::string>());
  }
  // What plain LoRA does not have, each refused by name.
  const std::pair<const char*, const char*> refused[] = {
      {"use_dora", "DoRA's magnitude vectors"},
      {"use_rslora", "rsLoRA's alpha / sqrt(r) scale"},
      {"bias", "trained biases"},
      {"lora_bias", "LoRA biases"},
      {"fan_in_fan_out", "Conv1D (fan_in_fan_out) weights"},
      {"modules_to_save", "fully trained modules (modules_to_save)"},
      {"rank_pattern", "per-module ranks (rank_pattern)"},
      {"alpha_pattern", "per-module alphas (alpha_pattern)"},
      {"layers_to_transform", "a subset of layers (layers_to_transform)"},
      {"target_parameters", "LoRA on fused expert parameters (target_parameters)"},
      {"trainable_token_indices", "trainable tokens"},
  };
  for (const auto& [name, what] : refused)
    if (!plain(config, name))
      return Status::Error(field(name) + " = " + config[name].dump() + ": " + what +
                           " cannot be mapped onto Trestle's LoRA adapters");
  if (const auto base = config.find("base_model_name_or_path"); base != config.end() && base->is_string())
    c.base_model = base->get<std::string>();
  return c;
}

nlohmann::ordered_json peft_config_json(const PeftAdapterConfig& c) {
  nlohmann::ordered_json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = c.base_model;
  j["r"] = c.r;
  j["lora_alpha"] = c.alpha;
  j["lora_dropout"] = c.dropout;
  if (c.target_string.empty()) j["target_modules"] = c.target_modules;
  else j["target_modules"] = c.target_string;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["rank_pattern"] = json::object();
  j["alpha_pattern"] = json::object();
  return j;
}

bool peft_targets(const std::vector<std::string>& targets, const std::string& name) {
  for (const std::string& t : targets)
    if (name == t || (name.size() > t.size() && name.ends_with(t) && name[name.size() - t.size() - 1] == '.'))
      return true;
  return false;
}

bool peft_targets(const PeftAdapterConfig& c, const std::string& name) {
  if (c.target_string.empty()) return peft_targets(c.target_modules, name);
  if (!c.target_regex) return c.target_string == kAllLinear;
  return std::regex_match(name, *c.target_regex);
}

std::string peft_key(const std::string& module, bool a) {
  return std::string(kPrefix) + module + (a ? ".lora_A.weight" : ".lora_B.weight");
}

std::optional<PeftKey> parse_peft_key(const std::string& key) {
  if (!key.starts_with(kPrefix)) return std::nullopt;
  for (const bool a : {true, false}) {
    const std::string_view suffix = a ? ".lora_A.weight" : ".lora_B.weight";
    if (key.ends_with(suffix) && key.size() > kPrefix.size() + suffix.size())
      return PeftKey{key.substr(kPrefix.size(), key.size() - kPrefix.size() - suffix.size()), a};
  }
  return std::nullopt;
}

}  // namespace trestle
