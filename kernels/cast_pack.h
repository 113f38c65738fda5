// Cast-and-pack on at::Tensor, the staging copy of a checkpoint save (ckpt/torch_async_save.h's TensorPacker): what
// destinations[i].copy_(sources[i]) does for every i, in one pass over the whole list. Each source (any strides, up to
// 8 dims, on the CPU or a GPU) has its elements written in row-major order, cast to its destination's dtype (round to
// nearest even, as ATen casts), into its destination: a contiguous tensor of as many elements, any shape, on the CPU
// (for a GPU source: pinned host memory, the staging pool) or on the source's device.
//
// CPU sources run the CPU build chosen for this CPU (kernels/cpu_table.h) over at most `threads` threads (0: ATen's
// number; at::parallel_for's pool caps it). GPU sources, in a build with the CUDA kernels, run one kernel launch per
// device on that device's current stream and are not waited for (as copy_ with non_blocking): the caller synchronizes
// the stream before reading the destinations. Pairs the kernels do not take go through copy_ itself: a cast other than
// between float, bfloat16 and half, more than 8 dims, a GPU destination the device cannot write (pageable host
// memory), or a GPU source in a build without CUDA kernels. Errors throw c10::Error, as copy_'s do.
#pragma once

#include <ATen/Tensor.h>

#include <span>

namespace trestle::kernels {

void cast_pack(std::span<const at::Tensor> sources, std::span<const at::Tensor> destinations, unsigned threads = 0);

}  // namespace trestle::kernels
