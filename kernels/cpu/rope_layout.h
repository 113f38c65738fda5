// Where RoPE's heads lie in memory: head k of row r starts r · row + (k / group_heads) · group + (k % group_heads) ·
// head_dim elements in, each head's head_dim elements contiguous. Contiguous [rows, heads, head_dim] tensors are one
// group of every head; a fused projection's query heads (a group's query heads, then its key and value heads, group
// after group: Megatron's qkv) are read where they lie, and its gradient written there.
#pragma once

#include <cstdint>

#include "kernels/cpu/host_device_qualifier.h"  // head() runs in the CUDA kernels too

namespace trestle::kernels {

struct RopeLayout {
  std::int64_t row = 0;          // elements from one row's first head to the next's
  std::int64_t group = 0;        // elements from one group's first head to the next's
  std::int64_t group_heads = 1;  // heads of a group (consecutive, head_dim apart)

  static RopeLayout contiguous(std::int64_t heads, std::int64_t head_dim) {
    return {heads * head_dim, heads * head_dim, heads > 0 ? heads : 1};
  }
  TRESTLE_HOST_DEVICE std::int64_t head(std::int64_t r, std::int64_t k, std::int64_t head_dim) const {
    return r * row + (k / group_heads) * group + (k % group_heads) * head_dim;
  }
};

}  // namespace trestle::kernels
