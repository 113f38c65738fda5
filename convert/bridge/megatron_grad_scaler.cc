#include "convert/bridge/megatron_grad_scaler.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <utility>

#include "ckpt/dtype_cast.h"

namespace trestle {

Result<std::optional<nlohmann::json>> read_megatron_grad_scaler(const PickleValue* value,
                                                                const TorchSaveArchive& archive,
                                                                const std::string& context) {
  const std::string where = context + ": 'grad_scaler'";
  if (!value || value->is(PickleKind::kNone)) return std::optional<nlohmann::json>();
  if (!value->is(PickleKind::kDict))
    return Status::Error(where + " is " + std::string(kind_name(value->kind)) + ", expected a dict");
  if (value->entries.empty()) return std::optional<nlohmann::json>();  // ConstantGradScaler
  const PickleValue* scale = value->get("scale");
  if (!scale) return Status::Error(where + " has no 'scale' (DynamicGradScaler's state has one)");
  double s = 0;
  if (scale->is(PickleKind::kFloat) || scale->is(PickleKind::kInt)) {
    s = scale->is(PickleKind::kFloat) ? scale->real : static_cast<double>(scale->integer);
  } else {
    TRESTLE_ASSIGN_OR_RETURN(const auto tensor, archive.tensor(scale, "grad_scaler.scale"));
    if (!tensor || numel(tensor->shape) != 1 ||
        (tensor->dtype != DType::kF32 && tensor->dtype != DType::kF64 && tensor->dtype != DType::kF16 &&
         tensor->dtype != DType::kBF16))
      return Status::Error(where + " 'scale' is " + pickle_repr(scale) + ", expected a one-element float tensor");
    std::vector<std::byte> raw(dtype_size(tensor->dtype));
    archive.copy_tensor(*tensor, raw.data());
    std::vector<std::byte> wide(sizeof(double));
    TRESTLE_RETURN_IF_ERROR(cast_elements(tensor->dtype, raw, DType::kF64, wide).with_context(where + " 'scale'"));
    std::memcpy(&s, wide.data(), sizeof s);
  }
  if (!std::isfinite(s) || s <= 0)
    return Status::Error(where + " 'scale' is " + std::to_string(s) + ", expected a finite positive number");
  nlohmann::json out = {{"scale", s}};
  // (the hysteresis tracker goes below 0 while overflows go on: Megatron decrements it on each and halves at <= 0)
  for (const auto& [key, min] : {std::pair<const char*, std::int64_t>{"growth_tracker", 0},
                                 std::pair<const char*, std::int64_t>{"hysteresis_tracker", INT64_MIN}}) {
    const PickleValue* v = value->get(key);
    if (!v || !v->is(PickleKind::kInt) || v->integer < min)
      return Status::Error(where + " '" + key + "' is " + (v ? pickle_repr(v) : std::string("missing")) +
                           (min == 0 ? ", expected a non-negative int" : ", expected an int"));
    out[key] = v->integer;
  }
  return std::optional<nlohmann::json>(std::move(out));
}

bool is_megatron_grad_scaler_state(const nlohmann::json& state) {
  if (!state.is_object()) return false;
  const auto scale = state.find("scale");
  if (scale == state.end() || !scale->is_number() || !(scale->get<double>() > 0) ||
      !std::isfinite(scale->get<double>()))
    return false;
  const auto growth = state.find("growth_tracker"), hysteresis = state.find("hysteresis_tracker");
  return growth != state.end() && growth->is_number_integer() && growth->get<std::int64_t>() >= 0 &&
         hysteresis != state.end() && hysteresis->is_number_integer();
}

PickleValue* megatron_grad_scaler_object(PickleDocument& doc, const nlohmann::json& state,
                                         std::vector<std::string>& storages) {
  const float scale = static_cast<float>(state.at("scale").get<double>());
  std::string bytes(sizeof scale, '\0');
  std::memcpy(bytes.data(), &scale, sizeof scale);
  PickleValue* tensor = torch_tensor_value(doc, DType::kF32, Shape{1}, storages.size());
  storages.push_back(std::move(bytes));
  return doc.dict(
      {{doc.string("scale"), tensor},
       {doc.string("growth_tracker"), doc.integer(state.at("growth_tracker").get<std::int64_t>())},
       {doc.string("hysteresis_tracker"), doc.integer(state.at("hysteresis_tracker").get<std::int64_t>())}});
}

}  // namespace trestle
