// The cast-and-pack kernel (pack_source.h) on the CPU, compiled once per instruction set beside cpu_kernels.cc (whose
// table holds it). The list's elements, in list order, are cut into one equal run per thread (at::parallel_for); a
// thread walks its run source by source, row by row of each source's innermost dim: rows whose elements are adjacent
// convert a vector at a time (memcpy when no cast), other rows element by element, and where a source's rows are
// nearer one another in memory than its columns (a transposed view) tiles of rows and columns are transposed through
// two buffers in cache, a band of tiles column by column: each column's rows read down memory (cast to the
// destination's type, the columns ahead prefetched) into one, transposed 16 x 16 in registers into the other, whose
// rows are streamed along the destination's rows.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

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

// A tile's side: 128 elements of up to 4 bytes, 64 of larger ones (a tile of 16 to 64 KiB). Of sides 64 to 512 tried
// in a stand-alone copy of this scheme (fp32 -> bf16 of a transposed 4096², Intel, AVX-512, 2 threads), 64 to 256 ran
// alike. A tile's rows lie `side` apart: a line of padding (against cache-set conflicts of 16 rows 512 bytes apart)
// made it slower, not faster (9.8 against 8.0 ms, best of four runs each).
template <typename T>
constexpr std::int64_t kTileSide = sizeof(T) <= 4 ? 128 : 64;
// A transposed source is packed in bands of this many tiles' rows, column of tiles by column of tiles, so that the
// source's pages (a column's rows) are read whole in consecutive tiles rather than a tile's side at a time a band apart
// (fewer TLB misses; the destination's pages are reused across the columns of a band as before). fp32 -> bf16 of a
// transposed 16384² (1 GiB, past the L3), 2 threads: on an Intel Xeon (AVX-512, 300 MiB L3), when tiles were
// transposed in fp32, 150-152 ms with 8 (4 and 16 alike), 179-183 ms with 1, 266-293 ms with the earlier tiles of 16
// rows by 128 columns written element by element through the cache; on an AMD EPYC (AVX2, 32 MiB L3), with 8 columns
// prefetched (below), 82-86 ms with 32 (16 and 64 alike) against 92-100 ms with 8 and 102 ms with 4, into huge pages
// or 4 KiB ones alike.
constexpr std::int64_t kBandTiles = 32;
// While a column of a tile is read, the one this many columns on is prefetched: the cast's arithmetic between loads
// otherwise keeps too few of them in flight (the transposed 16384², 2 threads: on the Intel, bands of 8 tiles,
// AVX-512 94-113 ms with 4 against 134-145 ms with none, AVX2 103-115 ms against 215-218 ms, 2 and 8 alike or slower;
// on the AMD, bands of 32 tiles, 82-86 ms with 8 against 84-85 ms with 4, bands of 8: 89-92 ms with 8, 92-100 with 4).
constexpr std::int64_t kPrefetchColumns = 8;

#if defined(CPU_CAPABILITY_AVX2)
// dst[j * ld_dst + i] = src[i * ld_src + j] for i, j < 16, of 16-bit elements (ATen has no AVX2 one): each half of the
// rows transposed as two 8 x 8 blocks within the 128-bit lanes (unpacking 16-, 32- then 64-bit pairs), then the lanes
// of the two halves exchanged.
void transpose_16x16_of_16_bits(const void* src, std::int64_t ld_src, void* dst, std::int64_t ld_dst) {
  const auto* in = static_cast<const std::uint16_t*>(src);
  auto* out = static_cast<std::uint16_t*>(dst);
  __m256i half[2][8];  // half[h][k]: [column k of rows 8h..8h+7 | column k + 8 of them]
  for (int h = 0; h < 2; ++h) {
    __m256i a[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + (8 * h + i) * ld_src));
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // rows 4i..4i+3: columns (0, 1), (2, 3), (4, 5), (6, 7) of each lane
      u[4 * i] = _mm256_unpacklo_epi32(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm256_unpackhi_epi32(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm256_unpacklo_epi32(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm256_unpackhi_epi32(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
      half[h][2 * i] = _mm256_unpacklo_epi64(u[i], u[i + 4]);
      half[h][2 * i + 1] = _mm256_unpackhi_epi64(u[i], u[i + 4]);
    }
  }
  for (int k = 0; k < 8; ++k) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k * ld_dst),
                        _mm256_permute2x128_si256(half[0][k], half[1][k], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (k + 8) * ld_dst),
                        _mm256_permute2x128_si256(half[0][k], half[1][k], 0x31));
  }
}
#endif

