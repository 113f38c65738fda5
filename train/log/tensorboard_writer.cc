#include "train/log/tensorboard_writer.h"

#include <isa-l/crc.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

namespace trestle {
namespace {

// Protocol-buffer wire format, just what Event / Summary / Summary.Value need.
void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void put_tag(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<std::uint64_t>(field << 3 | wire_type));
}

template <typename T>
void put_fixed(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(bytes, sizeof(T));
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
std::string event(std::int64_t step, const std::string* file_version, const std::string* summary) {
  std::string out;
  put_tag(out, 1, 1);
  put_fixed(out, wall_time());
  put_tag(out, 2, 0);
  put_varint(out, static_cast<std::uint64_t>(step));
  if (file_version) put_bytes(out, 3, *file_version);
  if (summary) put_bytes(out, 5, *summary);
  return out;
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t size) {
  std::uint32_t crc = 0xffffffffu;
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  constexpr std::size_t kMaxChunk = std::size_t{1} << 30;  // ISA-L takes an int length
  while (size > 0) {
    const std::size_t n = std::min(size, kMaxChunk);
    crc = crc32_iscsi(p, static_cast<int>(n), crc);
    p += n;
    size -= n;
  }
  return crc ^ 0xffffffffu;
}

std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

Result<TensorBoardWriter> TensorBoardWriter::open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::Error(dir + ": cannot create TensorBoard directory: " + ec.message());
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const std::string path = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(wall_time())) + "." +
                           host + "." + std::to_string(::getpid()) + ".0";
  std::FILE* file = std::fopen(path.c_str(), "wbx");
  if (!file) return Status::Error(path + ": cannot create: " + std::strerror(errno));
  TensorBoardWriter writer(path, file);
  const std::string version = "brain.Event:2";
  TRESTLE_RETURN_IF_ERROR(writer.write_record(event(0, &version, nullptr)));
  TRESTLE_RETURN_IF_ERROR(writer.flush());
  return writer;
}

TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&& other) noexcept
    : path_(std::move(other.path_)), file_(std::exchange(other.file_, nullptr)) {}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

Status TensorBoardWriter::add_scalar(const std::string& tag, float value, std::int64_t step) {
  std::string v;  // Summary.Value { string tag = 1; float simple_value = 2; }
  put_bytes(v, 1, tag);
  put_tag(v, 2, 5);
  put_fixed(v, value);
  std::string summary;  // Summary { repeated Value value = 1; }
  put_bytes(summary, 1, v);
  return write_record(event(step, nullptr, &summary));
}

Status TensorBoardWriter::flush() {
  if (std::fflush(file_) != 0) return Status::Error(path_ + ": write failed: " + std::strerror(errno));
  return OkStatus();
}

Status TensorBoardWriter::write_record(const std::string& data) {
  std::string record;
  const std::uint64_t length = data.size();
  put_fixed(record, length);
  put_fixed(record, masked_crc32c(&length, sizeof length));
  record += data;
  put_fixed(record, masked_crc32c(data.data(), data.size()));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size())
    return Status::Error(path_ + ": write failed: " + std::strerror(errno));
  return OkStatus();
}

}  // namespace trestle
