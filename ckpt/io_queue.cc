#include "ckpt/io_queue.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "ckpt/byte_size.h"
#include "ckpt/fault_point.h"
#include "ckpt/io_log.h"
#include "ckpt/regular_file.h"

namespace trestle {
namespace {

// Bytes that must arrive: all of a write; a read may stop at end of file once it has `required`.
std::uint64_t needed(const IoRequest& r) { return r.kind == IoRequest::Kind::kWrite ? r.length : r.required; }

// Why a transfer that made no progress after `done` bytes failed.
std::string stopped_early(const IoRequest& r, std::uint64_t done) {
  const std::string at = std::to_string(r.offset + done);
  return r.kind == IoRequest::Kind::kRead ? "unexpected end of file at offset " + at
                                          : "short write: nothing written at offset " + at;
}

std::string memlock_limit() {
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return "unlimited";
  return format_bytes(limit.rlim_cur);
}

// io_uring: requests go to the kernel in batches; a slot per request in flight remembers how far it has got.
class UringQueue final : public IoQueue {
 public:
  UringQueue(int fd, std::string path, unsigned depth, const io_uring& ring)
      : IoQueue(fd, std::move(path), depth), ring_(ring), slots_(depth) {
    for (unsigned i = depth; i > 0; --i) free_slots_.push_back(i - 1);
  }

  ~UringQueue() override {
    while (in_flight_ > 0) (void)wait();
    io_uring_queue_exit(&ring_);
  }

  void register_buffers(std::span<std::byte> region, std::size_t slice_bytes) {
    std::vector<iovec> slices;
    for (std::size_t at = 0; at + slice_bytes <= region.size(); at += slice_bytes) {
      slices.push_back({region.data() + at, slice_bytes});
    }
    if (slices.empty()) return;
    const int rc = io_uring_register_buffers(&ring_, slices.data(), static_cast<unsigned>(slices.size()));
    if (rc == 0) {
      registered_ = true;
      return;
    }
    const std::string what = std::to_string(slices.size()) + " I/O buffers of " + format_bytes(slice_bytes);
    log_once("io_uring_register_buffers", "cannot register " + what + " with io_uring (" + std::strerror(-rc) +
                                              "; RLIMIT_MEMLOCK is " + memlock_limit() +
                                              "); using unregistered buffers");
  }

  bool uses_uring() const override { return true; }
  bool registered() const override { return registered_; }

  void submit(const IoRequest& request) override {
    const unsigned slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot] = {request, 0, true};
    ++in_flight_;
    prepare(slot);
  }

  void flush() override {
    if (unsubmitted_ == 0) return;
    int rc;
    do rc = io_uring_submit(&ring_);
    while (rc == -EINTR || rc == -EAGAIN);
    if (rc > 0) unsubmitted_ -= std::min<unsigned>(unsubmitted_, static_cast<unsigned>(rc));
  }

  IoCompletion wait() override {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      if (io_uring_peek_cqe(&ring_, &cqe) != 0 || cqe == nullptr) {
        const int rc = io_uring_submit_and_wait(&ring_, 1);
        if (rc >= 0) unsubmitted_ = 0;
        if (rc >= 0 || rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) continue;
        return abandon_one(rc);
      }
      const auto slot = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
      const int result = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (auto done = settle(slot, result)) return *std::move(done);
    }
  }

 private:
  struct Slot {
    IoRequest request;
    std::uint64_t done = 0;
    bool busy = false;
  };

  void prepare(unsigned slot) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {
      flush();
      sqe = io_uring_get_sqe(&ring_);
    }
    const Slot& s = slots_[slot];
    const IoRequest& r = s.request;
    std::byte* at = r.buffer + s.done;
    const auto length = static_cast<unsigned>(transfer_length(r.length - s.done, fd_));
    const std::uint64_t offset = r.offset + s.done;
    const bool fixed = registered_ && r.buffer_index >= 0;
    if (r.kind == IoRequest::Kind::kRead) {
      if (fixed) {
        io_uring_prep_read_fixed(sqe, fd_, at, length, offset, r.buffer_index);
      } else {
        io_uring_prep_read(sqe, fd_, at, length, offset);
      }
    } else {
      if (fixed) {
        io_uring_prep_write_fixed(sqe, fd_, at, length, offset, r.buffer_index);
      } else {
        io_uring_prep_write(sqe, fd_, at, length, offset);
      }
    }
    io_uring_sqe_set_data64(sqe, slot);
    ++unsubmitted_;
  }

  // The ring itself failed (io_uring_enter returned an error that waiting again will not cure): report the requests
  // in flight as failed, one per call, rather than wait forever for completions that will not come.
  IoCompletion abandon_one(int rc) {
    unsigned slot = 0;
    while (!slots_[slot].busy) ++slot;
    return finish(slot, transfer_error(slots_[slot].request, std::string("io_uring_enter: ") + std::strerror(-rc)));
  }

  IoCompletion finish(unsigned slot, Status status) {
    slots_[slot].busy = false;
    free_slots_.push_back(slot);
    --in_flight_;
    return IoCompletion{slots_[slot].request.tag, std::move(status)};
  }

  // Applies one result to its slot: the finished completion, or nothing when the rest was resubmitted.
  std::optional<IoCompletion> settle(unsigned slot, int result) {
    Slot& s = slots_[slot];
    if (result == -EINTR || result == -EAGAIN) {
      prepare(slot);
      return std::nullopt;
    }
    Status status;
    if (result < 0) {
      // After a short transfer the rest starts where it stopped, which O_DIRECT refuses (EINVAL) when that is not
      // block-aligned: the reason is the short write (a full disk, a file size limit), not the argument.
      status = transfer_error(
          s.request, s.done > 0
                         ? "short write: " + std::to_string(s.done) + " bytes written, then the rest at offset " +
                               std::to_string(s.request.offset + s.done) + " failed: " + std::strerror(-result) +
                               " (is the disk full, or a file size limit reached?)"
                         : std::string(std::strerror(-result)));
    } else {
      s.done += static_cast<std::uint64_t>(result);
      if (s.done < needed(s.request)) {
        if (result > 0 && s.done < s.request.length) {
          prepare(slot);  // a short transfer: continue with the rest
          return std::nullopt;
        }
        status = transfer_error(s.request, stopped_early(s.request, s.done));
      }
    }
    return finish(slot, std::move(status));
  }

  io_uring ring_;
  bool registered_ = false;
  unsigned unsubmitted_ = 0;
  std::vector<Slot> slots_;
  std::vector<unsigned> free_slots_;
};

