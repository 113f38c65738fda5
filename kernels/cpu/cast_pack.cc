// The cast-and-pack kernel (pack_source.h) on the CPU, compiled once per instruction set beside cpu_kernels.cc (whose
// table holds it). The list's elements, in list order, are cut into one equal run per thread (at::parallel_for); a
// thread walks its run source by source, row by row of each source's innermost dim: rows whose elements are adjacent
// convert a vector at a time (memcpy when no cast), other rows element by element, and where a source's rows are
// nearer one another in memory than its columns (a transposed view) tiles of rows and columns are transposed through
// a buffer in cache, so that reads go down memory rather than across it and writes along the destination's rows.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace trestle::kernels::cpu {
namespace CPU_CAPABILITY {

void cast_pack(const PackSource* sources, std::int64_t count, int threads);  // the table's entry (cpu_kernels.cc)

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr std::int64_t kMinRun = std::int64_t{1} << 16;  // elements: a smaller list is packed on one thread
// A tile of a transposed source: two vectors of rows (a column's rows convert as one step) by 128 columns (64 KiB at
// most, of 16-byte elements). 16 × 128 was the best of the sizes tried on an AVX2 machine (fp32 -> bf16 of a
// transposed 4096²: about 4 times copy_'s speed).
constexpr std::int64_t kTileRows = 2 * Vec::size();
constexpr std::int64_t kTileColumns = 128;

// An element of 16 bytes (complex double) moved as it is.
struct Bytes16 {
  std::uint64_t low, high;
};

template <typename To, typename From>
To cast(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else {
    return static_cast<To>(static_cast<float>(v));  // c10's conversions round to nearest even
  }
}

// n adjacent elements converted: two fp32 vectors at a time through registers; memcpy when there is no cast.
template <typename From, typename To>
void convert_run(const From* src, To* dst, std::int64_t n) {
  if constexpr (std::is_same_v<From, To>) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(From));
  } else {
    constexpr std::int64_t kStep = 2 * Vec::size();
    std::int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      Vec low, high;
      if constexpr (std::is_same_v<From, float>) {
        low = Vec::loadu(src + i);
        high = Vec::loadu(src + i + Vec::size());
      } else {
        static_assert(at::vec::Vectorized<From>::size() == kStep);
        std::tie(low, high) = at::vec::convert_to_float<From>(at::vec::Vectorized<From>::loadu(src + i));
      }
      if constexpr (std::is_same_v<To, float>) {
        low.store(dst + i);
        high.store(dst + i + Vec::size());
      } else {
        at::vec::convert_from_float<To>(low, high).store(dst + i);
      }
    }
    for (; i < n; ++i) dst[i] = cast<To>(src[i]);
  }
}

