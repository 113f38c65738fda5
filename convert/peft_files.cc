#include "convert/peft_files.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <regex>

#include "ckpt/json_file.h"

namespace trestle {
namespace {

using json = nlohmann::ordered_json;
constexpr std::string_view kPrefix = "base_model.model.";
constexpr std::size_t kMaxTargetPattern = 1 << 16;
constexpr std::uint64_t kMaxConfigBytes = 1 << 24;
constexpr std::string_view kAllLinear = "all-linear";
constexpr int kMaxGroupDepth = 32;
// ".*.*.*.*.*.*.*z" takes seconds on one module's name: each unbounded repetition in a row multiplies the time.
constexpr int kMaxPeftRepetitionsInARow = 3;
// std::regex compiles the terms of an alternative, the groups' inside the enclosing ones', and matches alternatives
// by recursion, a frame each: a pattern with more of them is refused before it can overflow a thread's stack (16,000
// terms overflow 1 MiB, 8,000 alternatives too; under AddressSanitizer 17,500 terms overflow 8 MiB).
constexpr int kMaxTerms = 4000, kMaxAlternatives = 1000;

// A field that must be absent or hold one of the plain-LoRA values.
bool plain(const nlohmann::ordered_json& config, const char* field) {
  const auto it = config.find(field);
  if (it == config.end() || it->is_null()) return true;
  if (it->is_boolean()) return !it->get<bool>();
  if (it->is_string()) return it->get<std::string>() == "none" || it->get<std::string>().empty();
  if (it->is_array() || it->is_object()) return it->empty();
  return false;
}

// init_lora_weights: peft repeats the initialisation when it loads the adapter, and the saved A and B overwrite what
// it gives them, except that PiSSA, CorDA, OLoRA, LoRA-GA and LoftQ also change the base weights (subtracting their
// initial B·A, or quantising), which merging onto the unchanged base would get wrong.
Status check_initialisation(const nlohmann::ordered_json& config, const std::string& where) {
  const auto it = config.find("init_lora_weights");
  if (it == config.end() || !it->is_string()) return OkStatus();
  const std::string init = it->get<std::string>();
  std::string lower = init;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (!init.starts_with("pissa") && !init.starts_with("corda") && lower != "olora" && init != "lora_ga" &&
      init != "loftq")
    return OkStatus();
  return Status::Error(
      where + " = " + it->dump() +
      ": this initialisation changes the base model's weights when peft loads the adapter, so the "
      "adapter does not apply to the unchanged base; save it as a plain LoRA first (peft's save_pretrained "
      "with path_initial_model_for_weight_conversion)");
}

// `text` as a JSON string for a message; a piece cut from a pattern may end inside a UTF-8 character, which is
// replaced rather than thrown on.
std::string quoted(const std::string& text) { return json(text).dump(-1, ' ', false, json::error_handler_t::replace); }

// What makes a regular expression slow for a backtracking matcher (std::regex), read in one pass over its tokens.
struct PatternShape {
  bool nested_repetition = false;  // a repeated group that itself repeats something ((a+)+), or a**: exponential time
  // A group quantified to match more than once ((.|.)*, (.?){30}) whose content can itself match in more than one way
  // (it holds a quantifier or an alternative): its ways multiply at each repetition. (Made optional, as (.*\.)?, it
  // matches at most once: no more than twice the ways.)
  bool ambiguous_repetition = false;
  int deepest_group = 0;           // std::regex compiles and matches groups recursively
  int terms = 0;                   // atoms and groups, their quantifiers aside
  int alternatives = 1;            // the whole's and every group's
  // The most unbounded repetitions (*, +, {n,}, {n,m}) one path passes in a row: time of that power of the name's
  // length (".*.*.*.*.*.*.*z" takes seconds on one module's name).
  int repetitions_in_a_row = 0;
};

// Reads `pattern`'s shape; refuses backreferences and repetition counts over 4 digits (std::regex's compiler reads
// their digits into a long without checking for overflow).
Result<PatternShape> read_pattern_shape(const std::string& pattern, const std::string& where) {
  struct Group {
    bool repeats = false;      // holds a repetition
    bool branches = false;     // holds a quantifier or an alternative: can match one text in more than one way
    int in_row = 0, best = 0;  // this alternative's repetitions in a row so far; the best of its finished ones
  };
  std::vector<Group> groups{Group{}};
  PatternShape shape;
  enum class Last { kNothing, kAtom, kGroup, kQuantifier } last = Last::kNothing;
  Group closed;  // the group just closed, until what follows it is known
  auto count_error = [&](std::size_t i) {
    return Status::Error(where + ": " + quoted(pattern.substr(i, 12)) +
                         ": a repetition count {n}, {n,} or {n,m} of at most 4 digits each is required");
  };
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '*' || c == '+' || c == '?' || c == '{') {
      bool unbounded = c != '?';
      bool several = c != '?';  // lets what it quantifies match more than once (an optional group at most doubles)
      if (c == '{') {
        const std::size_t close = pattern.find('}', i);
        if (close == std::string::npos) return count_error(i);
        const std::string counts = pattern.substr(i + 1, close - i - 1);
        const std::size_t comma = counts.find(',');
        const std::string low = counts.substr(0, comma);
        const std::string high = comma == std::string::npos ? "" : counts.substr(comma + 1);
        if (low.empty() || low.size() > 4 || high.size() > 4 ||
            low.find_first_not_of("0123456789") != std::string::npos ||
            high.find_first_not_of("0123456789") != std::string::npos)
          return count_error(i);
        unbounded = comma != std::string::npos;
        const int least = std::stoi(low);
        const int most = !unbounded ? least : high.empty() ? least + 2 : std::stoi(high);
        several = most > 1;
        i = close;
      }
      if (i + 1 < pattern.size() && pattern[i + 1] == '?') ++i;  // lazy
      const bool repeats = c != '?';
      if (repeats && (last == Last::kQuantifier || (last == Last::kGroup && closed.repeats)))
        shape.nested_repetition = true;
      if (several && last == Last::kGroup && closed.branches) shape.ambiguous_repetition = true;
      groups.back().repeats = groups.back().repeats || repeats;
      groups.back().branches = true;
      if (last == Last::kGroup)
        groups.back().in_row += std::max(std::max(closed.best, closed.in_row), unbounded ? 1 : 0);
      else if (last == Last::kAtom && unbounded) ++groups.back().in_row;
      last = Last::kQuantifier;
      continue;
    }
    if (last == Last::kGroup) groups.back().in_row += std::max(closed.best, closed.in_row);
    last = Last::kAtom;
    if (c != '|' && c != ')') ++shape.terms;
    if (c == '\\') {
      if (i + 1 < pattern.size() && pattern[i + 1] >= '1' && pattern[i + 1] <= '9')
        return Status::Error(where + ": " + quoted(pattern.substr(i, 8)) +
                             ": backreferences are not read in module patterns");
      ++i;
    } else if (c == '[') {  // a class, up to its closing bracket
      while (i + 1 < pattern.size() && pattern[i + 1] != ']') {
        if (pattern[i + 1] == '\\' && i + 2 < pattern.size() && pattern[i + 2] >= '1' && pattern[i + 2] <= '9')
          return Status::Error(where + ": " + quoted(pattern.substr(i + 1, 8)) +
                               ": backreferences are not read in module patterns");
        i += pattern[i + 1] == '\\' ? 2 : 1;
      }
      ++i;
    } else if (c == '(') {
      groups.push_back(Group{});
      shape.deepest_group = std::max<int>(shape.deepest_group, static_cast<int>(groups.size()) - 1);
      if (i + 2 < pattern.size() && pattern[i + 1] == '?' &&
          (pattern[i + 2] == ':' || pattern[i + 2] == '=' || pattern[i + 2] == '!'))
        i += 2;  // (?: (?= (?!
      last = Last::kNothing;
    } else if (c == '|') {
      groups.back().best = std::max(groups.back().best, groups.back().in_row);
      groups.back().in_row = 0;
      groups.back().branches = true;
      ++shape.alternatives;
      last = Last::kNothing;
    } else if (c == ')' && groups.size() > 1) {
      closed = groups.back();
      groups.pop_back();
      groups.back().repeats = groups.back().repeats || closed.repeats;
      groups.back().branches = groups.back().branches || closed.branches;
      last = Last::kGroup;
    }
  }
  if (last == Last::kGroup) groups.back().in_row += std::max(closed.best, closed.in_row);
  for (const Group& g : groups) shape.repetitions_in_a_row = std::max({shape.repetitions_in_a_row, g.best, g.in_row});
  return shape;
}