// pread/pwrite: each request runs to completion when submitted; wait() hands the results back in order.
class SyncQueue final : public IoQueue {
 public:
  SyncQueue(int fd, std::string path, unsigned depth) : IoQueue(fd, std::move(path), depth), ready_(depth) {}

  bool uses_uring() const override { return false; }
  bool registered() const override { return false; }

  void submit(const IoRequest& request) override {
    ready_[(head_ + in_flight_) % depth_] = {request.tag, transfer(request)};
    ++in_flight_;
  }
  void flush() override {}
  IoCompletion wait() override {
    IoCompletion done = std::move(ready_[head_]);
    head_ = (head_ + 1) % depth_;
    --in_flight_;
    return done;
  }

 private:
  Status transfer(const IoRequest& r) const {
    std::uint64_t done = 0;
    while (done < needed(r)) {
      const auto length = transfer_length(static_cast<std::size_t>(r.length - done), fd_);
      const auto offset = static_cast<off_t>(r.offset + done);
      const ssize_t n = r.kind == IoRequest::Kind::kRead ? ::pread(fd_, r.buffer + done, length, offset)
                                                         : ::pwrite(fd_, r.buffer + done, length, offset);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0) return transfer_error(r, std::strerror(errno));
      if (n == 0) {
        return transfer_error(r, stopped_early(r, done));
      }
      done += static_cast<std::uint64_t>(n);
    }
    return OkStatus();
  }

  std::vector<IoCompletion> ready_;  // a ring of depth_ entries starting at head_
  unsigned head_ = 0;
};

}  // namespace

Result<OpenedFile> open_for_io(const std::string& path, int flags, bool direct, const char* what) {
  if ((flags & O_ACCMODE) == O_RDONLY) {
    // Only a regular file is opened, without blocking (a FIFO would block the open forever); O_DIRECT is asked for in
    // the open itself, which a file system or sandbox refusing it fails with EINVAL.
    const int other_flags = flags & ~O_ACCMODE;
    if (direct) {
      int open_error = 0;
      auto fd = open_regular_file(path, other_flags | O_DIRECT, &open_error);
      if (fd.ok()) return OpenedFile{*fd, true};
      if (open_error != EINVAL) return fd.status();
      log_once("O_DIRECT", path + ": the file system refuses O_DIRECT (" + std::strerror(EINVAL) +
                               "); using buffered I/O for such files");
    }
    TRESTLE_ASSIGN_OR_RETURN(const int fd, open_regular_file(path, other_flags));
    return OpenedFile{fd, false};
  }
  if (direct) {
    const int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0) return OpenedFile{fd, true};
    if (errno != EINVAL) return Status::Error(path + ": cannot " + what + ": " + std::strerror(errno));
    log_once("O_DIRECT", path + ": the file system refuses O_DIRECT (" + std::strerror(EINVAL) +
                             "); using buffered I/O for such files");
  }
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (fd < 0) return Status::Error(path + ": cannot " + what + ": " + std::strerror(errno));
  return OpenedFile{fd, false};
}

std::unique_ptr<IoQueue> IoQueue::create(int fd, std::string path, unsigned depth, std::span<std::byte> region,
                                         std::size_t slice_bytes, bool use_uring, bool register_buffers) {
  if (use_uring) {
    io_uring ring{};
    const int rc = io_uring_queue_init(depth, &ring, 0);
    if (rc == 0) {
      auto queue = std::make_unique<UringQueue>(fd, std::move(path), depth, ring);
      if (register_buffers) queue->register_buffers(region, slice_bytes);
      return queue;
    }
    log_once("io_uring_queue_init", std::string("io_uring is unavailable (io_uring_queue_init: ") + std::strerror(-rc) +
                                        "); using pread/pwrite");
  }
  return std::make_unique<SyncQueue>(fd, std::move(path), depth);
}

std::string IoQueue::describe(bool direct, const char* sync_call) const {
  std::string mode = uses_uring() ? "io_uring" : sync_call;
  if (direct) {
    mode += "+O_DIRECT";
    if (registered()) mode += " (registered)";
  } else {
    mode += registered() ? " (buffered, registered)" : " (buffered)";
  }
  return mode;
}

Status IoQueue::transfer_error(const IoRequest& request, const std::string& reason) const {
  const char* verb = request.kind == IoRequest::Kind::kRead ? "read" : "write";
  return Status::Error(path_ + ": cannot " + verb + " bytes [" + std::to_string(request.offset) + ", " +
                       std::to_string(request.offset + request.length) + "): " + reason);
}

}  // namespace trestle
