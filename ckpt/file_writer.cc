#include "ckpt/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <utility>

#include "ckpt/byte_size.h"
#include "ckpt/fault_point.h"

namespace trestle {

Result<std::unique_ptr<FileWriter>> FileWriter::create(const std::string& path, const IoOptions& options) {
  const IoOptions o = options.clamped();
  TRESTLE_ASSIGN_OR_RETURN(OpenedFile file, open_for_io(path, O_WRONLY | O_CREAT | O_TRUNC, o.direct, "create"));
  const std::size_t staging_bytes = o.request_bytes * o.queue_depth;
  try {
    AlignedBuffer staging(staging_bytes);
    return std::unique_ptr<FileWriter>(new FileWriter(path, o, file, std::move(staging)));
  } catch (const std::bad_alloc&) {
    ::close(file.fd);
    return Status::Error(path + ": cannot allocate " + format_bytes(staging_bytes) + " of staging buffers");
  }
}

FileWriter::FileWriter(std::string path, const IoOptions& options, OpenedFile file, AlignedBuffer staging)
    : path_(std::move(path)), options_(options), fd_(file.fd), direct_(file.direct), staging_(std::move(staging)) {
  queue_ = IoQueue::create(fd_, path_, options_.queue_depth, staging_.span(), options_.request_bytes,
                           options_.use_uring, options_.register_buffers);
  mode_ = queue_->describe(direct_, "pwrite");
  for (unsigned i = options_.queue_depth; i > 0; --i) free_slices_.push_back(i - 1);
}

FileWriter::~FileWriter() {
  if (closed_) return;
  queue_.reset();  // waits for the requests in flight: the kernel may still be reading the staging buffers
  ::close(fd_);
}

Result<std::uint64_t> FileWriter::append(std::span<const std::byte> data) {
  if (closed_) return Status::Error(path_ + ": append after finish()");
  if (!error_.ok()) return error_;
  const std::uint64_t start = align_up(size_, kIoAlignment);
  TRESTLE_RETURN_IF_ERROR(put(nullptr, start - size_));
  TRESTLE_RETURN_IF_ERROR(put(data.data(), data.size()));
  return start;
}

Status FileWriter::put(const std::byte* source, std::uint64_t bytes) {
  const std::size_t slice_bytes = options_.request_bytes;
  while (bytes > 0) {
    if (current_ < 0) {
      if (free_slices_.empty()) TRESTLE_RETURN_IF_ERROR(reclaim_one());
      current_ = static_cast<int>(free_slices_.back());
      free_slices_.pop_back();
      fill_ = 0;
    }
    std::byte* slice = staging_.data() + static_cast<std::size_t>(current_) * slice_bytes;
    const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(bytes, slice_bytes - fill_));
    if (source != nullptr) {
      std::memcpy(slice + fill_, source, take);
      source += take;
    } else {
      std::memset(slice + fill_, 0, take);
    }
    fill_ += take;
    size_ += take;
    bytes -= take;
    if (fill_ == slice_bytes) submit_current(slice_bytes);
  }
  return OkStatus();
}

void FileWriter::submit_current(std::size_t bytes) {
  IoRequest request;
  request.kind = IoRequest::Kind::kWrite;
  request.buffer = staging_.data() + static_cast<std::size_t>(current_) * options_.request_bytes;
  request.length = bytes;
  request.offset = stream_offset_;
  request.required = bytes;
  request.buffer_index = current_;
  request.tag = static_cast<std::uint64_t>(current_);
  if (direct_) preallocate(stream_offset_ + bytes);
  queue_->submit(request);
  queue_->flush();
  if (Status s = fault_point("write", path_); !s.ok() && error_.ok()) error_ = s;
  stream_offset_ += bytes;
  current_ = -1;
  fill_ = 0;
}

// Keeps the file's size ahead of the writes: on ext4 an O_DIRECT write that extends the file runs synchronously
// under the inode lock, which would serialise the whole queue.
void FileWriter::preallocate(std::uint64_t end) {
  if (!can_preallocate_ || end <= allocated_) return;
  const std::uint64_t target = end + std::uint64_t{options_.queue_depth} * options_.request_bytes;
  if (::fallocate(fd_, 0, static_cast<off_t>(allocated_), static_cast<off_t>(target - allocated_)) != 0) {
    can_preallocate_ = false;  // not supported here (or out of space, which the writes themselves will report)
    return;
  }
  allocated_ = target;
}

Status FileWriter::reclaim_one() {
  IoCompletion done = queue_->wait();
  free_slices_.push_back(static_cast<unsigned>(done.tag));
  if (!done.status.ok() && error_.ok()) error_ = done.status;
  return done.status;
}

Status FileWriter::drain() {
  while (queue_->in_flight() > 0) (void)reclaim_one();
  return error_;
}

Status FileWriter::finish() {
  if (closed_) return Status::Error(path_ + ": finish() called twice");
  if (error_.ok() && current_ >= 0 && fill_ > 0) {
    // O_DIRECT writes whole blocks: pad the last one with zeros; ftruncate below trims the file to size().
    const std::size_t bytes = direct_ ? align_up(fill_, kIoAlignment) : fill_;
    std::memset(staging_.data() + static_cast<std::size_t>(current_) * options_.request_bytes + fill_, 0,
                bytes - fill_);
    submit_current(bytes);
  }
  Status status = drain();
  if (status.ok() && ::ftruncate(fd_, static_cast<off_t>(size_)) != 0) {
    status = Status::Error(path_ + ": cannot set the file size to " + std::to_string(size_) +
                           " bytes: " + std::strerror(errno));
  }
  if (status.ok()) status = fault_point("fdatasync", path_);
  if (status.ok() && ::fdatasync(fd_) != 0) {
    status =
        Status::Error(path_ + ": cannot fdatasync bytes [0, " + std::to_string(size_) + "): " + std::strerror(errno));
  }
  if (status.ok()) status = fault_point("close", path_);
  queue_.reset();
  if (::close(fd_) != 0 && status.ok()) status = Status::Error(path_ + ": cannot close: " + std::strerror(errno));
  closed_ = true;
  return status;
}

}  // namespace trestle
