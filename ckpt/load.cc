#include "ckpt/load.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/checksum.h"
#include "ckpt/chunk_codec.h"
#include "ckpt/file_reader.h"
#include "ckpt/regular_file.h"

namespace trestle {

// Open files and the bounce buffer, kept across load() calls so their buffers are allocated once. Each reader owns
// up to queue_depth x request_bytes of bounce buffers, so only the most recently used few stay open: enough for a
// tensor spread over the files of 8 tensor-parallel ranks, since reopening a reader per wave (allocating and
// registering its buffers again) made a tp4 -> Hugging Face export 30% slower.
struct LoadCache {
  static constexpr std::size_t kOpenReaders = 8;
  std::vector<std::byte> buffer;
  std::vector<std::pair<std::string, std::unique_ptr<FileReader>>> readers;  // most recent last
};

namespace {

// Bytes [raw_offset, raw_offset + bytes) of a block's raw data go to destination.
struct CopyOp {
  std::uint64_t raw_offset;
  std::byte* destination;
  std::uint64_t bytes;
};

// One stored block that some request touches, with everything to copy out of it.
struct BlockTask {
  const StoredChunk* chunk;
  const std::string* tensor;
  std::size_t block;
  std::uint64_t stored_offset;  // in the file
  std::uint64_t stored_bytes;
  std::uint64_t raw_bytes;
  std::vector<CopyOp> copies;
  // Set when one copy covers the whole raw block of a raw chunk: the read lands in the destination directly.
  std::byte* direct = nullptr;
};

std::string describe(const std::string& tensor, const StoredChunk& chunk, std::size_t block) {
  return "tensor '" + tensor + "' chunk " + to_string(chunk.piece) + " in " + chunk.file + " block " +
         std::to_string(block);
}

// Stored offset of every block of a chunk (raw blocks are block_bytes apart; zstd frames follow their sizes).
std::vector<std::uint64_t> block_offsets(const StoredChunk& c, std::uint64_t raw) {
  const std::uint64_t n = block_count(raw, c.block_bytes);
  std::vector<std::uint64_t> out(n + 1, c.byte_offset);
  for (std::uint64_t i = 0; i < n; ++i)
    out[i + 1] =
        out[i] + (c.codec == Codec::kZstd ? c.block_stored_bytes[i] : std::min(c.block_bytes, raw - i * c.block_bytes));
  return out;
}

class Planner {
 public:
  explicit Planner(const Manifest& m) : manifest_(m) {}

  Status add(const LoadRequest& request) {
    auto it = manifest_.tensors.find(request.name);
    if (it == manifest_.tensors.end()) return Status::Error("tensor '" + request.name + "' is not in the checkpoint");
    const TensorEntry& t = it->second;
    const std::string where = "tensor '" + request.name + "' piece " + to_string(request.piece);
    if (!box_within(request.piece.box, t.global_shape))
      return Status::Error(where + ": not within the stored global shape " + to_string(t.global_shape));
    const std::uint64_t esize = dtype_size(t.dtype);
    std::int64_t covered = 0;
    for (const auto& chunk : t.chunks) {
      const std::uint64_t raw = raw_bytes(chunk, t.dtype);
      std::vector<std::uint64_t> offsets;
      for_each_shared_run(chunk.piece, request.piece, [&](const SharedRun& r) {
        if (offsets.empty()) offsets = block_offsets(chunk, raw);
        covered += r.count;
        std::uint64_t from = static_cast<std::uint64_t>(r.a_index) * esize;
        std::byte* to = request.destination + static_cast<std::uint64_t>(r.b_index) * esize;
        std::uint64_t left = static_cast<std::uint64_t>(r.count) * esize;
        while (left > 0) {  // split the run at block boundaries
          const std::size_t block = from / chunk.block_bytes;
          const std::uint64_t in_block = from - block * chunk.block_bytes;
          const std::uint64_t n = std::min(left, chunk.block_bytes - in_block);
          BlockTask& task = task_for(chunk, it->first, block, offsets, raw);
          task.copies.push_back({in_block, to, n});
          from += n;
          to += n;
          left -= n;
        }
      });
    }
    if (covered != request.piece.numel())
      return Status::Error(where + ": stored chunks hold " + std::to_string(covered) + " of its " +
                           std::to_string(request.piece.numel()) +
                           " elements (the checkpoint is incomplete or its chunks overlap)");
    return OkStatus();
  }

