#include "ckpt/save_stream.h"

#include "ckpt/aligned_buffer.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/chunk_codec.h"
#include "ckpt/file_writer.h"

namespace trestle {

const std::byte* streamed_data() {
  static const std::byte marker{};
  return &marker;
}

namespace {

Result<RankChunks> write_pieces(const std::string& temp_dir, const std::string& file, std::span<const SaveItem> items,
                                const std::vector<std::size_t>& to_write, const PieceFiller& fill,
                                const SaveOptions& options, const PieceWritten& written, const SaveItem*& current) {
  RankChunks out;
  TRESTLE_ASSIGN_OR_RETURN(auto writer, FileWriter::create(temp_dir + "/" + file, options.io));
  AlignedBuffer buffer;  // page-aligned, so a filler reading with O_DIRECT can read straight into it
  for (std::size_t index : to_write) {
    const SaveItem& item = items[index];
    current = &item;
    const std::span<std::byte> piece = buffer.first(static_cast<std::size_t>(item.nbytes()));
    TRESTLE_RETURN_IF_ERROR(
        fill(index, piece).with_context("tensor '" + item.name + "' piece " + to_string(item.piece)));
    const std::span<const std::byte> raw(piece);
    StoredChunk chunk{item.piece, file, 0, raw.size(), options.codec, options.block_bytes, {}, {}};
    if (options.codec == Codec::kZstd) {
      TRESTLE_ASSIGN_OR_RETURN(auto encoded,
                               zstd_encode_blocks(raw, options.block_bytes, options.zstd_level, options.threads));
      chunk.block_checksums = std::move(encoded.checksums);
      chunk.block_stored_bytes = std::move(encoded.block_stored_bytes);
      chunk.stored_bytes = encoded.stored.size();
      TRESTLE_ASSIGN_OR_RETURN(chunk.byte_offset, writer->append(encoded.stored));
    } else {
      chunk.block_checksums = block_checksums(raw, options.block_bytes, options.threads);
      TRESTLE_ASSIGN_OR_RETURN(chunk.byte_offset, writer->append(raw));
    }
    out.bytes_written += chunk.stored_bytes;
    out.chunks.emplace_back(item.name, std::move(chunk));
    if (written) written(raw.size());
  }
  current = nullptr;
  buffer = AlignedBuffer();  // the piece buffer is not needed for the final flush and sync
  TRESTLE_RETURN_IF_ERROR(writer->finish());
  return out;
}

}  // namespace

Result<RankChunks> write_rank_file_streaming(const std::string& temp_dir, int rank, std::span<const SaveItem> items,
                                             const std::vector<std::size_t>& to_write, const PieceFiller& fill,
                                             const SaveOptions& options, const PieceWritten& written) {
  if (to_write.empty()) return RankChunks{};
  const std::string file = rank_file_name(rank);
  const SaveItem* current = nullptr;
  // Staging a piece, compressing it or the filler's own work may fail to allocate (or throw otherwise): an error
  // naming the piece, which the commit then aborts on every rank, rather than a terminated writer thread.
  const auto failed = [&](const std::string& what) {
    return Status::Error(temp_dir + "/" + file + ": " +
                         (current ? "tensor '" + current->name + "' piece " + to_string(current->piece) + " (" +
                                        std::to_string(current->nbytes()) + " bytes): "
                                  : std::string()) +
                         what);
  };
  try {
    return write_pieces(temp_dir, file, items, to_write, fill, options, written, current);
  } catch (const std::bad_alloc&) {
    return failed("out of memory while staging or compressing it");
  } catch (const std::exception& e) {
    return failed(e.what());
  }
}

}  // namespace trestle
