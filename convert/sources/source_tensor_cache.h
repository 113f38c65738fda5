// Whole source tensors read from their files with O_DIRECT into reused page-aligned buffers and kept while they fit
// a byte budget, so a tensor that feeds several ranks' pieces is read from disk once and the page cache (slow to fill
// on these machines, and a second copy) stays out of the way. Thread-safe: different tensors load in parallel; a
// tensor another thread is loading is waited for, not read twice. The budget is soft: tensors pinned at once are
// all held even when together they exceed it. With read_ahead(), background threads load the tensors the consumers
// will want next (many small tensors read one at a time would leave the disk idle between them).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/aligned_buffer.h"
#include "ckpt/file_range_read.h"
#include "ckpt/status.h"
#include "ckpt/tensor_view.h"

namespace trestle {

// The float32 block scales of an FP8 weight (convert/formats/safetensors/fp8_blocks.h): where they lie, their grid
// and the block size.
struct Fp8BlockScale {
  std::string name;  // for errors
  std::string file;
  std::uint64_t offset = 0;
  Shape shape;
  std::int64_t block_rows = 0, block_cols = 0;
  std::uint64_t nbytes() const { return static_cast<std::uint64_t>(numel(shape)) * sizeof(float); }
};

// The scales of an MXFP4-packed weight (convert/formats/safetensors/mxfp4.h), whose blocks the StoredTensor locates.
struct Mxfp4Scales {
  std::string name;  // for errors
  std::string file;
  std::uint64_t offset = 0;
  Shape blocks_shape;  // [E, R, G, 16]; the scales are [E, R, G] uint8
  std::uint64_t nbytes() const { return static_cast<std::uint64_t>(numel(blocks_shape)) / 16; }
};

// Where a tensor's bytes lie: [offset, offset + nbytes()) of `file`. With fp8 scales, the tensor is held dequantised
// to bfloat16 (loaded_dtype / loaded_nbytes); with mxfp4 scales, [offset, +stored_bytes) holds its packed blocks and
// `shape` is the dequantised, transposed weight's.
struct StoredTensor {
  std::string name;  // for errors
  std::string file;
  std::uint64_t offset = 0;
  DType dtype = DType::kF32;
  Shape shape;
  std::optional<Fp8BlockScale> fp8;
  std::optional<Mxfp4Scales> mxfp4 = std::nullopt;
  std::uint64_t nbytes() const {
    return mxfp4 ? mxfp4->nbytes() * 16 : static_cast<std::uint64_t>(numel(shape)) * dtype_size(dtype);
  }
  DType loaded_dtype() const { return fp8 || mxfp4 ? DType::kBF16 : dtype; }
  std::uint64_t loaded_nbytes() const { return static_cast<std::uint64_t>(numel(shape)) * dtype_size(loaded_dtype()); }
};

// A budget for reading `tensors` through a cache: the largest of them, at least 64 MiB, so the tensors of a layer stay
// until every rank cutting pieces from them has taken its own.
std::uint64_t default_cache_budget(const std::vector<StoredTensor>& tensors);

class SourceTensorCache {
 public:
  // Tensors pinned together: views()[i] holds tensor i's data for every pinned i (others have none) until the pin
  // goes away. Movable.
  class Pin {
   public:
    Pin(Pin&& other) noexcept;
    Pin& operator=(Pin&&) = delete;
    Pin(const Pin&) = delete;
    ~Pin();
    const std::vector<ConstTensorView>& views() const { return views_; }

   private:
    friend class SourceTensorCache;
    explicit Pin(SourceTensorCache* cache);
    SourceTensorCache* cache_;
    std::vector<std::size_t> pinned_;
    std::vector<ConstTensorView> views_;
  };

  SourceTensorCache(std::vector<StoredTensor> tensors, std::uint64_t budget_bytes);
  SourceTensorCache(const SourceTensorCache&) = delete;
  SourceTensorCache& operator=(const SourceTensorCache&) = delete;
  ~SourceTensorCache();

  // Reads (or finds) the tensors at `indices` and pins them. Errors name the file, the tensor and the byte range.
  Result<Pin> pin(std::span<const std::size_t> indices);

  // From now on each pin queues the tensors that follow its own in `order` (tensor indices in the order consumers
  // will pin them), up to `lookahead_bytes` ahead, for `threads` background threads to load while the budget has
  // room without evicting a tensor still wanted: uses[i] is how many pins tensor i will see (a tensor is kept for
  // them, then evicted first). A read-ahead that fails is left to the pin that wants the tensor, which reads it again
  // and reports the error. Call once, before the first pin.
  void read_ahead(std::vector<std::size_t> order, const std::vector<int>& uses, std::uint64_t lookahead_bytes,
                  int threads);
  // Blocks until the read-ahead has nothing queued and no load in flight: what it has read by then is all it reads
  // before the next pin (a test's or a measurement's point of rest).
  void wait_read_ahead_idle() const;
  // The most one read-ahead reads at once: each read-ahead thread's staging, beyond the budget.
  static constexpr std::uint64_t kReadAheadGroupBytes = 4u << 20;
  // The read-ahead conversions use: this many threads, up to half the budget ahead of the consumers.
  static constexpr int kReadAheadThreads = 2;
  std::uint64_t read_ahead_bytes() const { return budget_ / 2; }

