// Megatron's fp16 loss scaler state: what DynamicGradScaler.state_dict() returns ({'scale': a float32 tensor of one
// element, 'growth_tracker': int, 'hysteresis_tracker': int}; ConstantGradScaler's is {}) and Megatron-Core saves
// beside an fp16 optimizer's state: in model space under common.pt's 'optimizer' -> 'grad_scaler', with the
// distributed optimizer's dp_reshardable buffers as each data-parallel group's 'grad_scaler' object. Trestle's trainer
// keeps the same three numbers (LossScaler::state()) as its training's "loss_scaler". Pure functions; no I/O.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/status.h"
#include "convert/formats/torch/pickle_value.h"
#include "convert/formats/torch/torch_save.h"

namespace trestle {

// The state `value` (a node of `archive`) holds, as {"scale", "growth_tracker", "hysteresis_tracker"}; nullopt for a
// constant scaler's {}. The scale is a finite positive number or a one-element floating tensor, the trackers
// ints (the growth tracker non-negative; the hysteresis tracker goes negative while overflows go on); anything else is
// an error naming `context`.
Result<std::optional<nlohmann::json>> read_megatron_grad_scaler(const PickleValue* value,
                                                                const TorchSaveArchive& archive,
                                                                const std::string& context);

// Whether `state` (a Trestle checkpoint's training "loss_scaler") is a dynamic scaler's state Megatron can hold.
bool is_megatron_grad_scaler_state(const nlohmann::json& state);

// The dict DynamicGradScaler.state_dict() returns for `state` (is_megatron_grad_scaler_state), in `doc`; the scale's
// storage (4 bytes) is appended to `storages`, the records of the torch.save archive the dict goes into.
PickleValue* megatron_grad_scaler_object(PickleDocument& doc, const nlohmann::json& state,
                                         std::vector<std::string>& storages);

}  // namespace trestle
