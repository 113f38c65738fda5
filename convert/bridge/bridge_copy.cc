#include "convert/bridge/bridge_copy.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "ckpt/dtype_cast.h"

namespace trestle {

namespace {

// gather_canonical's copies, before any shift.
Status gather_runs(const BridgeTensor& t, std::int64_t offset, std::int64_t count,
                   const std::vector<ConstTensorView>& sources, DType dtype, std::span<std::byte> out) {
  const std::size_t out_size = dtype_size(dtype);
  // The last run starting at or before offset.
  auto run = std::upper_bound(t.runs.begin(), t.runs.end(), offset,
                              [](std::int64_t v, const ElementRun& r) { return v < r.canonical_offset; });
  if (run == t.runs.begin()) return Status::Error("no run covers element " + std::to_string(offset));
  --run;
  std::int64_t pos = offset;
  const std::int64_t end = offset + count;
  std::vector<std::byte> reordered;
  for (; pos < end && run != t.runs.end(); ++run) {
    const std::int64_t take = std::min(end, run->canonical_offset + run->count) - pos;
    if (take <= 0) continue;
    const ConstTensorView& src = sources[run->hf_index];
    const std::size_t in_size = dtype_size(src.dtype);
    const std::span<std::byte> to =
        out.subspan(static_cast<std::size_t>(pos - offset) * out_size, static_cast<std::size_t>(take) * out_size);
    std::span<const std::byte> from;
    if (run->order == RunOrder::kSame) {
      const std::int64_t at = run->hf_offset + (pos - run->canonical_offset);
      from = {src.data + static_cast<std::size_t>(at) * in_size, static_cast<std::size_t>(take) * in_size};
    } else {  // element by element into the source dtype first
      reordered.resize(static_cast<std::size_t>(take) * in_size);
      for (std::int64_t k = 0; k < take; ++k) {
        const std::int64_t at = run->hf_offset + run_hf_element(*run, pos - run->canonical_offset + k);
        std::memcpy(reordered.data() + static_cast<std::size_t>(k) * in_size,
                    src.data + static_cast<std::size_t>(at) * in_size, in_size);
      }
      from = reordered;
    }
    if (src.dtype == dtype) std::memcpy(to.data(), from.data(), from.size());
    else TRESTLE_RETURN_IF_ERROR(cast_elements(src.dtype, from, dtype, to));
    pos += take;
  }
  if (pos != end) return Status::Error("runs end before element " + std::to_string(end));
  return OkStatus();
}

}  // namespace

Status gather_canonical(const BridgeTensor& t, std::int64_t offset, std::int64_t count,
                        const std::vector<ConstTensorView>& sources, DType dtype, std::span<std::byte> out) {
  if (t.shift == 0.0) return gather_runs(t, offset, count, sources, dtype, out);
  // A shifted tensor: the sum in double, rounded once to `dtype`.
  std::vector<double> values(static_cast<std::size_t>(count));
  TRESTLE_RETURN_IF_ERROR(
      gather_runs(t, offset, count, sources, DType::kF64, std::as_writable_bytes(std::span(values))));
  return shift_and_cast(DType::kF64, std::as_bytes(std::span(values)), t.shift, dtype,
                        out.first(static_cast<std::size_t>(count) * dtype_size(dtype)));
}

Status gather_box(const BridgeTensor& t, const Box& box, const std::vector<ConstTensorView>& sources, DType dtype,
                  std::span<std::byte> out) {
  Status status;
  const std::size_t size = dtype_size(dtype);
  for_each_shared_run(Piece{box, std::nullopt}, Piece{whole_box(t.shape), std::nullopt}, [&](const SharedRun& r) {
    if (!status.ok()) return;
    status = gather_canonical(
        t, r.b_index, r.count, sources, dtype,
        out.subspan(static_cast<std::size_t>(r.a_index) * size, static_cast<std::size_t>(r.count) * size));
  });
  return status;
}

Status shift_and_cast(DType from, std::span<const std::byte> in, double shift, DType to, std::span<std::byte> out) {
  if (!is_floating(from) || !is_floating(to))
    return Status::Error("a shifted tensor must be floating point, not " + std::string(dtype_name(from)));
  std::vector<double> values(in.size() / dtype_size(from));
  TRESTLE_RETURN_IF_ERROR(cast_elements(from, in, DType::kF64, std::as_writable_bytes(std::span(values))));
  for (double& v : values) v += shift;
  return cast_elements(DType::kF64, std::as_bytes(std::span(values)), to, out);
}

std::vector<std::vector<std::size_t>> hf_sources_per_tensor(const BridgePlan& plan) {
  std::vector<std::vector<std::size_t>> out;
  for (const auto& t : plan.tensors) {
    std::vector<std::size_t> indices;
    for (const auto& r : t.runs) indices.push_back(r.hf_index);
    std::sort(indices.begin(), indices.end());
    indices.erase(std::unique(indices.begin(), indices.end()), indices.end());
    out.push_back(std::move(indices));
  }
  return out;
}

}  // namespace trestle