  // Every block of every chunk of every tensor, to be read and checked without copying anything out.
  void add_every_block() {
    for (const auto& [name, t] : manifest_.tensors)
      for (const auto& chunk : t.chunks) {
        const std::uint64_t raw = raw_bytes(chunk, t.dtype);
        const auto offsets = block_offsets(chunk, raw);
        for (std::size_t block = 0; block + 1 < offsets.size(); ++block) task_for(chunk, name, block, offsets, raw);
      }
  }

  std::vector<BlockTask> finish() {
    std::vector<BlockTask> out;
    for (auto& [key, task] : tasks_) {
      if (task.chunk->codec == Codec::kRaw && task.copies.size() == 1 && task.copies[0].bytes == task.raw_bytes)
        task.direct = task.copies[0].destination;
      out.push_back(std::move(task));
    }
    std::sort(out.begin(), out.end(), [](const BlockTask& a, const BlockTask& b) {
      return std::tie(a.chunk->file, a.stored_offset) < std::tie(b.chunk->file, b.stored_offset);
    });
    return out;
  }

 private:
  BlockTask& task_for(const StoredChunk& chunk, const std::string& tensor, std::size_t block,
                      const std::vector<std::uint64_t>& offsets, std::uint64_t raw) {
    auto [it, inserted] = tasks_.try_emplace({&chunk, block});
    if (inserted) {
      const std::uint64_t raw_in_block = std::min(chunk.block_bytes, raw - block * chunk.block_bytes);
      it->second = BlockTask{&chunk,       &tensor, block,  offsets[block], offsets[block + 1] - offsets[block],
                             raw_in_block, {},      nullptr};
    }
    return it->second;
  }
  const Manifest& manifest_;
  std::map<std::pair<const StoredChunk*, std::size_t>, BlockTask> tasks_;
};

// Reads, verifies and copies out a list of block tasks in waves that fit the buffer budget.
class BlockExecutor {
 public:
  BlockExecutor(const std::string& dir, const IoOptions& io, std::uint64_t budget, LoadCache& cache)
      : dir_(dir), io_(io), budget_(budget), buffer_(cache.buffer), readers_(cache.readers) {}

  Status run(std::vector<BlockTask>& tasks, LoadStats* stats) {
    std::size_t begin = 0;
    while (begin < tasks.size()) {
      // A wave: consecutive tasks of one file whose bounce buffers fit the budget (at least one task).
      std::size_t end = begin;
      std::uint64_t buffered = 0;
      while (end < tasks.size() && tasks[end].chunk->file == tasks[begin].chunk->file &&
             (end == begin || buffered + bounce_bytes(tasks[end]) <= budget_)) {
        buffered += bounce_bytes(tasks[end]);
        ++end;
      }
      TRESTLE_RETURN_IF_ERROR(run_wave(std::span(tasks).subspan(begin, end - begin), buffered, stats));
      begin = end;
    }
    return OkStatus();
  }

 private:
  static std::uint64_t bounce_bytes(const BlockTask& t) {
    if (t.direct) return 0;
    return t.stored_bytes + (t.chunk->codec == Codec::kZstd ? t.raw_bytes : 0);
  }

  Status run_wave(std::span<BlockTask> wave, std::uint64_t buffered, LoadStats* stats) {
    TRESTLE_ASSIGN_OR_RETURN(FileReader * reader, reader_for(wave.front().chunk->file));
    if (buffer_.size() < buffered) {  // grown without a copy: the old buffer goes first
      std::vector<std::byte>().swap(buffer_);
      try {
        buffer_.resize(buffered);
      } catch (const std::bad_alloc&) {
        const BlockTask& t = wave.front();
        return Status::Error(dir_ + "/" + t.chunk->file + ": tensor '" + *t.tensor + "' chunk " +
                             to_string(t.chunk->piece) + ": cannot allocate " + std::to_string(buffered) +
                             " bytes to read its blocks");
      }
    }
    std::vector<ReadRequest> reads;
    std::vector<std::byte*> stored(wave.size()), raw(wave.size());
    std::uint64_t cursor = 0;
    for (std::size_t i = 0; i < wave.size(); ++i) {
      const BlockTask& t = wave[i];
      if (t.direct) {
        stored[i] = raw[i] = t.direct;
      } else {
        stored[i] = buffer_.data() + cursor;
        cursor += t.stored_bytes;
        raw[i] = stored[i];
        if (t.chunk->codec == Codec::kZstd) {
          raw[i] = buffer_.data() + cursor;
          cursor += t.raw_bytes;
        }
      }
      if (t.stored_bytes) reads.push_back({t.stored_offset, t.stored_bytes, stored[i]});
      if (stats) stats->bytes_read += t.stored_bytes;
    }
    TRESTLE_RETURN_IF_ERROR(reader->read(reads));
    for (std::size_t i = 0; i < wave.size(); ++i) {
      const BlockTask& t = wave[i];
      TRESTLE_RETURN_IF_ERROR(decode_block(t.chunk->codec, {stored[i], t.stored_bytes}, {raw[i], t.raw_bytes},
                                           t.chunk->block_checksums[t.block],
                                           dir_ + ": " + describe(*t.tensor, *t.chunk, t.block)));
      for (const auto& c : t.copies) {
        if (!t.direct) std::memcpy(c.destination, raw[i] + c.raw_offset, c.bytes);
        if (stats) stats->bytes_copied += c.bytes;
      }
      if (stats) stats->blocks_verified += 1;
    }
    return OkStatus();
  }