// Refuses what Python's re (which peft matches with) and ECMAScript (std::regex) read differently, so that a pattern is
// either matched as peft matches it or refused: letter escapes other than \d \D \w \W \s \S \b \B \n \t \r \f \v
// \x \u (Python's \A and \Z are anchors, ECMAScript's a letter or an error), a '[' inside a class (ECMAScript's
// [[:digit:]] is a POSIX class, Python's a '[' in a class), and a ']' first in a class (Python's literal, ECMAScript's
// []: an empty class).
Status check_read_as_python_reads_it(const std::string& pattern, const std::string& where) {
  auto refuse = [&](std::size_t i, const std::string& why) {
    return Status::Error(where + ": " + quoted(pattern.substr(i, 2)) + " at character " + std::to_string(i) + " " +
                         why +
                         ", which Python's re (as peft matches) and ECMAScript read differently; write it without");
  };
  constexpr std::string_view kSameEscapes = "dDwWsSbBntrfvxu";
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[++i];
      if (std::isalpha(static_cast<unsigned char>(next)) && kSameEscapes.find(next) == std::string_view::npos)
        return refuse(i - 1, "is an escape ECMAScript lacks");
    } else if (in_class) {
      if (c == '[') return refuse(i, "opens a bracket inside a class (escape it: \\[)");
      if (c == ']') in_class = false;
    } else if (c == '[') {
      in_class = true;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') ++i;
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') return refuse(i + 1, "is a ']' first in a class");
    }
  }
  return OkStatus();
}

