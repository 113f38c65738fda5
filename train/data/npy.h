// NumPy .npy files (format 1.0, little-endian integers) as numpy.save writes them, for Megatron's cached indices.
// In memory every array is int64; the file's dtype is one of int16, int32, uint32, int64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle::data {

enum class NpyDType { kInt16, kInt32, kUint32, kInt64 };

struct NpyArray {
  NpyDType dtype = NpyDType::kInt64;
  std::vector<std::size_t> shape;
  std::vector<std::int64_t> values;  // row-major
};

// Writes values (shape's product of them) as dtype, byte-identical to numpy.save. Values must fit the dtype. The file
// is written beside path and renamed over it: whatever was at path (a symbolic link included) is replaced, never
// written through, and a killed write never leaves a partial file under the name.
Status write_npy(const std::string& path, NpyDType dtype, std::span<const std::size_t> shape,
                 std::span<const std::int64_t> values);
// Reads a regular file only: a FIFO or device at path is refused naming it, never waited on.
Result<NpyArray> read_npy(const std::string& path);

}  // namespace trestle::data
