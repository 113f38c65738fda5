// Trestle's side of `trestle bench safetensors`: write a state dict as a sharded Hugging Face checkpoint, and read a
// checkpoint back into memory allocated beforehand (materialising every tensor, as safetensors' load_file does).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>

#include "ckpt/aligned_buffer.h"
#include "ckpt/status.h"
#include "tools/bench/bench_state_dict.h"

namespace trestle::cli {

// Every tensor through ShardedSafetensorsWriter; its commit fdatasyncs and renames each shard and writes the index.
Status write_with_trestle(const StateDict& state, const std::string& dir, std::uint64_t max_shard_bytes);

// How tensors travel from the files into memory:
//   mmap    map each shard, madvise(MADV_SEQUENTIAL), memcpy in 8 MiB pieces from `threads` threads;
//   pread   buffered pread of 8 MiB pieces straight into place from `threads` threads;
//   direct  FileReader: io_uring + O_DIRECT into place (4 KiB-aligned middles), one shard per thread;
//   view    no copy: the zero-copy views of the mapped shards, one byte of every page touched (what load_file does).
enum class ReadMethod { kMmap, kPread, kDirect, kView };
inline constexpr ReadMethod kAllReadMethods[] = {ReadMethod::kMmap, ReadMethod::kPread, ReadMethod::kDirect,
                                                 ReadMethod::kView};
const char* read_method_name(ReadMethod method);
std::optional<ReadMethod> parse_read_method(std::string_view name);

// Memory for every tensor of one checkpoint, allocated and touched once and reused by every read. Each tensor sits
// at the same offset modulo 4 KiB as in its file, so O_DIRECT can read straight into it.
class ReadTarget {
 public:
  static Result<ReadTarget> for_checkpoint(const std::string& dir);

  std::uint64_t total_bytes() const { return total_bytes_; }
  // The tensor's memory, or an empty span for a name this target was not built for.
  std::span<std::byte> tensor(const std::string& name);
  // Fails naming the first tensor whose bytes differ from `state`'s (or that is missing).
  Status check_equal(const StateDict& state) const;

 private:
  struct Slot {
    std::uint64_t offset;
    std::uint64_t nbytes;
  };
  AlignedBuffer arena_;
  std::unordered_map<std::string, Slot> slots_;
  std::uint64_t total_bytes_ = 0;
};

// Opens the checkpoint in `dir` (validating every header) and copies every tensor into `target` (view: reads every
// page of every tensor where it is mapped, leaving `target` alone).
Status read_with_trestle(const std::string& dir, ReadTarget& target, ReadMethod method, unsigned threads);

}  // namespace trestle::cli
