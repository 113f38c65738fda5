// Element copies between Hugging Face tensors and canonical Megatron tensors, following a BridgeTensor's runs:
// gather builds any part of a canonical tensor from the (memory-mapped) Hugging Face tensors, casting on the way.
#pragma once

#include <span>
#include <vector>

#include "ckpt/tensor_view.h"
#include "convert/bridge_plan.h"

namespace trestle {

// Writes canonical elements [offset, offset + count) of `tensor` as `dtype` into out (count elements); sources are
// the plan's hf tensors by index.
Status gather_canonical(const BridgeTensor& tensor, std::int64_t offset, std::int64_t count,
                        const std::vector<ConstTensorView>& sources, DType dtype, std::span<std::byte> out);

// The same for a box of the tensor, row-major within the box.
Status gather_box(const BridgeTensor& tensor, const Box& box, const std::vector<ConstTensorView>& sources, DType dtype,
                  std::span<std::byte> out);

// Tells the kernel the process no longer needs these mapped source bytes (they stay in the page cache), so resident
// memory reflects the working set rather than everything read.
void release_mapped(std::span<const std::byte> bytes);

}  // namespace trestle
