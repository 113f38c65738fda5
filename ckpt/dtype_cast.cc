#include "ckpt/dtype_cast.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace trestle {
namespace {

bool is_castable_float(DType d) {
  return d == DType::kF64 || d == DType::kF32 || d == DType::kF16 || d == DType::kBF16;
}

float bf16_to_f32(std::uint16_t bits) { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

std::uint16_t f32_to_bf16(float f) {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

#ifndef __FLT16_MAX__
// Compilers without _Float16 on this target (clang before 15 on x86; the fuzz build): IEEE half by hand, rounding to
// nearest even from float.
float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = (h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

std::uint16_t f32_to_f16(float f) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u)  // inf or NaN (kept quiet)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u));
  if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds past the largest half
  if (magnitude < 0x38800000u) {  // a half subnormal (or zero): scale into the integer mantissa, round to even
    const float scaled = std::bit_cast<float>(magnitude);
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(scaled * 16777216.0f)));
  }
  const std::uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u) - (112u << 23);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}
#endif

double load(DType dtype, const std::byte* p) {
  switch (dtype) {
    case DType::kF64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::kF32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kF16: {
#ifdef __FLT16_MAX__
      _Float16 v;
      std::memcpy(&v, p, 2);
      return static_cast<double>(v);
#else
      std::uint16_t v;
      std::memcpy(&v, p, 2);
      return f16_to_f32(v);
#endif
    }
    default: {
      std::uint16_t v;
      std::memcpy(&v, p, 2);
      return bf16_to_f32(v);
    }
  }
}

// bf16 and f16 are produced from float, as c10::BFloat16 and c10::Half are (a double rounds to float first), so results
// match torch's casts bit for bit.
void store(DType dtype, double value, std::byte* p) {
  switch (dtype) {
    case DType::kF64:
      std::memcpy(p, &value, 8);
      break;
    case DType::kF32: {
      const float v = static_cast<float>(value);
      std::memcpy(p, &v, 4);
      break;
    }
    case DType::kF16: {
#ifdef __FLT16_MAX__
      const _Float16 v = static_cast<_Float16>(static_cast<float>(value));  // through float, as c10::Half
#else
      const std::uint16_t v = f32_to_f16(static_cast<float>(value));
#endif
      std::memcpy(p, &v, 2);
      break;
    }
    default: {
      const std::uint16_t v = f32_to_bf16(static_cast<float>(value));
      std::memcpy(p, &v, 2);
      break;
    }
  }
}

}  // namespace

bool can_cast(DType from, DType to) { return from == to || (is_castable_float(from) && is_castable_float(to)); }

Status cast_elements(DType from_dtype, std::span<const std::byte> from, DType to_dtype, std::span<std::byte> to) {
  if (!can_cast(from_dtype, to_dtype))
    return Status::Error("cannot cast " + std::string(dtype_name(from_dtype)) + " to " +
                         std::string(dtype_name(to_dtype)));
  const std::size_t count = from.size() / dtype_size(from_dtype);
  if (to.size() != count * dtype_size(to_dtype)) return Status::Error("cast: destination has the wrong size");
  if (from_dtype == to_dtype) {
    if (count) std::memcpy(to.data(), from.data(), from.size());
    return OkStatus();
  }
  const std::size_t in = dtype_size(from_dtype), out = dtype_size(to_dtype);
  for (std::size_t i = 0; i < count; ++i) store(to_dtype, load(from_dtype, from.data() + i * in), to.data() + i * out);
  return OkStatus();
}

}  // namespace trestle
