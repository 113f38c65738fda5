#include "train/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>

#include "ckpt/atomic_file.h"
#include "ckpt/fault_point.h"
#include "ckpt/regular_file.h"

namespace trestle::data {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr std::size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;
constexpr std::size_t kWriteBuffer = 8u << 20;

template <class T>
T load(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

bool valid_code(std::uint8_t code) { return code >= 1 && code <= 8; }

// The largest id each dtype holds; add_document refuses ids outside [min, max].
std::pair<std::int64_t, std::int64_t> id_range(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::kUint8:
      return {0, 255};
    case TokenDType::kInt8:
      return {-128, 127};
    case TokenDType::kInt16:
      return {-32768, 32767};
    case TokenDType::kUint16:
      return {0, 65535};
    case TokenDType::kInt32:
      return {std::numeric_limits<std::int32_t>::min(), std::numeric_limits<std::int32_t>::max()};
    default:
      return {std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()};
  }
}

void append_token(std::vector<std::byte>& out, TokenDType dtype, std::int64_t id) {
  const std::size_t at = out.size();
  out.resize(at + token_dtype_size(dtype));
  std::byte* p = out.data() + at;
  switch (dtype) {
    case TokenDType::kUint8: {
      auto v = static_cast<std::uint8_t>(id);
      std::memcpy(p, &v, 1);
      break;
    }
    case TokenDType::kInt8: {
      auto v = static_cast<std::int8_t>(id);
      std::memcpy(p, &v, 1);
      break;
    }
    case TokenDType::kInt16: {
      auto v = static_cast<std::int16_t>(id);
      std::memcpy(p, &v, 2);
      break;
    }
    case TokenDType::kUint16: {
      auto v = static_cast<std::uint16_t>(id);
      std::memcpy(p, &v, 2);
      break;
    }
    case TokenDType::kInt32: {
      auto v = static_cast<std::int32_t>(id);
      std::memcpy(p, &v, 4);
      break;
    }
    case TokenDType::kInt64:
      std::memcpy(p, &id, 8);
      break;
    case TokenDType::kFloat64: {
      auto v = static_cast<double>(id);
      std::memcpy(p, &v, 8);
      break;
    }
    case TokenDType::kFloat32: {
      auto v = static_cast<float>(id);
      std::memcpy(p, &v, 4);
      break;
    }
  }
}

// A float token widens to the id it holds; NaN, infinities, values beyond int64 and fractions hold none (numpy's
// astype would truncate 1.5 to 1: a float dataset holding fractions is not token ids, and is refused).
template <class F>
bool float_id(F value, std::int64_t& id) {
  if (!(value >= F(-0x1p63) && value < F(0x1p63)) || std::trunc(value) != value) return false;
  id = static_cast<std::int64_t>(value);
  return true;
}

// The token at p widened to int64; false when it is a float that holds no id.
bool token_at(const std::byte* p, TokenDType dtype, std::int64_t& id) {
  switch (dtype) {
    case TokenDType::kUint8:
      id = load<std::uint8_t>(p);
      return true;
    case TokenDType::kInt8:
      id = load<std::int8_t>(p);
      return true;
    case TokenDType::kInt16:
      id = load<std::int16_t>(p);
      return true;
    case TokenDType::kUint16:
      id = load<std::uint16_t>(p);
      return true;
    case TokenDType::kInt32:
      id = load<std::int32_t>(p);
      return true;
    case TokenDType::kInt64:
      id = load<std::int64_t>(p);
      return true;
    case TokenDType::kFloat64:
      return float_id(load<double>(p), id);
    case TokenDType::kFloat32:
      return float_id(load<float>(p), id);
  }
  return false;
}

}  // namespace

std::size_t token_dtype_size(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::kUint8:
    case TokenDType::kInt8:
      return 1;
    case TokenDType::kInt16:
    case TokenDType::kUint16:
      return 2;
    case TokenDType::kInt32:
    case TokenDType::kFloat32:
      return 4;
    case TokenDType::kInt64:
    case TokenDType::kFloat64:
      return 8;
  }
  return 0;
}

const char* token_dtype_name(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::kUint8:
      return "uint8";
    case TokenDType::kInt8:
      return "int8";
    case TokenDType::kInt16:
      return "int16";
    case TokenDType::kInt32:
      return "int32";
    case TokenDType::kInt64:
      return "int64";
    case TokenDType::kFloat64:
      return "float64";
    case TokenDType::kFloat32:
      return "float32";
    case TokenDType::kUint16:
      return "uint16";
  }
  return "?";
}

