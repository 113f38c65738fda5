// Asynchronous save of at::Tensors through AsyncSaver (async_saver.h): each tensor's elements are packed into the
// saver's pool in row-major order, cast to the stored dtype. CPU tensors are staged on the saver's copy threads;
// tensors on an accelerator (CUDA) are packed device-to-host on a side stream of their device, ordered after the work
// already queued on the device's current stream, into the pool (pinned when the saver was made with
// torch_pool_allocator()), while the CPU tensors are packed. save_tensors_async returns once every byte is in the pool,
// so training may update the tensors right away.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <optional>
#include <span>
#include <string>

#include "ckpt/async_saver.h"

namespace trestle {

// One piece of a global tensor held by this rank, as save.h's SaveItem, with its elements in a tensor: piece.numel()
// of them, in row-major order (any strides: a transposed or sliced view is packed, not refused), on any device.
struct TorchSaveItem {
  std::string name;
  Shape global_shape;
  Piece piece;
  at::Tensor tensor;
  // The dtype stored, when not the tensor's: a cast between floating-point dtypes (fp32 master weights saved as bf16),
  // rounded to nearest even as at::Tensor::to rounds.
  std::optional<at::ScalarType> stored_dtype = std::nullopt;
};

// How the staging packs tensors into the pool: destinations[i], a contiguous CPU tensor of the stored dtype over the
// pool's bytes, receives sources[i]'s elements in row-major order, cast: what destinations[i].copy_(sources[i]) does.
// Called once with the CPU tensors (threads: the saver's copy threads) and once per accelerator device with that
// device's tensors, a side stream of the device then current: it queues its work there and returns, and the caller
// waits for the stream. Throws c10::Error on failure. Empty: ATen's copy_, memcpy on the copy threads where a CPU
// tensor needs no cast or reordering. kernels/cast_pack.h's cast_pack is the fused one; ckpt depends on no other
// Trestle module, so the caller hands it in.
using TensorPacker = std::function<void(std::span<const at::Tensor> sources, std::span<const at::Tensor> destinations,
                                        unsigned threads)>;

// The pool memory to give AsyncSaver: pinned host memory from LibTorch's CUDA host allocator when CUDA is available
// (device-to-host copies then run as DMA at full speed), else allocate_locked_if_allowed.
PoolAllocator torch_pool_allocator();

// AsyncSaver::save_async for tensors, packed by `pack`; errors name the tensor when one has the wrong element count,
// a dtype Trestle does not store, or a stored dtype it cannot be cast to. A failure while packing (a device LibTorch
// cannot copy from) fails the save.
Status save_tensors_async(AsyncSaver& saver, Collective& group, const std::string& root, const CheckpointInfo& info,
                          std::span<const TorchSaveItem> items, const SaveOptions& options = {},
                          const TensorPacker& pack = {});

}  // namespace trestle
