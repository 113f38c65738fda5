#include "tools/bench/bench_safetensors_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "ckpt/file_reader.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"

namespace trestle::cli {
namespace {

constexpr std::uint64_t kPieceBytes = std::uint64_t{8} << 20;

// Runs task(i) for i in [0, count) on up to `threads` threads, each taking the next index; returns the first error.
template <class Task>
Status parallel_for(std::size_t count, unsigned threads, Task task) {
  std::atomic<std::size_t> next{0};
  std::mutex mutex;
  Status first_error;
  auto worker = [&] {
    for (std::size_t i = next++; i < count; i = next++) {
      Status s = task(i);
      if (s.ok()) continue;
      std::lock_guard<std::mutex> lock(mutex);
      if (first_error.ok()) first_error = std::move(s);
      next = count;
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < std::max(1u, threads) && t < count; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  return first_error;
}

// One piece of one tensor: bytes [offset, offset + length) of file `file` go to `destination`.
struct Piece {
  std::size_t file;
  std::uint64_t offset;
  std::uint64_t length;
  std::byte* destination;
};

Result<std::vector<Piece>> plan_pieces(const SafetensorsCheckpoint& ckpt, ReadTarget& target, std::uint64_t step) {
  std::vector<Piece> pieces;
  for (std::size_t f = 0; f < ckpt.files().size(); ++f) {
    const SafetensorsFile& file = ckpt.files()[f];
    for (const SafetensorsEntry& e : file.tensors()) {
      const std::span<std::byte> dst = target.tensor(e.name);
      if (dst.size() != e.nbytes())
        return Status::Error(file.path() + ": tensor '" + e.name + "' does not match the memory prepared for it");
      for (std::uint64_t at = 0; at < e.nbytes(); at += step)
        pieces.push_back({f, file.data_start() + e.begin + at, std::min(step, e.nbytes() - at), dst.data() + at});
    }
  }
  return pieces;
}

// The start of a shard's mapping, from any of its tensors' views.
const std::byte* mapping_of(const SafetensorsFile& file) {
  if (file.tensors().empty()) return nullptr;
  const SafetensorsEntry& e = file.tensors().front();
  return file.view(e).data - file.data_start() - e.begin;
}

Status read_mmap(const SafetensorsCheckpoint& ckpt, ReadTarget& target, unsigned threads) {
  std::vector<const std::byte*> maps;
  for (const SafetensorsFile& file : ckpt.files()) {
    maps.push_back(mapping_of(file));
    if (maps.back() != nullptr)
      (void)::madvise(const_cast<std::byte*>(maps.back()), file.file_size(), MADV_SEQUENTIAL);  // a hint
  }
  TRESTLE_ASSIGN_OR_RETURN(const auto pieces, plan_pieces(ckpt, target, kPieceBytes));
  return parallel_for(pieces.size(), threads, [&](std::size_t i) {
    const Piece& p = pieces[i];
    std::memcpy(p.destination, maps[p.file] + p.offset, p.length);
    return OkStatus();
  });
}

// Reading one byte per page faults every page in, as using the tensors would; the sum keeps the reads.
Status read_view(const SafetensorsCheckpoint& ckpt, ReadTarget& target, unsigned threads) {
  std::vector<const std::byte*> maps;
  for (const SafetensorsFile& file : ckpt.files()) maps.push_back(mapping_of(file));
  TRESTLE_ASSIGN_OR_RETURN(const auto pieces, plan_pieces(ckpt, target, kPieceBytes));
  std::atomic<unsigned> checksum{0};
  const Status status = parallel_for(pieces.size(), threads, [&](std::size_t i) {
    const Piece& p = pieces[i];
    const volatile std::byte* data = maps[p.file] + p.offset;
    unsigned sum = 0;
    for (std::uint64_t at = 0; at < p.length; at += kIoAlignment) sum += static_cast<unsigned>(data[at]);
    sum += static_cast<unsigned>(data[p.length - 1]);
    checksum += sum;
    return OkStatus();
  });
  return status;
}

Status pread_all(int fd, const std::string& path, const Piece& p) {
  std::uint64_t done = 0;
  while (done < p.length) {
    const ssize_t n = ::pread(fd, p.destination + done, p.length - done, static_cast<off_t>(p.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return Status::Error(path + ": cannot read bytes at " + std::to_string(p.offset + done) + ": " +
                           (n == 0 ? "unexpected end of file" : std::strerror(errno)));
    done += static_cast<std::uint64_t>(n);
  }
  return OkStatus();
}

Status read_pread(const SafetensorsCheckpoint& ckpt, ReadTarget& target, unsigned threads) {
  std::vector<int> fds;
  auto close_all = [&] {
    for (int fd : fds) ::close(fd);
  };
  for (const SafetensorsFile& file : ckpt.files()) {
    const int fd = ::open(file.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      close_all();
      return Status::Error(file.path() + ": cannot open: " + std::strerror(errno));
    }
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint: larger read-ahead
    fds.push_back(fd);
  }
  auto pieces = plan_pieces(ckpt, target, kPieceBytes);
  Status status = pieces.status();
  if (status.ok())
    status = parallel_for(pieces->size(), threads, [&](std::size_t i) {
      const Piece& p = (*pieces)[i];
      return pread_all(fds[p.file], ckpt.files()[p.file].path(), p);
    });
  close_all();
  return status;
}

Status read_direct(const SafetensorsCheckpoint& ckpt, ReadTarget& target, unsigned threads) {
  TRESTLE_ASSIGN_OR_RETURN(const auto pieces, plan_pieces(ckpt, target, ~std::uint64_t{0}));
  std::vector<std::vector<ReadRequest>> requests(ckpt.files().size());
  for (const Piece& p : pieces) requests[p.file].push_back({p.offset, p.length, p.destination});
  return parallel_for(requests.size(), threads, [&](std::size_t f) -> Status {
    TRESTLE_ASSIGN_OR_RETURN(auto reader, FileReader::open(ckpt.files()[f].path()));
    return reader->read(requests[f]);
  });
}

}  // namespace

Status write_with_trestle(const StateDict& state, const std::string& dir, std::uint64_t max_shard_bytes) {
  TRESTLE_ASSIGN_OR_RETURN(auto writer, ShardedSafetensorsWriter::create(dir, state.specs(), max_shard_bytes, {}));
  for (std::size_t i = 0; i < state.size(); ++i)
    TRESTLE_RETURN_IF_ERROR(writer->write(state.specs()[i].name, state.bytes(i)));
  return writer->commit();
}

const char* read_method_name(ReadMethod method) {
  switch (method) {
    case ReadMethod::kMmap:
      return "mmap";
    case ReadMethod::kPread:
      return "pread";
    case ReadMethod::kDirect:
      return "direct";
    case ReadMethod::kView:
      return "view";
  }
  return "?";
}

std::optional<ReadMethod> parse_read_method(std::string_view name) {
  for (ReadMethod m : kAllReadMethods)
    if (name == read_method_name(m)) return m;
  return std::nullopt;
}

Result<ReadTarget> ReadTarget::for_checkpoint(const std::string& dir) {
  TRESTLE_ASSIGN_OR_RETURN(const auto ckpt, SafetensorsCheckpoint::open(dir));
  ReadTarget target;
  std::uint64_t cursor = 0;
  for (const SafetensorsFile& file : ckpt.files())
    for (const SafetensorsEntry& e : file.tensors()) {
      const std::uint64_t file_offset = file.data_start() + e.begin;
      cursor = align_up(cursor, kIoAlignment) + file_offset % kIoAlignment;
      target.slots_[e.name] = {cursor, e.nbytes()};
      cursor += e.nbytes();
      target.total_bytes_ += e.nbytes();
    }
  target.arena_ = AlignedBuffer(cursor);  // zero-filled: every page is touched once, here
  return target;
}

std::span<std::byte> ReadTarget::tensor(const std::string& name) {
  auto it = slots_.find(name);
  if (it == slots_.end()) return {};
  return {arena_.data() + it->second.offset, it->second.nbytes};
}

Status ReadTarget::check_equal(const StateDict& state) const {
  for (std::size_t i = 0; i < state.size(); ++i) {
    const std::string& name = state.specs()[i].name;
    auto it = slots_.find(name);
    const auto expected = state.bytes(i);
    if (it == slots_.end() || it->second.nbytes != expected.size() ||
        std::memcmp(arena_.data() + it->second.offset, expected.data(), expected.size()) != 0)
      return Status::Error("tensor '" + name + "' read back differs from what was written");
  }
  return OkStatus();
}

Status read_with_trestle(const std::string& dir, ReadTarget& target, ReadMethod method, unsigned threads) {
  TRESTLE_ASSIGN_OR_RETURN(const auto ckpt, SafetensorsCheckpoint::open(dir));
  switch (method) {
    case ReadMethod::kMmap:
      return read_mmap(ckpt, target, threads);
    case ReadMethod::kPread:
      return read_pread(ckpt, target, threads);
    case ReadMethod::kDirect:
      return read_direct(ckpt, target, threads);
    case ReadMethod::kView:
      return read_view(ckpt, target, threads);
  }
  return Status::Error("unknown read method");
}

}  // namespace trestle::cli