TokenDType optimal_token_dtype(std::int64_t vocab_size) {
  return vocab_size < 65500 ? TokenDType::kUint16 : TokenDType::kInt32;
}

std::string idx_path(const std::string& prefix) { return prefix + ".idx"; }
std::string bin_path(const std::string& prefix) { return prefix + ".bin"; }

std::string dataset_prefix(const std::string& path) {
  for (const char* suffix : {".idx", ".bin"}) {
    if (path.size() > 4 && path.compare(path.size() - 4, 4, suffix) == 0) return path.substr(0, path.size() - 4);
  }
  return path;
}

namespace {

// A file of the pair that cannot be opened; when an interrupted `trestle preprocess` set the old one aside, says so.
Status unopenable(const Status& error, const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(set_aside_name(path), ec)) return error;
  return Status::Error(error.message() +
                       " (an interrupted `trestle preprocess` left the previous dataset beside it as " +
                       set_aside_name(path) + "; run preprocess again, or rename the .trestle-old files back)");
}

}  // namespace

Result<IndexedDataset> IndexedDataset::open(const std::string& prefix) {
  auto idx = MappedFile::open(idx_path(prefix));
  if (!idx.ok()) return unopenable(idx.status(), idx_path(prefix));
  auto bin = MappedFile::open(bin_path(prefix), /*random_access=*/true);
  if (!bin.ok()) return unopenable(bin.status(), bin_path(prefix));
  IndexedDataset dataset(prefix, idx->bytes(), bin->bytes());
  dataset.idx_file_.emplace(std::move(*idx));
  dataset.bin_file_.emplace(std::move(*bin));
  TRESTLE_RETURN_IF_ERROR(dataset.validate());
  return dataset;
}

Result<IndexedDataset> IndexedDataset::from_bytes(std::span<const std::byte> idx, std::span<const std::byte> bin,
                                                  const std::string& prefix) {
  IndexedDataset dataset(prefix, idx, bin);
  TRESTLE_RETURN_IF_ERROR(dataset.validate());
  return dataset;
}

Status IndexedDataset::validate() {
  const std::string name = idx_path(prefix_);
  const std::byte* p = idx_.data();
  const std::size_t size = idx_.size();
  if (size < kHeaderBytes)
    return Status::Error(name + ": " + std::to_string(size) + " bytes, shorter than the " +
                         std::to_string(kHeaderBytes) + "-byte header of a Megatron indexed dataset");
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0)
    return Status::Error(name + ": not a Megatron indexed dataset (no MMIDIDX header)");
  if (const auto version = load<std::uint64_t>(p + 9); version != 1)
    return Status::Error(name + ": index version " + std::to_string(version) + ", only version 1 is known");
  const auto code = load<std::uint8_t>(p + 17);
  if (!valid_code(code)) return Status::Error(name + ": unknown dtype code " + std::to_string(code));
  dtype_ = static_cast<TokenDType>(code);
  const auto sequences = load<std::uint64_t>(p + 18);
  const auto documents = load<std::uint64_t>(p + 26);
  // Each sequence takes 12 bytes and each document entry 8, so counts beyond the file size are rejected before any
  // multiplication can overflow.
  const std::size_t room = size - kHeaderBytes;
  if (sequences > room / 12 || documents > room / 8 || sequences * 12 + documents * 8 > room)
    return Status::Error(name + ": header claims " + std::to_string(sequences) + " sequences and " +
                         std::to_string(documents) + " document entries, more than its " + std::to_string(size) +
                         " bytes hold (truncated or damaged)");
  const std::size_t arrays_end = kHeaderBytes + sequences * 12 + documents * 8;
  if (size == arrays_end + sequences && sequences > 0) {
    modes_offset_ = arrays_end;
  } else if (size != arrays_end) {
    return Status::Error(name + ": " + std::to_string(size) + " bytes, but its header's " + std::to_string(sequences) +
                         " sequences and " + std::to_string(documents) + " document entries make " +
                         std::to_string(arrays_end) + " (or " + std::to_string(arrays_end + sequences) +
                         " with modes)");
  }
  sequence_count_ = sequences;
  document_index_count_ = documents;
  lengths_offset_ = kHeaderBytes;
  pointers_offset_ = lengths_offset_ + sequences * 4;
  documents_offset_ = pointers_offset_ + sequences * 8;
  if (documents == 0) return Status::Error(name + ": no document indices (a valid index holds at least the leading 0)");

  const std::size_t item = token_dtype_size(dtype_);
  const std::uint64_t bin_size = bin_.size();
  std::uint64_t expected_pointer = 0;  // Megatron writes the sequences back to back: each starts where the last ends
  for (std::size_t i = 0; i < sequences; ++i) {
    const std::int32_t length = sequence_length(i);
    const std::int64_t pointer = sequence_pointer(i);
    if (length >= 0 && pointer >= 0 && static_cast<std::uint64_t>(pointer) != expected_pointer)
      return Status::Error(name + ": sequence " + std::to_string(i) + " starts at byte " + std::to_string(pointer) +
                           " of " + bin_path(prefix_) + ", but the sequences before it end at byte " +
                           std::to_string(expected_pointer) + " (an index holds them back to back)");
    if (length < 0 || pointer < 0 || static_cast<std::uint64_t>(pointer) > bin_size ||
        static_cast<std::uint64_t>(length) * item > bin_size - static_cast<std::uint64_t>(pointer))
      return Status::Error(name + ": sequence " + std::to_string(i) + " (" + std::to_string(length) +
                           " tokens at byte " + std::to_string(pointer) + ") lies outside " + bin_path(prefix_) + " (" +
                           std::to_string(bin_size) + " bytes)");
    token_count_ += static_cast<std::uint64_t>(length);
    expected_pointer = static_cast<std::uint64_t>(pointer) + static_cast<std::uint64_t>(length) * item;
  }
  std::int64_t previous = 0;
  for (std::size_t i = 0; i < documents; ++i) {
    const std::int64_t first = document_index(i);
    if ((i == 0 && first != 0) || first < previous || static_cast<std::uint64_t>(first) > sequences)
      return Status::Error(name + ": document index " + std::to_string(i) + " is " + std::to_string(first) +
                           " (document indices must start at 0, never decrease and stay within the " +
                           std::to_string(sequences) + " sequences)");
    previous = first;
  }
  if (static_cast<std::uint64_t>(previous) != sequences)
    return Status::Error(name + ": the last document index is " + std::to_string(previous) + ", expected the " +
                         std::to_string(sequences) + " sequences");
  return OkStatus();
}

