// Element copies between Hugging Face tensors and canonical Megatron tensors, following a BridgeTensor's runs:
// gather builds any part of a canonical tensor from the Hugging Face tensors (mapped or cached), casting on the way.
#pragma once

#include <span>
#include <vector>

#include "ckpt/io_options.h"
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

// For each canonical tensor of the plan, the distinct hf indices its runs read (what to load before gathering it).
std::vector<std::vector<std::size_t>> hf_sources_per_tensor(const BridgePlan& plan);

// Reading a checkpoint tensor by tensor: small I/O staging and bounce buffers, so memory stays near the largest tensor.
inline constexpr std::uint64_t kReadBufferBytes = 32ull << 20;
inline constexpr std::uint64_t kReadStagingBytes = 2 * 16ull << 20;  // two open files x 16 requests of 1 MiB
IoOptions streaming_read_options();

// Tells the kernel the process no longer needs these mapped source bytes (they stay in the page cache), so resident
// memory reflects the working set rather than everything read.
void release_mapped(std::span<const std::byte> bytes);

}  // namespace trestle