  const std::vector<StoredTensor>& tensors() const { return tensors_; }
  std::uint64_t bytes_read() const;
  std::uint64_t peak_held_bytes() const;  // the most buffer memory held at once

 private:
  enum class State { kAbsent, kLoading, kReady };
  struct Entry {
    State state = State::kAbsent;
    AlignedBuffer buffer;
    std::size_t lead = 0;  // bytes before the tensor's first byte in `buffer`
    int pins = 0;
    std::uint64_t last_use = 0;
    int wanted = 0;       // pins still expected (read_ahead's uses); 0 when unknown
    bool queued = false;  // waiting in queued_ for a read-ahead
  };

  // Under mu_: a buffer of at least `bytes`, recycled when one is free, else made room for (evicting unpinned
  // tensors: those no longer wanted first, least recently used first, then the one wanted furthest ahead) and
  // allocated after mu_ is let go. For a read-ahead (`for_read_ahead`), no wanted tensor is evicted and no buffer is
  // made beyond the budget: nullopt instead.
  std::optional<AlignedBuffer> take_buffer(std::uint64_t bytes, std::unique_lock<std::mutex>& lock,
                                           bool for_read_ahead = false);
  // Under mu_: the unpinned ready tensor to evict next, or null; tensors still wanted only when `even_wanted`.
  Entry* eviction_victim(bool even_wanted);
  std::uint64_t buffer_bytes(std::size_t index) const;
  void queue_read_ahead(std::span<const std::size_t> pinned);  // under mu_
  void read_ahead_loop();
  // Under mu_ (let go while reading): loads the first queued tensor with those stored after it, when still absent.
  void read_ahead_next(std::unique_lock<std::mutex>& lock, AlignedBuffer& staging);
  // Under mu_: tensor `first` and the queued tensors stored right after it in its file (up to kReadAheadGroupBytes),
  // each with a buffer, so one read fetches them all; empty when not even `first` has room.
  std::vector<std::pair<std::size_t, AlignedBuffer>> read_ahead_group(std::size_t first,
                                                                      std::unique_lock<std::mutex>& lock);
  // Reads a group's bytes with one read into `staging` and copies each tensor into its buffer (not under mu_).
  Status load_group(std::vector<std::pair<std::size_t, AlignedBuffer>>& group, AlignedBuffer& staging);
  Status load(std::size_t index, Entry& entry);
  // A quantised tensor read with its scales, dequantised into entry.buffer.
  struct Packed {
    AlignedBuffer data_buffer, scale_buffer;
    std::span<const std::byte> data, scales;  // within the buffers
  };
  Result<Packed> read_packed(const StoredTensor& t, const std::string& scale_name, const std::string& scale_file,
                             std::uint64_t scale_offset, std::uint64_t scale_bytes);
  Status load_fp8(const StoredTensor& t, Entry& entry);
  Status load_mxfp4(const StoredTensor& t, Entry& entry);
  // Drops the pins of `indices` and keeps `views` (all empty again) for the next Pin.
  void unpin(std::span<const std::size_t> indices, std::vector<ConstTensorView> views);

  std::vector<StoredTensor> tensors_;
  std::uint64_t budget_;
  mutable std::mutex mu_;
  std::condition_variable loaded_;
  std::vector<Entry> entries_;
  std::vector<AlignedBuffer> free_;  // recycled buffers
  // Empty view tables (one entry per tensor) that Pins reuse: a pin of a few tensors of thousands costs no allocation.
  std::vector<std::vector<ConstTensorView>> view_tables_;
  std::uint64_t held_ = 0;  // bytes of every buffer: entries' and free_
  std::uint64_t peak_held_ = 0;
  std::uint64_t clock_ = 0;
  std::uint64_t bytes_read_ = 0;
  ReadFiles files_;

  // Read-ahead (read_ahead()): each tensor's place in the consumers' order, how far ahead of a pin to read, the
  // tensors queued and the order position up to which they have been.
  std::vector<std::size_t> order_;
  std::vector<std::size_t> place_;
  std::vector<std::size_t> next_in_file_;  // the tensor stored right after each (same file, next byte), or npos
  std::uint64_t lookahead_ = 0;
  std::deque<std::size_t> queued_;
  std::size_t queued_until_ = 0;
  bool stopping_ = false;
  int read_ahead_busy_ = 0;  // threads between taking a queued tensor and finishing its load
  std::condition_variable work_;
  mutable std::condition_variable read_ahead_idle_;
  std::vector<std::thread> read_ahead_threads_;  // last: joined before the rest goes away
};

}  // namespace trestle