  Result<FileReader*> reader_for(const std::string& file) {
    auto it = std::find_if(readers_.begin(), readers_.end(), [&](const auto& r) { return r.first == file; });
    if (it != readers_.end()) {
      std::rotate(it, it + 1, readers_.end());
      return readers_.back().second.get();
    }
    TRESTLE_ASSIGN_OR_RETURN(auto reader, FileReader::open(dir_ + "/" + file, io_));
    if (readers_.size() >= LoadCache::kOpenReaders) readers_.erase(readers_.begin());
    readers_.emplace_back(file, std::move(reader));
    return readers_.back().second.get();
  }

  const std::string& dir_;
  IoOptions io_;
  std::uint64_t budget_;
  std::vector<std::byte>& buffer_;
  std::vector<std::pair<std::string, std::unique_ptr<FileReader>>>& readers_;
};

// Every chunk's stored bytes lie within its data file, a regular file of the iteration directory (not a link), so no
// read runs past a file's end and nothing is sized from a claim the files cannot back.
Status check_files_hold_chunks(const std::string& dir, const Manifest& manifest) {
  std::map<std::string, std::uint64_t> sizes;
  for (const auto& [name, t] : manifest.tensors)
    for (const auto& c : t.chunks) {
      auto it = sizes.find(c.file);
      if (it == sizes.end()) {
        const std::string path = dir + "/" + c.file;
        struct stat st {};
        if (::lstat(path.c_str(), &st) != 0)
          return Status::Error(path + ": cannot stat data file of tensor '" + name + "': " + std::strerror(errno));
        if (!S_ISREG(st.st_mode))
          return Status::Error(path + ": data file of tensor '" + name +
                               "' is not a regular file (links are not followed)");
        it = sizes.emplace(c.file, static_cast<std::uint64_t>(st.st_size)).first;
      }
      if (c.byte_offset > it->second || c.stored_bytes > it->second - c.byte_offset)
        return Status::Error(dir + "/" + c.file + ": tensor '" + name + "' chunk " + to_string(c.piece) +
                             " is stored at bytes [" + std::to_string(c.byte_offset) + ", +" +
                             std::to_string(c.stored_bytes) + "), past the end of the " + std::to_string(it->second) +
                             "-byte file");
    }
  for (const auto& [name, recorded] : manifest.files) {
    const std::string path = dir + "/" + name;
    for (std::size_t slash = name.find('/'); slash != std::string::npos; slash = name.find('/', slash + 1))
      TRESTLE_RETURN_IF_ERROR(refuse_checkpoint_link(dir + "/" + name.substr(0, slash)));  // (hf_files/)
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0)
      return Status::Error(path + ": recorded in the manifest but cannot be read: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return Status::Error(path + ": not a regular file (links are not followed)");
    if (static_cast<std::uint64_t>(st.st_size) != recorded.bytes)
      return Status::Error(path + ": " + std::to_string(st.st_size) + " bytes, the manifest records " +
                           std::to_string(recorded.bytes));
  }
  return OkStatus();
}

}  // namespace

Result<CheckpointReader> CheckpointReader::open(const std::string& root, std::optional<std::int64_t> iteration,
                                                const IoOptions& io) {
  TRESTLE_ASSIGN_OR_RETURN(std::string dir, resolve_iteration_dir(root, iteration));
  return open_directory(dir, io);
}

Result<CheckpointReader> CheckpointReader::open_directory(const std::string& dir, const IoOptions& io) {
  // A checkpoint's iteration directory and manifest are its own, never links (which could lead out of it).
  for (const std::string& path : {dir, dir + "/" + kManifestFile}) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
      return Status::Error(path +
                           ": a symbolic link; a checkpoint's own directories and files are never links, and "
                           "links are not followed");
  }
  const std::string manifest_path = dir + "/" + kManifestFile;
  // Read again when the iteration was replaced meanwhile (its manifest file before and after is another): the manifest
  // and the file sizes checked then belong to one save.
  for (int attempt = 1;; ++attempt) {
    const std::optional<FileIdentity> before = identity_of(manifest_path);
    auto manifest = read_manifest(manifest_path);
    Status checked = manifest.ok() ? OkStatus() : manifest.status();
    const std::string name = std::filesystem::path(dir).lexically_normal().filename().string();
    if (checked.ok() && name.starts_with("iter_") && name != iteration_dir_name(manifest->iteration))
      checked = Status::Error(manifest_path + ": records iteration " + std::to_string(manifest->iteration) +
                              ", but it is in " + name);
    if (checked.ok()) checked = check_files_hold_chunks(dir, *manifest);
    const std::optional<FileIdentity> after = identity_of(manifest_path);
    if (before == after) {  // (both absent: the read failed, saying why)
      if (!checked.ok() || !after) return checked.ok() ? Status::Error(manifest_path + ": missing") : checked;
      return CheckpointReader(dir, std::move(*manifest), io, *after);
    }
    if (attempt == 3)
      return Status::Error(dir + ": replaced again and again while it was opened (other jobs saving this iteration)" +
                           (checked.ok() ? std::string() : "; " + checked.message()));
  }
}