// `key` as PEFT matches a rank_pattern / alpha_pattern key (get_pattern_key): the whole name, or its end after a '.'.
std::string pattern_key_regex(const std::string& key) { return "(?:.*\\.)?(?:" + key + ")"; }

// A regular expression of a PEFT configuration as written (`written`; `key`: a rank_pattern / alpha_pattern key,
// matched as pattern_key_regex), refused when it could take exponential or high polynomial time to match.
Result<std::shared_ptr<const std::regex>> compile_pattern(const std::string& written, const std::string& where,
                                                          bool key = false) {
  if (written.empty() || written.size() > kMaxTargetPattern)
    return Status::Error(where + ": a regular expression of 1 to " + std::to_string(kMaxTargetPattern) +
                         " characters is required");
  TRESTLE_RETURN_IF_ERROR(check_read_as_python_reads_it(written, where));
  TRESTLE_ASSIGN_OR_RETURN(const PatternShape own, read_pattern_shape(written, where));
  if (own.nested_repetition)
    return Status::Error(where + ": " + quoted(written) +
                         " repeats a repetition (as (a+)+ or a**), which can take exponential time to match; "
                         "list the modules or write the expression without nested repetition");
  // (Checked on what was written: the optional prefix a key is matched with, (?:.*\.)?, is unambiguous.)
  if (own.ambiguous_repetition)
    return Status::Error(where + ": " + quoted(written) +
                         " repeats a group that can match in more than one way (as (a|b)*, (a?){30} or (a.*)+), "
                         "which can take exponential time to match; list the modules or write the expression "
                         "without quantifiers or alternatives inside a repeated or optional group");
  const std::string pattern = key ? pattern_key_regex(written) : written;
  TRESTLE_ASSIGN_OR_RETURN(const PatternShape shape, read_pattern_shape(pattern, where));
  if (shape.terms > kMaxTerms || shape.alternatives > kMaxAlternatives)
    return Status::Error(where + ": " + quoted(pattern.substr(0, 64)) + "... has " +
                         (shape.terms > kMaxTerms ? std::to_string(shape.terms) + " terms; at most " +
                                                        std::to_string(kMaxTerms)
                                                  : std::to_string(shape.alternatives) + " alternatives; at most " +
                                                        std::to_string(kMaxAlternatives)) +
                         " are read (list the modules in target_modules instead)");
  if (shape.deepest_group > kMaxGroupDepth)
    return Status::Error(where + ": " + quoted(pattern.substr(0, 64)) + "... nests " +
                         std::to_string(shape.deepest_group) + " groups; at most " + std::to_string(kMaxGroupDepth) +
                         " are read");
  if (shape.repetitions_in_a_row > kMaxPeftRepetitionsInARow)
    return Status::Error(where + ": " + quoted(pattern) + " repeats " + std::to_string(shape.repetitions_in_a_row) +
                         " times in a row (as .*.*.*.*), which can take time of that power of a module name's length "
                         "to match; write it with at most " +
                         std::to_string(kMaxPeftRepetitionsInARow));
  try {
    return std::make_shared<const std::regex>(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return Status::Error(where + ": " + quoted(pattern) +
                         " is not a regular expression Trestle reads (ECMAScript syntax): " + e.what());
  }
}

// rank_pattern (positive integers) or alpha_pattern (positive numbers), in the file's order; each key is matched as
// PEFT's get_pattern_key does: the whole name, or its end after a '.'.
Result<std::vector<PeftAdapterConfig::Pattern>> read_patterns(const nlohmann::ordered_json& config, const char* name,
                                                              const std::string& path, bool integer) {
  auto field = [&](const char* f) { return path + " (" + f + ")"; };
  std::vector<PeftAdapterConfig::Pattern> out;
  const auto it = config.find(name);
  if (it == config.end() || it->is_null()) return out;
  if (!it->is_object()) return Status::Error(field(name) + ": an object of patterns and values is required");
  for (const auto& [key, value] : it->items()) {
    const bool ok = integer ? value.is_number_integer() && value.get<std::int64_t>() > 0
                            : value.is_number() && value.get<double>() > 0 && std::isfinite(value.get<double>());
    if (!ok)
      return Status::Error(field(name) + ": " + json(key).dump() + " gives " + value.dump() + ", not a positive " +
                           (integer ? "integer rank" : "number"));
    TRESTLE_ASSIGN_OR_RETURN(auto regex, compile_pattern(key, field(name) + " " + json(key).dump(), true));
    out.push_back({key, std::move(regex), value.get<double>()});
  }
  return out;
}

double pattern_value(const std::vector<PeftAdapterConfig::Pattern>& patterns, const std::string& name,
                     double otherwise) {
  for (const auto& p : patterns)
    if (std::regex_match(name, *p.regex)) return p.value;
  return otherwise;
}

}  // namespace