// dst[r * side + c] = src[c * side + r] for r < rows, c < cols: 16 x 16 blocks through registers where the build has a
// vector transpose for the element's size (4 or 2 bytes: the bits move as they are), the rest element by element.
template <typename T>
void transpose_tile(const T* src, T* dst, std::int64_t rows, std::int64_t cols) {
  constexpr std::int64_t pitch = kTileSide<T>, k = 16;
  auto by_element = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::int64_t c = c0; c < c1; ++c) dst[r * pitch + c] = src[c * pitch + r];
  };
  auto block = [](const T* from, T* to) {
    if constexpr (sizeof(T) == 4) {
      at::vec::transpose_mxn<float, k, k>(reinterpret_cast<const float*>(from), pitch, reinterpret_cast<float*>(to),
                                          pitch);
    } else {
#if defined(CPU_CAPABILITY_AVX512)
      at::vec::transpose_mxn<c10::BFloat16, k, k>(reinterpret_cast<const c10::BFloat16*>(from), pitch,
                                                  reinterpret_cast<c10::BFloat16*>(to), pitch);
#elif defined(CPU_CAPABILITY_AVX2)
      transpose_16x16_of_16_bits(from, pitch, to, pitch);
#endif
    }
  };
  constexpr bool by_vectors = sizeof(T) == 4
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
                              || sizeof(T) == 2
#endif
      ;
  if constexpr (!by_vectors) {
    by_element(0, rows, 0, cols);
  } else {
    const std::int64_t full_rows = rows / k * k, full_cols = cols / k * k;
    for (std::int64_t c = 0; c < full_cols; c += k)
      for (std::int64_t r = 0; r < full_rows; r += k) block(src + c * pitch + r, dst + r * pitch + c);
    by_element(full_rows, rows, 0, cols);
    by_element(0, full_rows, full_cols, cols);
  }
}

// n bytes from src to dst, the whole 64-byte lines of dst by non-temporal stores: the staging bytes go to the disk, not
// back through this core's cache, and a line streamed is not read from memory first (in the stand-alone copy above:
// 4.6-4.8 ms against 6.6-9.0 ms stored through the cache). The partial lines at either end are copied. The stores are
// weakly ordered: each thread fences (finish_streaming) when its share is done.
void stream_bytes(void* dst, const void* src, std::size_t n) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  auto* out = static_cast<unsigned char*>(dst);
  const auto* in = static_cast<const unsigned char*>(src);
  const std::size_t head = std::min(n, (64 - reinterpret_cast<std::uintptr_t>(out) % 64) % 64);
  std::memcpy(out, in, head);
  std::size_t i = head;
  for (; i + 64 <= n; i += 64) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), _mm512_loadu_si512(in + i));
#else
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i + 32),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 32)));
#endif
  }
  std::memcpy(out + i, in + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// Orders this thread's streamed stores before whatever it does next (the end of its share of the work).
void finish_streaming() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// rows × cols elements (at most a tile's side each), row r and column c at src[r * row_stride + c * col_stride],
// written row-major at dst (whose rows are `pitch` apart): each column's rows read (cast as a run when adjacent) into a
// tile of the destination's type, transposed into another, whose rows are streamed along the destination's rows, so
// that both sides touch memory in runs. Casting on the way in halves the bytes a 16-bit destination's tiles move
// (fp32 -> bf16 of a transposed 16384², AVX-512: 134-136 ms against 150-152 ms transposing in fp32 and casting on the
// way out).
template <typename From, typename To>
void transpose_block(const From* src, std::int64_t row_stride, std::int64_t col_stride, To* dst, std::int64_t pitch,
                     std::int64_t rows, std::int64_t cols) {
  constexpr std::int64_t side = kTileSide<To>;
  thread_local std::vector<To> tiles(static_cast<std::size_t>(2 * side * side));
  To* columns = tiles.data();            // column c's rows from columns[c * side]
  To* rows_out = columns + side * side;  // row r's columns from rows_out[r * side]
  for (std::int64_t c = 0; c < cols; ++c) {
    const From* in = src + c * col_stride;
    To* column = columns + c * side;
    if (row_stride == 1) {
      if (c + kPrefetchColumns < cols) {
        const char* ahead = reinterpret_cast<const char*>(in + kPrefetchColumns * col_stride);
        for (std::size_t k = 0; k < static_cast<std::size_t>(rows) * sizeof(From); k += 64)
          __builtin_prefetch(ahead + k);
      }
      convert_run(in, column, rows);
    } else {
      for (std::int64_t r = 0; r < rows; ++r) column[r] = cast<To>(in[r * row_stride]);
    }
  }
  transpose_tile(columns, rows_out, rows, cols);
  const auto bytes = static_cast<std::size_t>(cols) * sizeof(To);
  for (std::int64_t r = 0; r < rows; ++r) stream_bytes(dst + r * pitch, rows_out + r * side, bytes);
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
      constexpr std::int64_t side = kTileSide<To>, band = kBandTiles * side;
      const std::int64_t rows = std::min({band, s.sizes[last - 1] - index[last - 1], (count - done) / cols});
      if (rows >= 2) {
        for (std::int64_t c = 0; c < cols; c += side)
          for (std::int64_t r = 0; r < rows; r += side)
            transpose_block(src + row_start + r * row_stride + c * col_stride, row_stride, col_stride,
                            dst + done + r * cols + c, cols, std::min(side, rows - r), std::min(side, cols - c));
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
    finish_streaming();
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace trestle::kernels::cpu