CheckpointReader::CheckpointReader(std::string dir, Manifest manifest, IoOptions io, FileIdentity manifest_identity)
    : dir_(std::move(dir)),
      manifest_(std::move(manifest)),
      manifest_identity_(manifest_identity),
      io_(io),
      cache_(std::make_unique<LoadCache>()) {}

std::optional<CheckpointReader::FileIdentity> CheckpointReader::identity_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return FileIdentity{static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

Status CheckpointReader::unless_replaced(Status status) const {
  if (status.ok()) return status;
  if (const auto now = identity_of(dir_ + "/" + kManifestFile); now && *now == manifest_identity_) return status;
  return Status::Error(dir_ + ": replaced or removed while it was read (another job saved iteration " +
                       std::to_string(manifest_.iteration) +
                       " again): its files are no longer those of the manifest read; read it again (what failed: " +
                       status.message() + ")");
}

CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;
CheckpointReader::~CheckpointReader() = default;

Status CheckpointReader::load(std::span<const LoadRequest> requests, LoadStats* stats,
                              std::uint64_t buffer_budget) const {
  Planner planner(manifest_);
  for (const auto& r : requests) TRESTLE_RETURN_IF_ERROR(planner.add(r).with_context(dir_));
  auto tasks = planner.finish();
  return unless_replaced(BlockExecutor(dir_, io_, buffer_budget, *cache_).run(tasks, stats));
}

Status CheckpointReader::verify_files() const {
  for (const auto& [name, recorded] : manifest_.files) {
    auto found = digest_recorded_file(dir_ + "/" + name);
    if (!found.ok()) return unless_replaced(found.status());
    if (*found != recorded)
      return unless_replaced(Status::Error(dir_ + "/" + name + ": contents differ from the manifest's record (" +
                                           std::to_string(found->bytes) + " bytes, xxh3 " + to_hex(found->xxh3) +
                                           "; recorded " + std::to_string(recorded.bytes) + " bytes, xxh3 " +
                                           to_hex(recorded.xxh3) + ")"));
  }
  return OkStatus();
}

Status CheckpointReader::verify(LoadStats* stats) const {
  // The manifest's chunks were checked to cover every tensor exactly once when it was read (manifest_from_json), so
  // what is left is the recorded files and every stored block: read, decoded and checked in waves of a bounded
  // buffer, whatever the tensors' sizes (nothing is allocated from what the manifest claims beyond one wave).
  TRESTLE_RETURN_IF_ERROR(verify_files());
  Planner planner(manifest_);
  planner.add_every_block();
  auto tasks = planner.finish();
  return unless_replaced(BlockExecutor(dir_, io_, kVerifyBufferBytes, *cache_).run(tasks, stats));
}

}  // namespace trestle
