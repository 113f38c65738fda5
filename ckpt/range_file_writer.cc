#include "ckpt/range_file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <new>

#include "ckpt/byte_size.h"
#include "ckpt/fault_point.h"

namespace trestle {
namespace {

std::string byte_range(std::uint64_t start, std::uint64_t end) {
  return "bytes [" + std::to_string(start) + ", " + std::to_string(end) + ")";
}

// Calls fn(start, end) for each stretch of [lo, hi) covered by `ranges` (merged, start -> end), in order.
template <typename Fn>
void for_each_covered(const std::map<std::uint64_t, std::uint64_t>& ranges, std::uint64_t lo, std::uint64_t hi,
                      Fn&& fn) {
  auto it = ranges.upper_bound(lo);
  if (it != ranges.begin() && std::prev(it)->second > lo) --it;
  for (; it != ranges.end() && it->first < hi; ++it) fn(std::max(it->first, lo), std::min(it->second, hi));
}

}  // namespace

Result<std::unique_ptr<RangeFileWriter>> RangeFileWriter::create(const std::string& path, std::uint64_t size,
                                                                 const IoOptions& options) {
  const IoOptions o = options.clamped();
  TRESTLE_ASSIGN_OR_RETURN(OpenedFile file, open_for_io(path, O_WRONLY | O_CREAT | O_TRUNC, o.direct, "create"));
  // Reserve the blocks up front (best effort): on ext4 an O_DIRECT write past the end of the file runs synchronously
  // under the inode lock, which would serialise the queue.
  if (size > 0) (void)::fallocate(file.fd, 0, 0, static_cast<off_t>(size));
  return std::unique_ptr<RangeFileWriter>(new RangeFileWriter(path, size, o, file));
}

RangeFileWriter::RangeFileWriter(std::string path, std::uint64_t size, const IoOptions& options, OpenedFile file)
    : path_(std::move(path)),
      size_(size),
      options_(options),
      fd_(file.fd),
      direct_(file.direct),
      mode_(direct_ ? "O_DIRECT" : "buffered") {}

RangeFileWriter::~RangeFileWriter() {
  if (closed_) return;
  queue_.reset();  // waits for the requests in flight: the kernel may still be reading the staging buffers
  ::close(fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
}

Status RangeFileWriter::start_staging() {
  const std::uint64_t window = options_.request_bytes;
  const auto slices =
      static_cast<unsigned>(std::clamp<std::uint64_t>((size_ + window - 1) / window, 1, options_.queue_depth));
  const std::size_t bytes = static_cast<std::size_t>(slices) * options_.request_bytes;
  try {
    staging_ = AlignedBuffer(bytes);
  } catch (const std::bad_alloc&) {
    return Status::Error(path_ + ": cannot allocate " + format_bytes(bytes) + " of staging buffers");
  }
  queue_ = IoQueue::create(fd_, path_, slices, staging_.span(), options_.request_bytes, options_.use_uring,
                           options_.register_buffers);
  mode_ = queue_->describe(direct_, "pwrite");
  for (unsigned i = slices; i > 0; --i) free_slices_.push_back(i - 1);
  return OkStatus();
}

void RangeFileWriter::stop_staging() {
  queue_.reset();
  staging_ = AlignedBuffer();
  free_slices_.clear();
}

std::uint64_t RangeFileWriter::window_length(std::uint64_t index) const {
  return std::min<std::uint64_t>(options_.request_bytes, size_ - index * options_.request_bytes);
}

Status RangeFileWriter::claim_range(std::uint64_t start, std::uint64_t end) {
  auto next = ranges_.upper_bound(start);
  auto prev = next == ranges_.begin() ? ranges_.end() : std::prev(next);
  const bool overlaps_prev = prev != ranges_.end() && prev->second > start;
  const bool overlaps_next = next != ranges_.end() && next->first < end;
  if (overlaps_prev || overlaps_next) {
    const auto& other = overlaps_prev ? *prev : *next;
    return Status::Error(path_ + ": " + byte_range(start, end) + " overlap " + byte_range(other.first, other.second) +
                         " written before");
  }
  std::uint64_t merged_start = start, merged_end = end;
  if (prev != ranges_.end() && prev->second == start) {
    merged_start = prev->first;
    ranges_.erase(prev);
  }
  if (next != ranges_.end() && next->first == end) {
    merged_end = next->second;
    ranges_.erase(next);
  }
  ranges_[merged_start] = merged_end;
  return OkStatus();
}

Status RangeFileWriter::write(std::uint64_t offset, std::span<const std::byte> data) {
  if (closed_) return Status::Error(path_ + ": write after finish()");
  if (!error_.ok()) return error_;
  if (data.empty()) return OkStatus();
  if (offset > size_ || data.size() > size_ - offset)
    return Status::Error(path_ + ": " + byte_range(offset, offset + data.size()) + " lie outside the file's " +
                         std::to_string(size_) + " bytes");
  TRESTLE_RETURN_IF_ERROR(claim_range(offset, offset + data.size()));
  const std::uint64_t window = options_.request_bytes;
  const std::byte* source = data.data();
  std::uint64_t remaining = data.size();
  while (remaining > 0) {
    const std::uint64_t index = offset / window;
    const std::uint64_t within = offset - index * window;
    const std::uint64_t take = std::min(remaining, window - within);
    if (spilled_.count(index) != 0) {
      TRESTLE_RETURN_IF_ERROR(write_buffered(offset, source, take));
    } else {
      TRESTLE_ASSIGN_OR_RETURN(Window * open, window_for(index));
      std::memcpy(staging_.data() + static_cast<std::size_t>(open->slice) * window + within, source, take);
      open->filled += take;
      if (open->filled == window_length(index)) submit(index, *open);
    }
    source += take;
    offset += take;
    remaining -= take;
  }
  written_ += data.size();
  TRESTLE_RETURN_IF_ERROR(fault_point("write", path_));
  if (written_ == size_ && queue_) {  // every window is out: wait for them and give the memory back
    Status status = drain();
    stop_staging();
    return status;
  }
  return OkStatus();
}

Result<RangeFileWriter::Window*> RangeFileWriter::window_for(std::uint64_t index) {
  auto it = open_.find(index);
  if (it != open_.end()) return &it->second;
  if (!queue_) TRESTLE_RETURN_IF_ERROR(start_staging());
  while (free_slices_.empty()) {
    if (queue_->in_flight() > 0) {
      TRESTLE_RETURN_IF_ERROR(reclaim_one());
    } else {
      TRESTLE_RETURN_IF_ERROR(spill_oldest());
    }
  }
  Window fresh;
  fresh.slice = static_cast<int>(free_slices_.back());
  fresh.age = ++clock_;
  free_slices_.pop_back();
  return &open_.emplace(index, fresh).first->second;
}

void RangeFileWriter::submit(std::uint64_t index, Window& window) {
  const std::uint64_t length = window_length(index);
  // O_DIRECT writes whole blocks: the last window is padded with zeros and finish() trims the file to size().
  const std::uint64_t bytes = direct_ ? align_up(length, kIoAlignment) : length;
  std::byte* slice = staging_.data() + static_cast<std::size_t>(window.slice) * options_.request_bytes;
  std::memset(slice + length, 0, bytes - length);
  IoRequest request;
  request.kind = IoRequest::Kind::kWrite;
  request.buffer = slice;
  request.length = bytes;
  request.offset = index * options_.request_bytes;
  request.required = bytes;
  request.buffer_index = window.slice;
  request.tag = static_cast<std::uint64_t>(window.slice);
  queue_->submit(request);
  queue_->flush();
  open_.erase(index);
}

// Every staging window holds a partly filled one and nothing is in flight: the oldest goes through the page cache.
Status RangeFileWriter::spill_oldest() {
  auto oldest = std::min_element(open_.begin(), open_.end(),
                                 [](const auto& a, const auto& b) { return a.second.age < b.second.age; });
  const std::uint64_t index = oldest->first;
  const std::uint64_t start = index * options_.request_bytes;
  const std::byte* slice = staging_.data() + static_cast<std::size_t>(oldest->second.slice) * options_.request_bytes;
  Status status;
  for_each_covered(ranges_, start, start + window_length(index), [&](std::uint64_t lo, std::uint64_t hi) {
    if (status.ok()) status = write_buffered(lo, slice + (lo - start), hi - lo);
  });
  TRESTLE_RETURN_IF_ERROR(status);
  free_slices_.push_back(static_cast<unsigned>(oldest->second.slice));
  spilled_.insert(index);
  open_.erase(oldest);
  return OkStatus();
}

Status RangeFileWriter::write_buffered(std::uint64_t offset, const std::byte* data, std::uint64_t bytes) {
  if (direct_ && buffered_fd_ < 0) {
    buffered_fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
    if (buffered_fd_ < 0) return Status::Error(path_ + ": cannot reopen for buffered writes: " + std::strerror(errno));
  }
  const int fd = direct_ ? buffered_fd_ : fd_;
  const std::uint64_t end = offset + bytes;
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, data, transfer_length(bytes, fd), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return Status::Error(path_ + ": cannot write " + byte_range(offset, end) + ": " +
                           (n < 0 ? std::strerror(errno) : "nothing written at byte " + std::to_string(offset)));
    data += n;
    offset += static_cast<std::uint64_t>(n);
    bytes -= static_cast<std::uint64_t>(n);
  }
  return OkStatus();
}

void RangeFileWriter::zero_gaps(std::uint64_t index, std::byte* slice) const {
  const std::uint64_t start = index * options_.request_bytes;
  std::uint64_t cursor = start;
  for_each_covered(ranges_, start, start + window_length(index), [&](std::uint64_t lo, std::uint64_t hi) {
    std::memset(slice + (cursor - start), 0, lo - cursor);
    cursor = hi;
  });
  std::memset(slice + (cursor - start), 0, start + window_length(index) - cursor);
}

Status RangeFileWriter::reclaim_one() {
  IoCompletion done = queue_->wait();
  free_slices_.push_back(static_cast<unsigned>(done.tag));
  if (!done.status.ok() && error_.ok()) error_ = done.status;
  return done.status;
}

Status RangeFileWriter::drain() {
  while (queue_->in_flight() > 0) (void)reclaim_one();
  return error_;
}

Status RangeFileWriter::finish() {
  if (closed_) return Status::Error(path_ + ": finish() called twice");
  Status status = error_;
  if (queue_) {
    while (status.ok() && !open_.empty()) {  // partly written windows: the missing bytes read as zeros
      auto& [index, window] = *open_.begin();
      zero_gaps(index, staging_.data() + static_cast<std::size_t>(window.slice) * options_.request_bytes);
      submit(index, window);
    }
    const Status drained = drain();
    if (status.ok()) status = drained;
    stop_staging();
  }
  if (status.ok() && ::ftruncate(fd_, static_cast<off_t>(size_)) != 0)
    status = Status::Error(path_ + ": cannot set the file size to " + std::to_string(size_) +
                           " bytes: " + std::strerror(errno));
  if (status.ok()) status = fault_point("fdatasync", path_);
  if (status.ok() && ::fdatasync(fd_) != 0)
    status = Status::Error(path_ + ": cannot fdatasync: " + std::string(std::strerror(errno)));
  if (status.ok()) status = fault_point("close", path_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  if (::close(fd_) != 0 && status.ok()) status = Status::Error(path_ + ": cannot close: " + std::strerror(errno));
  closed_ = true;
  return status;
}

}  // namespace trestle
