#include "ckpt/file_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <utility>

#include "ckpt/byte_size.h"

namespace trestle {
namespace {

// Below this a range is copied through a bounce buffer (and can share a request with its neighbours); at or above
// it, the aligned part is read straight into the destination.
constexpr std::uint64_t kStraightMinBytes = 64 << 10;
// Bounced ranges this close to a window's end join that window: reading the gap costs less than another request.
constexpr std::uint64_t kMaxGapBytes = 128 << 10;

}  // namespace

Result<std::unique_ptr<FileReader>> FileReader::open(const std::string& path, const IoOptions& options) {
  const IoOptions o = options.clamped();
  TRESTLE_ASSIGN_OR_RETURN(OpenedFile file, open_for_io(path, O_RDONLY, o.direct, "open"));
  struct stat st {};
  if (::fstat(file.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(file.fd);
    return Status::Error(path + ": not a regular file");
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  // A small file never needs more bounce slices than it has windows (plus one for a window straddling the end).
  const auto slices = static_cast<std::size_t>(std::min<std::uint64_t>(o.queue_depth, size / o.request_bytes + 2));
  try {
    AlignedBuffer bounce(slices * o.request_bytes);
    return std::unique_ptr<FileReader>(new FileReader(path, o, file, size, std::move(bounce)));
  } catch (const std::bad_alloc&) {
    ::close(file.fd);
    return Status::Error(path + ": cannot allocate " + format_bytes(slices * o.request_bytes) + " of read buffers");
  }
}

FileReader::FileReader(std::string path, const IoOptions& options, OpenedFile file, std::uint64_t size,
                       AlignedBuffer bounce)
    : path_(std::move(path)),
      options_(options),
      fd_(file.fd),
      direct_(file.direct),
      file_size_(size),
      bounce_(std::move(bounce)) {
  queue_ = IoQueue::create(fd_, path_, options_.queue_depth, bounce_.span(), options_.request_bytes, options_.use_uring,
                           options_.register_buffers);
  mode_ = queue_->describe(direct_, "pread");
}

FileReader::~FileReader() {
  queue_.reset();
  ::close(fd_);
}

Status FileReader::read(std::span<const ReadRequest> requests) {
  TRESTLE_RETURN_IF_ERROR(check_bounds(requests));
  plan(requests);
  return execute();
}

Status FileReader::check_bounds(std::span<const ReadRequest> requests) const {
  for (const ReadRequest& r : requests) {
    if (r.offset > file_size_ || r.length > file_size_ - r.offset) {
      return Status::Error(path_ + ": cannot read bytes [" + std::to_string(r.offset) + ", " +
                           std::to_string(r.offset + r.length) + "): past the end of the file (" +
                           std::to_string(file_size_) + " bytes)");
    }
  }
  return OkStatus();
}

// Splits each request into a straight part (read into the destination, in request-sized ops) and bounced parts.
// O_DIRECT allows a straight read only where the destination lines up with the file's 4 KiB blocks.
void FileReader::plan(std::span<const ReadRequest> requests) {
  loose_.clear();
  pieces_.clear();
  ops_.clear();
  const std::uint64_t step = options_.request_bytes;
  for (const ReadRequest& r : requests) {
    if (r.length == 0) continue;
    const std::uint64_t begin = r.offset;
    const std::uint64_t end = r.offset + r.length;
    std::uint64_t straight_begin = begin;
    std::uint64_t straight_end = end;
    if (direct_) {
      straight_begin = align_up(begin, kIoAlignment);
      straight_end = align_down(end, kIoAlignment);
    }
    const auto address = reinterpret_cast<std::uintptr_t>(r.destination) + (straight_begin - begin);
    const bool straight = straight_end > straight_begin && straight_end - straight_begin >= kStraightMinBytes &&
                          (!direct_ || address % kIoAlignment == 0);
    if (!straight) {
      loose_.push_back({begin, r.length, r.destination});
      continue;
    }
    if (straight_begin > begin) loose_.push_back({begin, straight_begin - begin, r.destination});
    for (std::uint64_t at = straight_begin; at < straight_end; at += step) {
      const std::uint64_t length = std::min(step, straight_end - at);
      ops_.push_back({at, length, length, r.destination + (at - begin), 0, 0});
    }
    if (end > straight_end) {
      loose_.push_back({straight_end, end - straight_end, r.destination + (straight_end - begin)});
    }
  }
  plan_windows();
  std::stable_sort(ops_.begin(), ops_.end(), [](const Op& x, const Op& y) { return x.offset < y.offset; });
}

// Groups the bounced pieces, in file order, into aligned windows of at most request_bytes; a piece that runs past
// its window's end continues in the next one.
void FileReader::plan_windows() {
  std::sort(loose_.begin(), loose_.end(), [](const Piece& x, const Piece& y) { return x.offset < y.offset; });
  const std::uint64_t step = options_.request_bytes;
  std::size_t window = 0;
  bool open = false;
  for (Piece p : loose_) {
    while (p.length > 0) {
      const Op* w = open ? &ops_[window] : nullptr;
      const bool joins = w != nullptr && p.offset >= w->offset && p.offset < w->offset + step &&
                         p.offset <= w->offset + w->required + kMaxGapBytes;
      if (!joins) {
        ops_.push_back({align_down(p.offset, kIoAlignment), 0, 0, nullptr, pieces_.size(), 0});
        window = ops_.size() - 1;
        open = true;
      }
      Op& op = ops_[window];
      const std::uint64_t take = std::min(p.length, op.offset + step - p.offset);
      pieces_.push_back({p.offset, take, p.destination});
      ++op.piece_count;
      op.required = std::max(op.required, p.offset + take - op.offset);
      op.length = align_up(op.required, kIoAlignment);
      p.offset += take;
      p.destination += take;
      p.length -= take;
    }
  }
}

// Keeps up to queue_depth ops in flight (windows also need a free bounce slice) and copies windows out as they land.
Status FileReader::execute() {
  const std::size_t slices = bounce_.size() / options_.request_bytes;
  free_bounce_.clear();
  for (std::size_t i = slices; i > 0; --i) free_bounce_.push_back(static_cast<unsigned>(i - 1));
  Status error;
  std::size_t next = 0;
  for (;;) {
    while (error.ok() && next < ops_.size() && queue_->in_flight() < queue_->depth()) {
      Op& op = ops_[next];
      IoRequest request;
      request.kind = IoRequest::Kind::kRead;
      request.length = op.length;
      request.offset = op.offset;
      request.required = op.required;
      request.tag = next;
      if (op.destination != nullptr) {
        request.buffer = op.destination;
      } else {
        if (free_bounce_.empty()) break;
        op.bounce = free_bounce_.back();
        free_bounce_.pop_back();
        request.buffer = bounce_.data() + std::size_t{op.bounce} * options_.request_bytes;
        request.buffer_index = static_cast<int>(op.bounce);
      }
      queue_->submit(request);
      ++next;
    }
    if (queue_->in_flight() == 0) break;
    IoCompletion done = queue_->wait();
    const Op& op = ops_[done.tag];
    if (!done.status.ok() && error.ok()) error = done.status;
    if (op.destination != nullptr) continue;
    if (done.status.ok()) {
      const std::byte* window = bounce_.data() + std::size_t{op.bounce} * options_.request_bytes;
      for (std::size_t i = op.first_piece; i < op.first_piece + op.piece_count; ++i) {
        const Piece& piece = pieces_[i];
        std::memcpy(piece.destination, window + (piece.offset - op.offset), piece.length);
      }
    }
    free_bounce_.push_back(op.bounce);
  }
  return error;
}

}  // namespace trestle
