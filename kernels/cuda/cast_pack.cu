// Cast-and-pack on the GPU (cuda_kernels.h): one launch for the whole list. The host coalesces each source's dims,
// drops empty sources and gives each the blocks its elements need (kBlockElements a block); the descriptors travel to
// the device in one copy ahead of the kernel. A block finds its source by binary search over the sources' first
// blocks, then its threads take the block's elements in turn, so that a warp writes adjacent destination elements
// (one coalesced store across the bus when the destination is mapped host memory). A strided element's place is
// worked out from its index by division over the dims: simple, and the bus, not the arithmetic, bounds the kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"

namespace trestle::kernels::cuda {
namespace {

using cpu::PackSource;
using cpu::PackType;

constexpr int kThreads = 256;
constexpr std::int64_t kBlockElements = 16 * kThreads;

struct PackJob {
  PackSource source;  // coalesced
  std::int64_t numel = 0;
  std::int64_t first_block = 0;  // the blocks of the sources before it
  bool packed = false;           // its elements adjacent and in order: element i at data[i]
  int bytes = 0;                 // of an element of `from`
};

// A 16-byte element (complex double) moved as it is; 8-byte alignment is all a strided view promises.
struct alignas(8) Bytes16 {
  unsigned long long low, high;
};

__device__ float to_float(float v) { return v; }
__device__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ float to_float(__half v) { return __half2float(v); }

// Round to nearest even, NaN kept, as ATen's casts on the device.
template <typename To>
__device__ To from_float(float v);
template <>
__device__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

template <typename From, typename To>
__device__ To moved(From v) {
  if constexpr (std::is_same_v<From, To>) {
    return v;
  } else {
    return from_float<To>(to_float(v));
  }
}

__device__ std::int64_t offset_of(const PackSource& s, std::int64_t i) {
  std::int64_t offset = 0;
  for (int d = s.dims - 1; d >= 0; --d) {
    offset += (i % s.sizes[d]) * s.strides[d];
    i /= s.sizes[d];
  }
  return offset;
}

template <typename From, typename To>
__device__ void pack_elements(const PackJob& job, std::int64_t first, std::int64_t end) {
  const From* src = static_cast<const From*>(job.source.data);
  To* dst = static_cast<To*>(job.source.destination);
  for (std::int64_t i = first + threadIdx.x; i < end; i += blockDim.x)
    dst[i] = moved<From, To>(src[job.packed ? i : offset_of(job.source, i)]);
}

template <typename From>
__device__ void cast_from(const PackJob& job, std::int64_t first, std::int64_t end) {
  switch (job.source.to) {
    case PackType::kBFloat16:
      return pack_elements<From, __nv_bfloat16>(job, first, end);
    case PackType::kHalf:
      return pack_elements<From, __half>(job, first, end);
    default:
      return pack_elements<From, float>(job, first, end);
  }
}

__global__ void cast_pack_kernel(const PackJob* jobs, std::int64_t count) {
  __shared__ std::int64_t found;
  const auto block = static_cast<std::int64_t>(blockIdx.x);
  if (threadIdx.x == 0) {  // the last job whose first block is at most this one
    std::int64_t low = 0, high = count - 1;
    while (low < high) {
      const std::int64_t mid = (low + high + 1) / 2;
      if (jobs[mid].first_block <= block) low = mid;
      else high = mid - 1;
    }
    found = low;
  }
  __syncthreads();
  const PackJob& job = jobs[found];
  const std::int64_t first = (block - job.first_block) * kBlockElements;
  const std::int64_t end = first + kBlockElements < job.numel ? first + kBlockElements : job.numel;
  const PackType from = job.source.from;
  if (from != job.source.to) {
    if (from == PackType::kBFloat16) return cast_from<__nv_bfloat16>(job, first, end);
    if (from == PackType::kHalf) return cast_from<__half>(job, first, end);
    return cast_from<float>(job, first, end);
  }
  switch (job.bytes) {
    case 1:
      return pack_elements<unsigned char, unsigned char>(job, first, end);
    case 2:
      return pack_elements<unsigned short, unsigned short>(job, first, end);
    case 4:
      return pack_elements<unsigned int, unsigned int>(job, first, end);
    case 8:
      return pack_elements<unsigned long long, unsigned long long>(job, first, end);
    default:
      return pack_elements<Bytes16, Bytes16>(job, first, end);
  }
}

}  // namespace

std::size_t cast_pack_scratch_bytes(std::int64_t count) {
  return sizeof(PackJob) * static_cast<std::size_t>(count > 0 ? count : 1);
}

void* device_address(void* pointer) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    (void)cudaGetLastError();  // not an error of any launch
    return nullptr;
  }
  return attributes.type == cudaMemoryTypeUnregistered ? nullptr : attributes.devicePointer;
}

std::string cast_pack(const PackSource* sources, std::int64_t count, void* scratch, void* stream) {
  std::vector<PackJob> jobs;
  std::int64_t blocks = 0;
  for (std::int64_t k = 0; k < count; ++k) {
    const PackSource source = cpu::coalesced(sources[k]);
    const std::int64_t numel = cpu::pack_numel(source);
    if (numel == 0) continue;
    jobs.push_back({source, numel, blocks, cpu::is_packed(source), cpu::pack_type_bytes(source.from)});
    blocks += (numel + kBlockElements - 1) / kBlockElements;
  }
  if (jobs.empty()) return {};
  if (blocks > 2147483647) return "the list needs " + std::to_string(blocks) + " blocks, more than one launch runs";
  const auto s = static_cast<cudaStream_t>(stream);
  // From pageable memory: the call returns once the bytes are staged, so `jobs` may go when this function returns (the
  // driver may first wait for the stream's earlier work to stage them).
  cudaError_t e = cudaMemcpyAsync(scratch, jobs.data(), jobs.size() * sizeof(PackJob), cudaMemcpyHostToDevice, s);
  if (e != cudaSuccess) return std::string("copying the descriptors: ") + cudaGetErrorString(e);
  cast_pack_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(static_cast<const PackJob*>(scratch),
                                                                      static_cast<std::int64_t>(jobs.size()));
  e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

}  // namespace trestle::kernels::cuda
