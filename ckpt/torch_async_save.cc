#include "ckpt/torch_async_save.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstring>
#include <unordered_map>
#include <vector>

#include "ckpt/parallel_copy.h"
#include "ckpt/torch_tensor.h"

namespace trestle {
namespace {

Result<SaveItem> save_item_of(const TorchSaveItem& item) {
  const at::Tensor& t = item.tensor;
  auto fail = [&](const std::string& why) { return Status::Error("tensor '" + item.name + "': " + why); };
  if (!t.defined()) return fail("no tensor given");
  if (!t.is_contiguous()) return fail("tensor is not contiguous");
  if (t.numel() != item.piece.numel())
    return fail("tensor has " + std::to_string(t.numel()) + " elements, its piece " + to_string(item.piece) + " " +
                std::to_string(item.piece.numel()));
  auto dtype = from_torch_dtype(t.scalar_type());
  if (!dtype.ok()) return fail(dtype.status().message());
  // A device tensor's pointer is only read by the stager below, through LibTorch.
  return SaveItem{item.name, *dtype, item.global_shape, item.piece, static_cast<const std::byte*>(t.const_data_ptr())};
}

// Queues every device copy of one device on a side stream that first waits for the device's current stream.
c10::Stream start_device_copies(c10::Device device,
                                const std::vector<std::pair<const at::Tensor*, std::byte*>>& copies) {
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream side = impl.getStreamFromGlobalPool(device);
  c10::Event produced(device.type());
  produced.record(impl.getStream(device));
  produced.block(side);
  const c10::StreamGuard on_side(side);
  const at::NoGradGuard no_grad;  // a copy for the checkpoint, not part of the model's graph
  for (const auto& [tensor, destination] : copies) {
    at::Tensor host = at::from_blob(destination, tensor->sizes(), tensor->options().device(at::kCPU));
    host.copy_(*tensor, /*non_blocking=*/true);
  }
  return side;
}

Status stage_tensors(std::span<const TorchSaveItem> tensors, std::span<const StagingCopy> copies, unsigned threads) {
  std::vector<CopyRange> host;
  std::unordered_map<c10::Device, std::vector<std::pair<const at::Tensor*, std::byte*>>> by_device;
  for (const StagingCopy& c : copies) {
    const at::Tensor& t = tensors[c.item].tensor;
    if (c.destination.empty()) continue;
    if (t.device().is_cpu())
      host.push_back({static_cast<const std::byte*>(t.const_data_ptr()), c.destination.data(), c.destination.size()});
    else by_device[t.device()].emplace_back(&t, c.destination.data());
  }
  try {
    std::vector<c10::Stream> streams;
    for (const auto& [device, list] : by_device) streams.push_back(start_device_copies(device, list));
    parallel_copy(host, threads);  // while the device copies run
    for (const c10::Stream& s : streams) s.synchronize();
  } catch (const c10::Error& e) {
    return Status::Error(std::string("device-to-host staging copy failed: ") + e.what_without_backtrace());
  }
  return OkStatus();
}

}  // namespace

PoolAllocator torch_pool_allocator() {
  if (!at::hasCUDA()) return allocate_locked_if_allowed;
  return [](std::size_t bytes) -> Result<PoolMemory> {
    try {
      auto pinned = std::make_shared<at::Tensor>(
          at::empty({static_cast<std::int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true)));
      auto* data = static_cast<std::byte*>(pinned->data_ptr());
      std::memset(data, 0, bytes);  // touch every page once
      return PoolMemory{data, bytes, std::move(pinned), true};
    } catch (const c10::Error& e) {
      return Status::Error("cannot allocate pinned staging memory: " + std::string(e.what_without_backtrace()));
    }
  };
}

Status save_tensors_async(AsyncSaver& saver, Collective& group, const std::string& root, const CheckpointInfo& info,
                          std::span<const TorchSaveItem> items, const SaveOptions& options) {
  std::vector<SaveItem> save_items;
  for (const TorchSaveItem& item : items) {
    TRESTLE_ASSIGN_OR_RETURN(SaveItem s, save_item_of(item));
    save_items.push_back(std::move(s));
  }
  const unsigned threads = saver.copy_threads();
  return saver.save_async(group, root, info, save_items, options,
                          [&](std::span<const SaveItem>, std::span<const StagingCopy> copies) {
                            return stage_tensors(items, copies, threads);
                          });
}

}  // namespace trestle
