#include "ckpt/torch_async_save.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstring>
#include <exception>
#include <unordered_map>
#include <vector>

#include "ckpt/parallel_copy.h"
#include "ckpt/torch_tensor.h"

namespace trestle {
namespace {

at::ScalarType stored_type_of(const TorchSaveItem& item) {
  return item.stored_dtype.value_or(item.tensor.scalar_type());
}

Result<SaveItem> save_item_of(const TorchSaveItem& item) {
  const at::Tensor& t = item.tensor;
  auto fail = [&](const std::string& why) { return Status::Error("tensor '" + item.name + "': " + why); };
  if (!t.defined()) return fail("no tensor given");
  if (t.numel() != item.piece.numel())
    return fail("tensor has " + std::to_string(t.numel()) + " elements, its piece " + to_string(item.piece) + " " +
                std::to_string(item.piece.numel()));
  const at::ScalarType stored = stored_type_of(item);
  auto dtype = from_torch_dtype(stored);
  if (!dtype.ok()) return fail(dtype.status().message());
  if (stored != t.scalar_type() && !(c10::isFloatingType(stored) && c10::isFloatingType(t.scalar_type())))
    return fail(std::string("a ") + c10::toString(t.scalar_type()) + " tensor cannot be stored as " +
                c10::toString(stored) + ": only floating-point dtypes are cast");
  // Only the packer reads the tensor (a device tensor's pointer through LibTorch); the pointer says there is data.
  return SaveItem{item.name, *dtype, item.global_shape, item.piece, static_cast<const std::byte*>(t.const_data_ptr())};
}

// The tensors of one device and the pool's bytes each goes to, viewed as tensors of the stored dtype.
struct PackList {
  std::vector<at::Tensor> sources, destinations;
};

// Without a packer: memcpy on the copy threads where a tensor is stored as it lies, copy_ for the rest.
void pack_with_aten_on_cpu(const PackList& list, unsigned threads) {
  std::vector<CopyRange> ranges;
  for (std::size_t i = 0; i < list.sources.size(); ++i) {
    const at::Tensor &src = list.sources[i], &dst = list.destinations[i];
    if (src.is_contiguous() && src.scalar_type() == dst.scalar_type())
      ranges.push_back(
          {static_cast<const std::byte*>(src.const_data_ptr()), static_cast<std::byte*>(dst.data_ptr()), dst.nbytes()});
    else dst.copy_(src);
  }
  parallel_copy(ranges, threads);
}

// Queues the packing of one device's tensors on a side stream that first waits for the device's current stream.
// copy_ (the default) casts and makes contiguous on the device before its device-to-host copy.
c10::Stream start_device_packing(c10::Device device, const PackList& list, const TensorPacker& pack, unsigned threads) {
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream side = impl.getStreamFromGlobalPool(device);
  c10::Event produced(device.type());
  produced.record(impl.getStream(device));
  produced.block(side);
  const c10::StreamGuard on_side(side);
  if (pack) {
    pack(list.sources, list.destinations, threads);
  } else {
    for (std::size_t i = 0; i < list.sources.size(); ++i)
      list.destinations[i].copy_(list.sources[i], /*non_blocking=*/true);
  }
  return side;
}

Status stage_tensors(std::span<const TorchSaveItem> tensors, std::span<const StagingCopy> copies, unsigned threads,
                     const TensorPacker& pack) {
  PackList host;
  std::unordered_map<c10::Device, PackList> by_device;
  for (const StagingCopy& c : copies) {
    const TorchSaveItem& item = tensors[c.item];
    if (c.destination.empty()) continue;
    PackList& list = item.tensor.device().is_cpu() ? host : by_device[item.tensor.device()];
    list.sources.push_back(item.tensor);
    list.destinations.push_back(
        at::from_blob(c.destination.data(), item.tensor.sizes(), at::TensorOptions().dtype(stored_type_of(item))));
  }
  try {
    const at::NoGradGuard no_grad;  // a copy for the checkpoint, not part of the model's graph
    std::vector<c10::Stream> streams;
    for (const auto& [device, list] : by_device) streams.push_back(start_device_packing(device, list, pack, threads));
    if (pack) pack(host.sources, host.destinations, threads);  // while the devices' packing runs
    else pack_with_aten_on_cpu(host, threads);
    for (const c10::Stream& s : streams) s.synchronize();
  } catch (const c10::Error& e) {
    return Status::Error(std::string("staging copy failed: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::Error(std::string("staging copy failed: ") + e.what());
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
                          std::span<const TorchSaveItem> items, const SaveOptions& options, const TensorPacker& pack) {
  std::vector<SaveItem> save_items;
  for (const TorchSaveItem& item : items) {
    TRESTLE_ASSIGN_OR_RETURN(SaveItem s, save_item_of(item));
    save_items.push_back(std::move(s));
  }
  const unsigned threads = saver.copy_threads();
  return saver.save_async(group, root, info, save_items, options,
                          [&](std::span<const SaveItem>, std::span<const StagingCopy> copies) {
                            return stage_tensors(items, copies, threads, pack);
                          });
}

}  // namespace trestle