std::int32_t IndexedDataset::sequence_length(std::size_t sequence) const {
  return load<std::int32_t>(idx_.data() + lengths_offset_ + sequence * 4);
}

std::int64_t IndexedDataset::sequence_pointer(std::size_t sequence) const {
  return load<std::int64_t>(idx_.data() + pointers_offset_ + sequence * 8);
}

std::int8_t IndexedDataset::sequence_mode(std::size_t sequence) const {
  return modes_offset_ ? load<std::int8_t>(idx_.data() + *modes_offset_ + sequence) : 0;
}

std::int64_t IndexedDataset::document_index(std::size_t i) const {
  return load<std::int64_t>(idx_.data() + documents_offset_ + i * 8);
}

std::vector<std::int32_t> IndexedDataset::sequence_lengths() const {
  std::vector<std::int32_t> lengths(sequence_count_);
  if (sequence_count_ > 0) std::memcpy(lengths.data(), idx_.data() + lengths_offset_, sequence_count_ * 4);
  return lengths;
}

Status IndexedDataset::read(std::size_t sequence, std::size_t offset, std::optional<std::size_t> length,
                            std::vector<std::int64_t>& out) const {
  if (sequence >= sequence_count_)
    return Status::Error(prefix_ + ": sequence " + std::to_string(sequence) + " of " + std::to_string(sequence_count_));
  const auto total = static_cast<std::size_t>(sequence_length(sequence));
  const std::size_t count = length.value_or(total > offset ? total - offset : 0);
  if (offset > total || count > total - offset)
    return Status::Error(prefix_ + ": tokens [" + std::to_string(offset) + ", " + std::to_string(offset + count) +
                         ") of sequence " + std::to_string(sequence) + " which has " + std::to_string(total));
  if (count == 0) return OkStatus();  // an empty .bin has no map to point into
  const std::size_t item = token_dtype_size(dtype_);
  const std::byte* p = bin_.data() + static_cast<std::size_t>(sequence_pointer(sequence)) + offset * item;
  const std::size_t at = out.size();
  out.resize(at + count);
  if (dtype_ == TokenDType::kInt64) {
    std::memcpy(out.data() + at, p, count * 8);
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      if (!token_at(p + i * item, dtype_, out[at + i])) {
        out.resize(at);
        return Status::Error(bin_path(prefix_) + ": token " + std::to_string(offset + i) + " of sequence " +
                             std::to_string(sequence) + " is a " + token_dtype_name(dtype_) +
                             " that holds no token id (NaN, infinite, fractional or beyond int64)");
      }
    }
  }
  return OkStatus();
}

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, TokenDType dtype, std::FILE* bin)
    : prefix_(std::move(prefix)),
      dtype_(dtype),
      bin_(bin),
      bin_removed_on_signal_(temporary_sibling(bin_path(prefix_))) {
  buffer_.reserve(kWriteBuffer + 64);
}

