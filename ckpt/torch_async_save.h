// Asynchronous save of at::Tensors through AsyncSaver (async_saver.h): CPU tensors are staged with its multi-threaded
// memcpy; tensors on an accelerator (CUDA) are copied device-to-host on a side stream of their device, ordered after
// the work already queued on the device's current stream, into the saver's pool (pinned when the saver was made with
// torch_pool_allocator()), while the CPU copies run. save_tensors_async returns once every byte is in the pool, so
// training may update the tensors right away.
#pragma once

#include <ATen/Tensor.h>

#include <span>
#include <string>

#include "ckpt/async_saver.h"

namespace trestle {

// One piece of a global tensor held by this rank, as save.h's SaveItem, with its bytes in a tensor: contiguous,
// piece.numel() elements, on any device; its dtype is the stored dtype.
struct TorchSaveItem {
  std::string name;
  Shape global_shape;
  Piece piece;
  at::Tensor tensor;
};

// The pool memory to give AsyncSaver: pinned host memory from LibTorch's CUDA host allocator when CUDA is available
// (device-to-host copies then run as DMA at full speed), else allocate_locked_if_allowed.
PoolAllocator torch_pool_allocator();

// AsyncSaver::save_async for tensors; errors name the tensor when one is not contiguous, has the wrong element count,
// a dtype Trestle does not store, or lives on a device LibTorch cannot copy from.
Status save_tensors_async(AsyncSaver& saver, Collective& group, const std::string& root, const CheckpointInfo& info,
                          std::span<const TorchSaveItem> items, const SaveOptions& options = {});

}  // namespace trestle
