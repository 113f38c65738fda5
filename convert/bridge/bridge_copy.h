// Element copies between Hugging Face tensors and canonical Megatron tensors, following a BridgeTensor's runs:
// gather builds any part of a canonical tensor from the Hugging Face tensors (mapped or cached), casting on the way.
#pragma once

#include <span>
#include <vector>

#include "ckpt/tensor_view.h"
#include "convert/bridge/bridge_plan.h"

namespace trestle {

// Writes canonical elements [offset, offset + count) of `tensor` as `dtype` into out (count elements); sources are
// the plan's hf tensors by index.
Status gather_canonical(const BridgeTensor& tensor, std::int64_t offset, std::int64_t count,
                        const std::vector<ConstTensorView>& sources, DType dtype, std::span<std::byte> out);

// The same for a box of the tensor, row-major within the box.
Status gather_box(const BridgeTensor& tensor, const Box& box, const std::vector<ConstTensorView>& sources, DType dtype,
                  std::span<std::byte> out);

// Adds `shift` to each element of `in` (of floating `from`) and writes the sums as `to` into out, each rounded once.
Status shift_and_cast(DType from, std::span<const std::byte> in, double shift, DType to, std::span<std::byte> out);

// For each canonical tensor of the plan, the distinct hf indices its runs read (what to load before gathering it).
std::vector<std::vector<std::size_t>> hf_sources_per_tensor(const BridgePlan& plan);

}  // namespace trestle