IndexedDatasetWriter::IndexedDatasetWriter(IndexedDatasetWriter&& other) noexcept
    : prefix_(std::move(other.prefix_)),
      dtype_(other.dtype_),
      bin_(std::exchange(other.bin_, nullptr)),
      bin_removed_on_signal_(std::move(other.bin_removed_on_signal_)),
      idx_removed_on_signal_(std::move(other.idx_removed_on_signal_)),
      buffer_(std::move(other.buffer_)),
      sequence_lengths_(std::move(other.sequence_lengths_)),
      document_indices_(std::move(other.document_indices_)),
      token_count_(other.token_count_) {}

IndexedDatasetWriter& IndexedDatasetWriter::operator=(IndexedDatasetWriter&& other) noexcept {
  if (this != &other) {
    discard();
    prefix_ = std::move(other.prefix_);
    dtype_ = other.dtype_;
    bin_ = std::exchange(other.bin_, nullptr);
    bin_removed_on_signal_ = std::move(other.bin_removed_on_signal_);
    idx_removed_on_signal_ = std::move(other.idx_removed_on_signal_);
    buffer_ = std::move(other.buffer_);
    sequence_lengths_ = std::move(other.sequence_lengths_);
    document_indices_ = std::move(other.document_indices_);
    token_count_ = other.token_count_;
  }
  return *this;
}

IndexedDatasetWriter::~IndexedDatasetWriter() { discard(); }

void IndexedDatasetWriter::discard() {
  if (!bin_) return;
  std::fclose(std::exchange(bin_, nullptr));
  ::unlink(temporary_sibling(bin_path(prefix_)).c_str());
  bin_removed_on_signal_.release();
}

namespace {

// An output may replace a regular file, or be new; anything else at its path is refused.
Status check_replaceable(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    return errno == ENOENT ? OkStatus() : Status::Error(path + ": " + std::strerror(errno));
  if (S_ISLNK(st.st_mode))
    return Status::Error(path + ": a symbolic link; refusing to replace it (or write through it)");
  if (!S_ISREG(st.st_mode))
    return Status::Error(path + ": not a regular file (" + file_kind(st.st_mode) + "); refusing to replace it");
  return OkStatus();
}

// A fresh temporary file (a link or FIFO someone put at its name is removed first, never opened).
Result<std::FILE*> create_temporary(const std::string& path) {
  ::unlink(path.c_str());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return Status::Error(path + ": cannot create: " + std::strerror(errno));
  std::FILE* f = ::fdopen(fd, "wb");
  if (!f) {
    ::close(fd);
    ::unlink(path.c_str());
    return Status::Error(path + ": cannot open: " + std::strerror(errno));
  }
  return f;
}

}  // namespace

Result<IndexedDatasetWriter> IndexedDatasetWriter::create(const std::string& prefix, TokenDType dtype) {
  if (!valid_code(static_cast<std::uint8_t>(dtype))) return Status::Error(prefix + ": unknown token dtype");
  TRESTLE_RETURN_IF_ERROR(check_replaceable(bin_path(prefix)));
  TRESTLE_RETURN_IF_ERROR(check_replaceable(idx_path(prefix)));
  remove_dead_temporaries(bin_path(prefix));
  remove_dead_temporaries(idx_path(prefix));
  TRESTLE_ASSIGN_OR_RETURN(std::FILE * bin, create_temporary(temporary_sibling(bin_path(prefix))));
  return IndexedDatasetWriter(prefix, dtype, bin);
}

Status IndexedDatasetWriter::flush_buffer() {
  if (!buffer_.empty() && std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) != buffer_.size())
    return Status::Error(bin_path(prefix_) + ": write failed: " + std::strerror(errno));
  buffer_.clear();
  return fault_point("dataset tokens written", bin_path(prefix_));
}

