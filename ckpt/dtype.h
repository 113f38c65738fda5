// Element types of checkpoint tensors, with their sizes and their names in safetensors, torch and our manifest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace trestle {

enum class DType : std::uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kI32,
  kU32,
  kI64,
  kU64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,
  kF8E5M2,
};

inline constexpr DType kAllDTypes[] = {
    DType::kBool, DType::kU8,  DType::kI8,   DType::kI16, DType::kU16, DType::kI32,    DType::kU32,    DType::kI64,
    DType::kU64,  DType::kF16, DType::kBF16, DType::kF32, DType::kF64, DType::kF8E4M3, DType::kF8E5M2,
};

std::size_t dtype_size(DType dtype);
bool is_floating(DType dtype);
std::string_view dtype_name(DType dtype);        // our name, used in manifests and tables: "bf16"
std::string_view safetensors_name(DType dtype);  // "BF16"
std::string_view torch_name(DType dtype);        // "torch.bfloat16"

// Accepts our names, safetensors names and torch names (with or without "torch.").
std::optional<DType> parse_dtype(std::string_view name);
std::optional<DType> dtype_from_safetensors(std::string_view name);

}  // namespace trestle
