#include "kernels/cast_pack.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>
#include <optional>
#include <vector>

#include "kernels/cpu/pack_source.h"
#include "kernels/cpu_table.h"

#if defined(TRESTLE_HAVE_CUDA) && defined(TRESTLE_HAVE_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/cuda_kernels.h"
#define TRESTLE_CAST_PACK_CUDA 1
#endif

namespace trestle::kernels {
namespace {

using cpu::PackSource;
using cpu::PackType;

std::optional<PackType> float_type(at::ScalarType t) {
  if (t == at::kFloat) return PackType::kFloat;
  if (t == at::kBFloat16) return PackType::kBFloat16;
  if (t == at::kHalf) return PackType::kHalf;
  return std::nullopt;
}

std::optional<PackType> bytes_type(std::size_t bytes) {
  switch (bytes) {
    case 1:
      return PackType::kBytes1;
    case 2:
      return PackType::kBytes2;
    case 4:
      return PackType::kBytes4;
    case 8:
      return PackType::kBytes8;
    case 16:
      return PackType::kBytes16;
    default:
      return std::nullopt;
  }
}

// The kernels' descriptor of one pair, or none when they do not take it.
std::optional<PackSource> pack_source_of(const at::Tensor& src, const at::Tensor& dst) {
  if (src.dim() > cpu::kPackMaxDims) return std::nullopt;
  PackSource s;
  if (src.scalar_type() == dst.scalar_type()) {
    const auto raw = bytes_type(src.element_size());
    if (!raw) return std::nullopt;
    s.from = s.to = *raw;
  } else {
    const auto from = float_type(src.scalar_type()), to = float_type(dst.scalar_type());
    if (!from || !to) return std::nullopt;
    s.from = *from;
    s.to = *to;
  }
  s.data = src.const_data_ptr();
  s.destination = dst.data_ptr();
  s.dims = static_cast<std::int32_t>(src.dim());
  for (std::int64_t d = 0; d < src.dim(); ++d) {
    s.sizes[d] = src.size(d);
    s.strides[d] = src.stride(d);
  }
  return s;
}

void check_pair(const at::Tensor& src, const at::Tensor& dst, std::size_t i) {
  TORCH_CHECK(src.defined() && dst.defined(), "cast_pack: pair ", i, " has no tensor");
  TORCH_CHECK(dst.is_contiguous(), "cast_pack: destination ", i, " is not contiguous");
  TORCH_CHECK(dst.numel() == src.numel(), "cast_pack: destination ", i, " has ", dst.numel(), " elements, its source ",
              src.numel());
  TORCH_CHECK(dst.is_cpu() || dst.device() == src.device(), "cast_pack: destination ", i, " is on ", dst.device(),
              ", neither the CPU nor its source's device ", src.device());
}

#if defined(TRESTLE_CAST_PACK_CUDA)
// Packs one GPU's list with one launch on its current stream; the pairs whose destination it cannot write go to `aten`.
void pack_on_gpu(c10::DeviceIndex device, std::vector<std::pair<std::size_t, PackSource>>& list,
                 std::vector<std::size_t>& aten) {
  const c10::cuda::CUDAGuard guard(device);
  std::vector<PackSource> launch;
  for (auto& [i, s] : list) {
    s.destination = cuda::device_address(s.destination);
    if (s.destination) launch.push_back(s);
    else aten.push_back(i);
  }
  if (launch.empty()) return;
  const auto count = static_cast<std::int64_t>(launch.size());
  // From the caching allocator on the current stream: reused only by work ordered after this launch.
  const at::Tensor scratch = at::empty({static_cast<std::int64_t>(cuda::cast_pack_scratch_bytes(count))},
                                       at::TensorOptions().dtype(at::kByte).device(at::Device(at::kCUDA, device)));
  const std::string error =
      cuda::cast_pack(launch.data(), count, scratch.data_ptr(), c10::cuda::getCurrentCUDAStream(device).stream());
  TORCH_CHECK(error.empty(), "cast_pack: the CUDA kernel failed: ", error);
}
#endif

}  // namespace

void cast_pack(std::span<const at::Tensor> sources, std::span<const at::Tensor> destinations, unsigned threads) {
  TORCH_CHECK(sources.size() == destinations.size(), "cast_pack: ", sources.size(), " sources, ", destinations.size(),
              " destinations");
  const at::NoGradGuard no_grad;  // a copy for the checkpoint, not part of any graph
  std::vector<PackSource> on_cpu;
  std::map<c10::DeviceIndex, std::vector<std::pair<std::size_t, PackSource>>> on_gpu;
  std::vector<std::size_t> aten;  // pairs for copy_
  for (std::size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor &src = sources[i], &dst = destinations[i];
    check_pair(src, dst, i);
    const auto s = pack_source_of(src, dst);
    if (s && src.is_cpu()) {
      on_cpu.push_back(*s);
      continue;
    }
#if defined(TRESTLE_CAST_PACK_CUDA)
    if (s && src.is_cuda()) {
      on_gpu[src.device().index()].emplace_back(i, *s);
      continue;
    }
#endif
    aten.push_back(i);
  }
#if defined(TRESTLE_CAST_PACK_CUDA)
  for (auto& [device, list] : on_gpu) pack_on_gpu(device, list, aten);  // queued first, to run beside the CPU's
#endif
  for (const std::size_t i : aten)
    destinations[i].view(sources[i].sizes()).copy_(sources[i], /*non_blocking=*/!sources[i].is_cpu());
  if (!on_cpu.empty())
    cpu_table().cast_pack(on_cpu.data(), static_cast<std::int64_t>(on_cpu.size()), static_cast<int>(threads));
}

}  // namespace trestle::kernels