Status IndexedDatasetWriter::add_document(std::span<const std::int64_t> tokens,
                                          std::span<const std::int32_t> sequence_lengths) {
  if (!bin_) return Status::Error(bin_path(prefix_) + ": writer already finalized");
  std::int64_t sum = 0;
  for (const auto length : sequence_lengths) {
    if (length < 0) return Status::Error(bin_path(prefix_) + ": negative sequence length");
    sum += length;
  }
  if (static_cast<std::size_t>(sum) != tokens.size())
    return Status::Error(bin_path(prefix_) + ": document of " + std::to_string(tokens.size()) +
                         " tokens given sequence lengths summing to " + std::to_string(sum));
  const auto [low, high] = id_range(dtype_);
  for (const auto id : tokens) {
    if (id < low || id > high)
      return Status::Error(bin_path(prefix_) + ": token id " + std::to_string(id) + " does not fit " +
                           token_dtype_name(dtype_));
    append_token(buffer_, dtype_, id);
    if (buffer_.size() >= kWriteBuffer) TRESTLE_RETURN_IF_ERROR(flush_buffer());
  }
  sequence_lengths_.insert(sequence_lengths_.end(), sequence_lengths.begin(), sequence_lengths.end());
  document_indices_.push_back(static_cast<std::int64_t>(sequence_lengths_.size()));
  token_count_ += tokens.size();
  return OkStatus();
}

Status IndexedDatasetWriter::add_document(std::span<const std::int64_t> tokens) {
  const std::int32_t length[1] = {static_cast<std::int32_t>(tokens.size())};
  return add_document(tokens, length);
}

Result<std::vector<StagedFile>> IndexedDatasetWriter::stage() {
  if (!bin_) return Status::Error(bin_path(prefix_) + ": writer already finalized");
  TRESTLE_RETURN_IF_ERROR(flush_buffer());
  const std::string bin_temp = temporary_sibling(bin_path(prefix_));
  const bool synced = std::fflush(bin_) == 0 && ::fsync(::fileno(bin_)) == 0;
  const bool closed = std::fclose(std::exchange(bin_, nullptr)) == 0;
  if (!synced || !closed) {
    const std::string error = std::strerror(errno);
    ::unlink(bin_temp.c_str());
    return Status::Error(bin_path(prefix_) + ": write failed: " + error);
  }

  std::vector<std::byte> index;
  auto put = [&index](const void* data, std::size_t bytes) {
    const auto* b = static_cast<const std::byte*>(data);
    index.insert(index.end(), b, b + bytes);
  };
  const std::uint64_t version = 1;
  const auto code = static_cast<std::uint8_t>(dtype_);
  const std::uint64_t sequences = sequence_lengths_.size();
  const std::uint64_t documents = document_indices_.size();
  put(kMagic, sizeof(kMagic));
  put(&version, 8);
  put(&code, 1);
  put(&sequences, 8);
  put(&documents, 8);
  put(sequence_lengths_.data(), sequences * 4);
  std::vector<std::int64_t> pointers(sequences);
  std::int64_t pointer = 0;
  const auto item = static_cast<std::int64_t>(token_dtype_size(dtype_));
  for (std::size_t i = 0; i < sequences; ++i) {
    pointers[i] = pointer;
    pointer += sequence_lengths_[i] * item;
  }
  put(pointers.data(), sequences * 8);
  put(document_indices_.data(), documents * 8);

  const std::string path = idx_path(prefix_);
  const std::string idx_temp = temporary_sibling(path);
  idx_removed_on_signal_ = RemovedOnSignal(idx_temp);
  auto failed = [&](const Status& s) {
    ::unlink(bin_temp.c_str());
    ::unlink(idx_temp.c_str());
    return s;
  };
  auto f = create_temporary(idx_temp);
  if (!f.ok()) return failed(f.status());
  const bool written = std::fwrite(index.data(), 1, index.size(), *f) == index.size() && std::fflush(*f) == 0 &&
                       ::fsync(::fileno(*f)) == 0;
  if (std::fclose(*f) != 0 || !written) return failed(Status::Error(path + ": write failed: " + std::strerror(errno)));
  return std::vector<StagedFile>{{bin_temp, bin_path(prefix_)}, {idx_temp, path}};
}

Status IndexedDatasetWriter::finalize() {
  TRESTLE_ASSIGN_OR_RETURN(const auto staged, stage());
  return commit_renames(staged);  // the .bin and .idx replace the old pair together
}

}  // namespace trestle::data
