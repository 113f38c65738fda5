#include "convert/bridge/megatron_scheduler.h"

#include <array>
#include <cmath>

namespace trestle {
namespace {

// OptimizerParamScheduler.state_dict()'s keys (megatron-core), in its order.
constexpr std::array<const char*, 10> kKeys = {"max_lr",         "lr_warmup_steps", "num_steps", "lr_decay_style",
                                               "lr_decay_steps", "min_lr",          "start_wd",  "end_wd",
                                               "wd_incr_style",  "wd_incr_steps"};
constexpr std::size_t kMaxEntries = 64;  // a scheduler's state is a handful of scalars

}  // namespace

Result<std::optional<nlohmann::json>> read_megatron_scheduler(const PickleValue* common, const std::string& context) {
  const PickleValue* state = common ? common->get("opt_param_scheduler") : nullptr;
  const char* key = "opt_param_scheduler";
  if (!state && common) {
    state = common->get("lr_scheduler");
    key = "lr_scheduler";
  }
  if (!state || state->is(PickleKind::kNone)) return std::optional<nlohmann::json>{};
  const std::string where = context + ": '" + key + "'";
  if (!state->is(PickleKind::kDict))
    return Status::Error(where + " is " + std::string(kind_name(state->kind)) + ", expected a dict");
  if (state->entries.size() > kMaxEntries)
    return Status::Error(where + " has " + std::to_string(state->entries.size()) + " entries, expected at most " +
                         std::to_string(kMaxEntries));
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [k, v] : state->entries) {
    if (!k->is(PickleKind::kString))
      return Status::Error(where + " has a key of type " + std::string(kind_name(k->kind)) + ", expected strings");
    const std::string& name = k->text;
    if (out.contains(name)) return Status::Error(where + " has the key '" + name + "' twice");
    switch (v->kind) {
      case PickleKind::kNone:
        out[name] = nullptr;
        break;
      case PickleKind::kBool:
        out[name] = v->boolean;
        break;
      case PickleKind::kInt:
        out[name] = v->integer;
        break;
      case PickleKind::kFloat:
        if (!std::isfinite(v->real)) return Status::Error(where + "['" + name + "'] is not a finite number");
        out[name] = v->real;
        break;
      case PickleKind::kString:
        out[name] = v->text;
        break;
      default:
        return Status::Error(where + "['" + name + "'] is " + std::string(kind_name(v->kind)) +
                             ", expected a number, string, bool or None");
    }
  }
  return std::optional<nlohmann::json>(std::move(out));
}

std::vector<std::string> missing_megatron_scheduler_keys(const nlohmann::json& state) {
  std::vector<std::string> missing;
  for (const char* key : kKeys) {
    const auto it = state.is_object() ? state.find(key) : state.end();
    if (it == state.end() || !(it->is_number() || it->is_string())) missing.emplace_back(key);
  }
  return missing;
}

PickleValue* megatron_scheduler_object(PickleDocument& doc, const nlohmann::json& state) {
  std::vector<std::pair<PickleValue*, PickleValue*>> entries;
  for (const char* key : kKeys) {
    const nlohmann::json& v = state.at(key);
    PickleValue* value = v.is_string()           ? doc.string(v.get<std::string>())
                         : v.is_number_integer() ? doc.integer(v.get<std::int64_t>())
                                                 : doc.real(v.get<double>());
    entries.push_back({doc.string(key), value});
  }
  return doc.dict(std::move(entries));
}

}  // namespace trestle