// rows × cols elements (at most a tile), row r and column c at src[r * row_stride + c * col_stride], written row-major
// at dst (whose rows are `pitch` apart) through a tile in cache: read column by column (each column's rows are near one
// another, converted as a run when adjacent), then written row by row, so that both sides touch few pages at a time.
template <typename From, typename To>
void transpose_block(const From* src, std::int64_t row_stride, std::int64_t col_stride, To* dst, std::int64_t pitch,
                     std::int64_t rows, std::int64_t cols) {
  To tile[kTileRows * kTileColumns];  // column c's rows from tile[c * kTileRows]
  for (std::int64_t c = 0; c < cols; ++c) {
    const From* in = src + c * col_stride;
    To* column = tile + c * kTileRows;
    if (row_stride == 1) {
      convert_run(in, column, rows);
    } else {
      for (std::int64_t r = 0; r < rows; ++r) column[r] = cast<To>(in[r * row_stride]);
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    To* out = dst + r * pitch;
    for (std::int64_t c = 0; c < cols; ++c) out[c] = tile[c * kTileRows + r];
  }
}

// Elements [first, first + count) of a coalesced source, packed at destination + first.
template <typename From, typename To>
void pack_run(const PackSource& s, std::int64_t first, std::int64_t count) {
  const From* src = static_cast<const From*>(s.data);
  To* dst = static_cast<To*>(s.destination) + first;
  if (is_packed(s)) return convert_run(src + first, dst, count);
  const int last = s.dims - 1;
  const std::int64_t cols = s.sizes[last], col_stride = s.strides[last];
  // The row (of the innermost dim) holding element `first`: its index over the outer dims, where it starts.
  std::int64_t index[kPackMaxDims] = {};
  std::int64_t row_start = 0;
  for (std::int64_t d = last - 1, rest = first / cols; d >= 0; --d) {
    index[d] = rest % s.sizes[d];
    row_start += index[d] * s.strides[d];
    rest /= s.sizes[d];
  }
  auto next_row = [&] {
    for (int d = last - 1; d >= 0; --d) {
      if (++index[d] < s.sizes[d]) {
        row_start += s.strides[d];
        return;
      }
      row_start -= (s.sizes[d] - 1) * s.strides[d];
      index[d] = 0;
    }
  };
  const std::int64_t row_stride = last > 0 ? s.strides[last - 1] : 0;
  const bool transposed = last > 0 && col_stride != 1 && std::abs(row_stride) < std::abs(col_stride);
  std::int64_t col = first % cols, done = 0;
  while (done < count) {
    if (transposed && col == 0) {  // whole rows of one matrix (the outer dims' index fixed)
      const std::int64_t rows = std::min({kTileRows, s.sizes[last - 1] - index[last - 1], (count - done) / cols});
      if (rows >= 2) {
        for (std::int64_t c = 0; c < cols; c += kTileColumns)
          transpose_block(src + row_start + c * col_stride, row_stride, col_stride, dst + done + c, cols, rows,
                          std::min(kTileColumns, cols - c));
        done += rows * cols;
        index[last - 1] += rows - 1;
        row_start += (rows - 1) * row_stride;
        next_row();
        continue;
      }
    }
    const std::int64_t n = std::min(cols - col, count - done);
    const From* in = src + row_start + col * col_stride;
    if (col_stride == 1) {
      convert_run(in, dst + done, n);
    } else {
      for (std::int64_t i = 0; i < n; ++i) dst[done + i] = cast<To>(in[i * col_stride]);
    }
    done += n;
    col = 0;
    next_row();
  }
}

using Mover = void (*)(const PackSource&, std::int64_t, std::int64_t);

template <typename From>
Mover cast_from(PackType to) {
  switch (to) {
    case PackType::kBFloat16:
      return pack_run<From, c10::BFloat16>;
    case PackType::kHalf:
      return pack_run<From, c10::Half>;
    default:
      return pack_run<From, float>;
  }
}

Mover mover_of(PackType from, PackType to) {
  if (from != to) {
    if (from == PackType::kBFloat16) return cast_from<c10::BFloat16>(to);
    if (from == PackType::kHalf) return cast_from<c10::Half>(to);
    return cast_from<float>(to);
  }
  switch (pack_type_bytes(from)) {  // no cast: the bytes, an element at a time
    case 1:
      return pack_run<std::uint8_t, std::uint8_t>;
    case 2:
      return pack_run<std::uint16_t, std::uint16_t>;
    case 4:
      return pack_run<std::uint32_t, std::uint32_t>;
    case 8:
      return pack_run<std::uint64_t, std::uint64_t>;
    default:
      return pack_run<Bytes16, Bytes16>;
  }
}

}  // namespace

void cast_pack(const PackSource* sources, std::int64_t count, int threads) {
  std::vector<PackSource> list;
  std::vector<Mover> movers;
  std::vector<std::int64_t> starts;  // each source's first element in the list's
  std::int64_t total = 0;
  for (std::int64_t k = 0; k < count; ++k) {
    list.push_back(coalesced(sources[k]));
    movers.push_back(mover_of(sources[k].from, sources[k].to));
    starts.push_back(total);
    total += pack_numel(list.back());
  }
  if (total == 0) return;
  const std::int64_t workers =
      std::max(1, threads > 0 ? std::min(threads, at::get_num_threads()) : at::get_num_threads());
  const std::int64_t run = std::max(kMinRun, (total + workers - 1) / workers);  // at most `workers` runs
  at::parallel_for(0, total, run, [&](std::int64_t begin, std::int64_t end) {
    auto k = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1);
    for (; begin < end; ++k) {
      const std::int64_t stop = std::min(end, starts[k] + pack_numel(list[k]));
      if (stop <= begin) continue;  // an empty source
      movers[k](list[k], begin - starts[k], stop - begin);
      begin = stop;
    }
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace trestle::kernels::cpu
