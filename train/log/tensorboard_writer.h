// TensorBoard event files as Megatron's runs write them (torch.utils.tensorboard's SummaryWriter): one
// events.out.tfevents.<time>.<host>.<pid>.0 file of TFRecord-framed Event protos (a file_version record first, then a
// scalar summary per add_scalar), each record's length and data guarded by masked CRC-32C. Scalars only.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "ckpt/status.h"

namespace trestle {

class TensorBoardWriter {
 public:
  // Creates DIR (and parents) and a new event file in it.
  static Result<TensorBoardWriter> open(const std::string& dir);
  TensorBoardWriter(TensorBoardWriter&& other) noexcept;
  TensorBoardWriter& operator=(TensorBoardWriter&&) = delete;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter();

  Status add_scalar(const std::string& tag, float value, std::int64_t step);
  Status flush();
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  Status write_record(const std::string& data);
  std::string path_;
  std::FILE* file_ = nullptr;
};

// TFRecord's checksum: CRC-32C (Castagnoli), rotated and offset ("masked").
std::uint32_t crc32c(const void* data, std::size_t size);
std::uint32_t masked_crc32c(const void* data, std::size_t size);

}  // namespace trestle
