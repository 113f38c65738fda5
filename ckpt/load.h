// Loading is resharding: a caller asks for pieces (box, optionally a flat range) of named tensors into its own
// buffers; the planner intersects each request with the stored chunks and reads only the blocks that overlap,
// verifying every block it touches. Any saved layout therefore loads into any loading layout.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "ckpt/io_options.h"
#include "ckpt/manifest.h"
#include "ckpt/tensor_view.h"

namespace trestle {

struct LoadRequest {
  std::string name;
  Piece piece;
  std::byte* destination = nullptr;  // piece.numel() elements of the tensor's stored dtype
};

struct LoadStats {
  std::uint64_t bytes_read = 0;    // stored bytes read from disk
  std::uint64_t bytes_copied = 0;  // bytes placed in destinations
  std::uint64_t blocks_verified = 0;
};

struct LoadCache;

// Not thread-safe: one load() or verify() at a time (open files and buffers are reused between calls). An iteration
// another job replaces (saves again) while it is read gives an error saying so, never a false report of damage.
class CheckpointReader {
 public:
  // Opens <root>/iter_N (the tracker's iteration when none is given) and validates its manifest.
  static Result<CheckpointReader> open(const std::string& root, std::optional<std::int64_t> iteration = std::nullopt,
                                       const IoOptions& io = {});
  // Opens an iteration directory itself, wherever it is (a save's temporary directory before its commit).
  static Result<CheckpointReader> open_directory(const std::string& dir, const IoOptions& io = {});
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();

  const Manifest& manifest() const { return manifest_; }
  const std::string& directory() const { return dir_; }

  // Fills every request; errors name the tensor, the requested piece and the file when a tensor is missing, a dtype
  // or shape disagrees, part of a piece is stored nowhere, or a block is corrupt.
  Status load(std::span<const LoadRequest> requests, LoadStats* stats = nullptr,
              std::uint64_t buffer_budget = 256ull << 20) const;

  // The files the manifest records (a converted model's tokenizer ...): each one's size and xxh3 as recorded, so that
  // what is copied out of the checkpoint is what was committed.
  Status verify_files() const;

  // verify_files, then reads every block of every chunk and checks every checksum, holding at most kVerifyBufferBytes
  // (plus one block) at a time; the chunks' exact coverage of each tensor was checked when the manifest was read.
  static constexpr std::uint64_t kVerifyBufferBytes = 64ull << 20;
  Status verify(LoadStats* stats = nullptr) const;

 private:
  // Which manifest.json was read: its file's device and inode. A save that replaces an iteration (another job saving
  // it again) swaps in another directory, with another manifest file.
  struct FileIdentity {
    std::uint64_t device = 0, inode = 0;
    bool operator==(const FileIdentity&) const = default;
  };
  static std::optional<FileIdentity> identity_of(const std::string& path);
  // `status`, or, when it failed and the directory's manifest is no longer the one read (the iteration was replaced or
  // removed while it was read, so its files belong to another save and a checksum mismatch is no sign of damage), an
  // error saying so.
  Status unless_replaced(Status status) const;

  CheckpointReader(std::string dir, Manifest manifest, IoOptions io, FileIdentity manifest_identity);
  std::string dir_;
  Manifest manifest_;
  FileIdentity manifest_identity_;
  IoOptions io_;
  std::unique_ptr<LoadCache> cache_;
};

}  // namespace trestle