bool peft_pattern_readable(const std::string& pattern) { return compile_pattern(pattern, "pattern").ok(); }

bool peft_pattern_key_readable(const std::string& key) { return compile_pattern(key, "pattern", true).ok(); }

bool is_peft_dir(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(std::filesystem::path(dir) / kPeftConfigFile, ec);
}

Result<PeftAdapterConfig> read_peft_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kPeftConfigFile).string();
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::symlink_status(path, ec);
  if (std::filesystem::is_symlink(status))
    return Status::Error(path + ": a symbolic link; the adapter's files must be in its directory");
  if (!std::filesystem::exists(status))
    return Status::Error(path + ": cannot read (" +
                         (ec ? ec.message() : std::make_error_code(std::errc::no_such_file_or_directory).message()) +
                         "); a PEFT adapter directory holds one");
  TRESTLE_ASSIGN_OR_RETURN(const std::string text, read_text_file(path, kMaxConfigBytes));
  return parse_peft_config(text, path);
}

Result<PeftAdapterConfig> parse_peft_config(std::string_view text, const std::string& path) {
  TRESTLE_ASSIGN_OR_RETURN(const json config, parse_ordered_json_text(text, path));
  if (!config.is_object()) return Status::Error(path + ": not a JSON object");
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
  const json no_targets = json::array();
  const auto found_targets = config.find("target_modules");
  const bool untargeted = found_targets == config.end() || found_targets->is_null();
  if (untargeted && !config.contains("target_parameters"))
    return Status::Error(field("target_modules") + ": a list of module names or a regular expression is required");
  const json* targets = untargeted ? &no_targets : &*found_targets;
  if (targets->is_string()) {
    c.target_string = targets->get<std::string>();
    if (c.target_string != kAllLinear) {
      TRESTLE_ASSIGN_OR_RETURN(c.target_regex, compile_pattern(c.target_string, field("target_modules")));
    }
  } else if (!targets->is_array()) {
    return Status::Error(field("target_modules") + ": a list of module names or a regular expression is required");
  }
  for (const auto& t : targets->is_array() ? *targets : json::array()) {
    if (!t.is_string() || t.get<std::string>().empty())
      return Status::Error(field("target_modules") + ": holds " + t.dump() + ", not a module name");
    c.target_modules.push_back(t.get<std::string>());
  }
  const auto parameters = config.find("target_parameters");
  if (parameters != config.end() && !parameters->is_null()) {
    if (!parameters->is_array())
      return Status::Error(field("target_parameters") + ": a list of parameter names is required");
    for (const auto& t : *parameters) {
      if (!t.is_string() || t.get<std::string>().empty())
        return Status::Error(field("target_parameters") + ": holds " + t.dump() + ", not a parameter name");
      c.target_parameters.push_back(t.get<std::string>());
    }
  }
  if (c.target_modules.empty() && c.target_string.empty() && c.target_parameters.empty())
    return Status::Error(field("target_modules") + ": an empty list and no target_parameters");
  TRESTLE_ASSIGN_OR_RETURN(c.rank_pattern, read_patterns(config, "rank_pattern", path, true));
  TRESTLE_ASSIGN_OR_RETURN(c.alpha_pattern, read_patterns(config, "alpha_pattern", path, false));
  // What plain LoRA does not have, each refused by name.
  const std::pair<const char*, const char*> refused[] = {
      {"use_dora", "DoRA's magnitude vectors"},
      {"use_rslora", "rsLoRA's alpha / sqrt(r) scale"},
      {"bias", "trained biases"},
      {"lora_bias", "LoRA biases"},
      {"fan_in_fan_out", "Conv1D (fan_in_fan_out) weights"},
      {"modules_to_save", "fully trained modules (modules_to_save)"},
      {"layer_replication", "layers stacked from copies of the base's (layer_replication)"},
      {"exclude_modules", "modules excluded from the targets (exclude_modules)"},
      {"trainable_token_indices", "trainable tokens"},
  };
  for (const auto& [name, what] : refused)
    if (!plain(config, name))
      return Status::Error(field(name) + " = " + config[name].dump() + ": " + what +
                           " cannot be mapped onto Trestle's LoRA adapters");
  // An aLoRA adapter acts only after its invocation tokens (peft cannot merge it either).
  if (const auto alora = config.find("alora_invocation_tokens"); alora != config.end() && !alora->is_null())
    return Status::Error(field("alora_invocation_tokens") + " = " + alora->dump() +
                         ": an activated LoRA (aLoRA), which adapts only the tokens after its invocation, cannot be "
                         "mapped onto Trestle's LoRA adapters");
  if (const auto layers = config.find("layers_to_transform"); layers != config.end() && !layers->is_null()) {
    const auto index = [&](const nlohmann::ordered_json& v) -> Result<std::int64_t> {
      if (!v.is_number_integer() || v.get<std::int64_t>() < 0)
        return Status::Error(field("layers_to_transform") + ": holds " + v.dump() + ", not a layer index");
      return v.get<std::int64_t>();
    };
    if (layers->is_array()) {
      for (const auto& v : *layers) {
        TRESTLE_ASSIGN_OR_RETURN(const std::int64_t i, index(v));
        c.layers_to_transform.push_back(i);
      }
    } else {
      TRESTLE_ASSIGN_OR_RETURN(const std::int64_t i, index(*layers));
      c.layers_to_transform.push_back(i);
    }
  }
  TRESTLE_RETURN_IF_ERROR(check_initialisation(config, field("init_lora_weights")));
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
  if (!c.target_string.empty()) j["target_modules"] = c.target_string;
  else if (!c.target_modules.empty() || c.target_parameters.empty()) j["target_modules"] = c.target_modules;
  else j["target_modules"] = nullptr;
  if (!c.target_parameters.empty()) j["target_parameters"] = c.target_parameters;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["rank_pattern"] = nlohmann::ordered_json::object();
  for (const auto& p : c.rank_pattern) j["rank_pattern"][p.key] = static_cast<std::int64_t>(p.value);
  j["alpha_pattern"] = nlohmann::ordered_json::object();
  for (const auto& p : c.alpha_pattern) j["alpha_pattern"][p.key] = p.value;
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

bool peft_targets_parameter(const PeftAdapterConfig& c, const std::string& name) {
  return peft_targets(c.target_parameters, name);
}

std::int64_t peft_rank(const PeftAdapterConfig& c, const std::string& name) {
  return static_cast<std::int64_t>(pattern_value(c.rank_pattern, name, static_cast<double>(c.r)));
}

double peft_alpha(const PeftAdapterConfig& c, const std::string& name) {
  return pattern_value(c.alpha_pattern, name, c.alpha);
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
