// Megatron's learning-rate scheduler state: what OptimizerParamScheduler.state_dict() returns and Megatron-LM keeps in
// a checkpoint's common state as 'opt_param_scheduler' (older ones: 'lr_scheduler'). Megatron-LM's load_checkpoint
// reads it beside the optimizer and stops when it is missing, so a torch_dist checkpoint written with optimizer state
// carries it. Trestle's trainer records its schedule under the same keys (LrSchedule::state()), so the state travels
// as JSON through Trestle checkpoints (their "training" -> "scheduler"). Pure functions; no I/O.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "convert/formats/torch/pickle_value.h"

namespace trestle {

// The scheduler state in `common` (a checkpoint's common state dict) as JSON, or none when it keeps none. Its values
// must be numbers, strings, booleans or None; anything else is an error naming `context` and the key.
Result<std::optional<nlohmann::json>> read_megatron_scheduler(const PickleValue* common, const std::string& context);

// The keys of Megatron's state_dict() that `state` lacks (or holds as something other than a number or string).
std::vector<std::string> missing_megatron_scheduler_keys(const nlohmann::json& state);

// The state as the pickled dict Megatron saves (ints, floats and strings as JSON holds them); call only when
// missing_megatron_scheduler_keys(state) is empty. Keys beyond Megatron's are left out.
PickleValue* megatron_scheduler_object(PickleDocument& doc, const nlohmann::json& state);

}  // namespace trestle
