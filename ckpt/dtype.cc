#include "ckpt/dtype.h"

#include <array>

namespace trestle {
namespace {

struct DTypeInfo {
  DType dtype;
  std::size_t size;
  bool floating;
  std::string_view name;
  std::string_view safetensors;
  std::string_view torch;
};

constexpr std::array<DTypeInfo, 15> kTable = {{
    {DType::kBool, 1, false, "bool", "BOOL", "torch.bool"},
    {DType::kU8, 1, false, "u8", "U8", "torch.uint8"},
    {DType::kI8, 1, false, "i8", "I8", "torch.int8"},
    {DType::kI16, 2, false, "i16", "I16", "torch.int16"},
    {DType::kU16, 2, false, "u16", "U16", "torch.uint16"},
    {DType::kI32, 4, false, "i32", "I32", "torch.int32"},
    {DType::kU32, 4, false, "u32", "U32", "torch.uint32"},
    {DType::kI64, 8, false, "i64", "I64", "torch.int64"},
    {DType::kU64, 8, false, "u64", "U64", "torch.uint64"},
    {DType::kF16, 2, true, "f16", "F16", "torch.float16"},
    {DType::kBF16, 2, true, "bf16", "BF16", "torch.bfloat16"},
    {DType::kF32, 4, true, "f32", "F32", "torch.float32"},
    {DType::kF64, 8, true, "f64", "F64", "torch.float64"},
    {DType::kF8E4M3, 1, true, "f8_e4m3", "F8_E4M3", "torch.float8_e4m3fn"},
    {DType::kF8E5M2, 1, true, "f8_e5m2", "F8_E5M2", "torch.float8_e5m2"},
}};

const DTypeInfo& info(DType dtype) { return kTable[static_cast<std::size_t>(dtype)]; }

// torch spells some types two ways; these aliases are accepted on input only.
constexpr std::array<std::pair<std::string_view, DType>, 8> kAliases = {{
    {"float", DType::kF32},
    {"half", DType::kF16},
    {"double", DType::kF64},
    {"long", DType::kI64},
    {"int", DType::kI32},
    {"short", DType::kI16},
    {"fp16", DType::kF16},
    {"fp32", DType::kF32},
}};

}  // namespace

std::size_t dtype_size(DType dtype) { return info(dtype).size; }
bool is_floating(DType dtype) { return info(dtype).floating; }
std::string_view dtype_name(DType dtype) { return info(dtype).name; }
std::string_view safetensors_name(DType dtype) { return info(dtype).safetensors; }
std::string_view torch_name(DType dtype) { return info(dtype).torch; }

std::optional<DType> dtype_from_safetensors(std::string_view name) {
  for (const auto& entry : kTable)
    if (entry.safetensors == name) return entry.dtype;
  return std::nullopt;
}

std::optional<DType> parse_dtype(std::string_view name) {
  if (name.starts_with("torch.")) name.remove_prefix(6);
  for (const auto& entry : kTable) {
    if (entry.name == name || entry.safetensors == name || entry.torch.substr(6) == name) return entry.dtype;
  }
  for (const auto& [alias, dtype] : kAliases)
    if (alias == name) return dtype;
  return std::nullopt;
}

}  // namespace trestle
