#include "convert/formats/torch/torch_zip.h"

#include <cstring>

#include "ckpt/crc32.h"

namespace trestle {
namespace {

constexpr std::uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50;
constexpr std::uint32_t kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50, kDescriptorSig = 0x08074b50;
constexpr std::uint64_t kU32Max = 0xffffffffull;

std::uint64_t rd(std::span<const std::byte> b, std::uint64_t at, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<std::uint8_t>(b[at + static_cast<std::uint64_t>(i)]);
  return v;
}

void wr(std::string& out, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

}  // namespace

Result<ZipArchive> ZipArchive::parse(std::span<const std::byte> bytes, std::string context) {
  auto fail = [&](const std::string& what) { return Status::Error(context + ": zip: " + what); };
  const std::uint64_t size = bytes.size();
  if (size < 22) return fail("too short for a zip archive (" + std::to_string(size) + " bytes)");
  // The end record is the last 22 bytes plus a comment of at most 65535 bytes.
  std::uint64_t end = UINT64_MAX;
  for (std::uint64_t at = size - 22;; --at) {
    if (rd(bytes, at, 4) == kEndSig && at + 22 + rd(bytes, at + 20, 2) == size) {
      end = at;
      break;
    }
    if (at == 0 || size - at > 22 + 65535) break;
  }
  if (end == UINT64_MAX) return fail("no end-of-central-directory record (not a zip archive, or truncated)");
  std::uint64_t count = rd(bytes, end + 10, 2);
  std::uint64_t cd_size = rd(bytes, end + 12, 4);
  std::uint64_t cd_offset = rd(bytes, end + 16, 4);
  std::uint64_t cd_limit = end;
  if (end >= 20 && rd(bytes, end - 20, 4) == kZip64LocatorSig) {
    const std::uint64_t z64 = rd(bytes, end - 20 + 8, 8);
    if (z64 > end - 20 || end - 20 - z64 < 56 || rd(bytes, z64, 4) != kZip64EndSig)
      return fail("zip64 end record offset " + std::to_string(z64) + " does not point at a zip64 end record");
    count = rd(bytes, z64 + 32, 8);
    cd_size = rd(bytes, z64 + 40, 8);
    cd_offset = rd(bytes, z64 + 48, 8);
    cd_limit = z64;
  }
  if (cd_offset > cd_limit || cd_size > cd_limit - cd_offset)
    return fail("central directory [" + std::to_string(cd_offset) + ", +" + std::to_string(cd_size) +
                ") lies outside the archive");
  if (count > cd_size / 46) return fail("entry count " + std::to_string(count) + " does not fit the central directory");

  ZipArchive zip;
  zip.bytes_ = bytes;
  zip.context_ = context;
  zip.entries_.reserve(count);
  std::uint64_t at = cd_offset;
  const std::uint64_t cd_end = cd_offset + cd_size;
  for (std::uint64_t i = 0; i < count; ++i) {
    if (cd_end - at < 46 || rd(bytes, at, 4) != kCentralSig)
      return fail("central directory entry " + std::to_string(i) + " at byte " + std::to_string(at) + " is malformed");
    ZipEntry e;
    e.method = static_cast<std::uint16_t>(rd(bytes, at + 10, 2));
    e.crc32 = static_cast<std::uint32_t>(rd(bytes, at + 16, 4));
    std::uint64_t comp = rd(bytes, at + 20, 4), uncomp = rd(bytes, at + 24, 4);
    const std::uint64_t name_len = rd(bytes, at + 28, 2), extra_len = rd(bytes, at + 30, 2),
                        comment_len = rd(bytes, at + 32, 2);
    std::uint64_t local = rd(bytes, at + 42, 4);
    if (cd_end - at - 46 < name_len + extra_len + comment_len)
      return fail("central directory entry " + std::to_string(i) + " runs past the directory");
    e.name.assign(reinterpret_cast<const char*>(bytes.data() + at + 46), name_len);
    // Zip64 extra field: 64-bit values for the fields saturated at 0xffffffff, in this order.
    for (std::uint64_t x = at + 46 + name_len, xend = x + extra_len; xend - x >= 4;) {
      const std::uint64_t id = rd(bytes, x, 2), len = rd(bytes, x + 2, 2);
      if (len > xend - x - 4) return fail("entry '" + e.name + "' has a malformed extra field");
      if (id == 1) {
        std::uint64_t p = x + 4;
        auto take = [&](std::uint64_t& field) -> bool {
          if (field != kU32Max) return true;
          if (p + 8 > x + 4 + len) return false;
          field = rd(bytes, p, 8);
          p += 8;
          return true;
        };
        if (!take(uncomp) || !take(comp) || !take(local)) return fail("entry '" + e.name + "' has a short zip64 field");
      }
      x += 4 + len;
    }
    if (local > size || size - local < 30 || rd(bytes, local, 4) != kLocalSig)
      return fail("entry '" + e.name + "': local header offset " + std::to_string(local) + " is not a local header");
    const std::uint64_t data = local + 30 + rd(bytes, local + 26, 2) + rd(bytes, local + 28, 2);
    if (data > size || comp > size - data)
      return fail("entry '" + e.name + "': data [" + std::to_string(data) + ", +" + std::to_string(comp) +
                  ") runs past the end of the archive (" + std::to_string(size) + " bytes)");
    if (e.method == 0 && comp != uncomp)
      return fail("stored entry '" + e.name + "' has compressed size " + std::to_string(comp) + " != size " +
                  std::to_string(uncomp));
    e.data_offset = data;
    e.size = comp;
    zip.entries_.push_back(std::move(e));
    at += 46 + name_len + extra_len + comment_len;
  }
  for (const auto& e : zip.entries_) {
    const std::string suffix = "data.pkl";
    if (e.name.size() >= suffix.size() && e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        e.name.find('/') == e.name.size() - suffix.size() - 1) {
      zip.prefix_ = e.name.substr(0, e.name.size() - suffix.size());
      break;
    }
  }
  return zip;
}

const ZipEntry* ZipArchive::find(std::string_view name) const {
  for (const auto& e : entries_)
    if (e.name.size() == prefix_.size() + name.size() && e.name.compare(0, prefix_.size(), prefix_) == 0 &&
        e.name.compare(prefix_.size(), name.size(), name) == 0)
      return &e;
  return nullptr;
}

Result<std::span<const std::byte>> ZipArchive::read(const ZipEntry& entry) const {
  if (entry.method != 0)
    return Status::Error(context_ + ": zip entry '" + entry.name + "' is compressed (method " +
                         std::to_string(entry.method) + "); torch.save archives store entries uncompressed");
  return bytes_.subspan(entry.data_offset, entry.size);
}

Result<std::span<const std::byte>> ZipArchive::read(std::string_view name) const {
  const ZipEntry* e = find(name);
  if (!e) return Status::Error(context_ + ": zip has no entry '" + prefix_ + std::string(name) + "'");
  return read(*e);
}

void TorchZipWriter::add(std::string name, std::string data, std::uint64_t alignment) {
  Record r;
  r.name = std::move(name);
  r.size = data.size();
  r.crc32 = crc32(std::as_bytes(std::span(data.data(), data.size())));
  r.data = std::move(data);
  r.alignment = alignment;
  records_.push_back(std::move(r));
}

std::size_t TorchZipWriter::add_external(std::string name, std::uint64_t size, std::uint32_t crc,
                                         std::uint64_t alignment) {
  Record r;
  r.name = std::move(name);
  r.external = true;
  r.size = size;
  r.crc32 = crc;
  r.alignment = alignment;
  records_.push_back(std::move(r));
  return records_.size() - 1;
}

std::vector<TorchZipWriter::Part> TorchZipWriter::finish() const {
  std::vector<Part> parts;
  std::string pending;  // inline bytes not yet emitted as a part
  std::uint64_t cursor = 0;
  std::vector<std::uint64_t> local_offsets;
  for (std::size_t i = 0; i < records_.size(); ++i) {
    const Record& r = records_[i];
    const std::string name = archive_name_ + "/" + r.name;
    local_offsets.push_back(cursor);
    const bool big = r.size >= kU32Max, far = cursor >= kU32Max;
    std::string zip64;
    if (big || far) {  // miniz's local zip64 field, which PyTorchStreamWriter's padding accounts for
      zip64 += "\x01";
      zip64 += '\0';
      wr(zip64, (big ? 16 : 0) + (far ? 8 : 0), 2);
      if (big) {
        wr(zip64, r.size, 8);
        wr(zip64, r.size, 8);
      }
      if (far) wr(zip64, cursor, 8);
    }
    const std::uint64_t start = cursor + 30 + name.size() + 4 + zip64.size();  // getPadding() in inline_container.cc
    const std::uint64_t padding = (r.alignment - start % r.alignment) % r.alignment;
    std::string header;
    wr(header, kLocalSig, 4);
    wr(header, 0, 2);       // version needed
    wr(header, 0x0808, 2);  // data descriptor follows; UTF-8 names
    wr(header, 0, 2);       // stored
    wr(header, 0, 4);       // time, date
    wr(header, 0, 4);       // crc (in the descriptor)
    wr(header, big ? kU32Max : 0, 4);
    wr(header, big ? kU32Max : 0, 4);
    wr(header, name.size(), 2);
    wr(header, zip64.size() + 4 + padding, 2);
    header += name;
    header += zip64;
    header += "FB";
    wr(header, padding, 2);
    header.append(padding, 'Z');
    pending += header;
    cursor += header.size();
    if (r.external) {
      parts.push_back({std::move(pending), -1, 0});
      pending.clear();
      parts.push_back({{}, static_cast<int>(i), r.size});
    } else {
      pending += r.data;
    }
    cursor += r.size;
    std::string descriptor;
    wr(descriptor, kDescriptorSig, 4);
    wr(descriptor, r.crc32, 4);
    wr(descriptor, r.size, big ? 8 : 4);
    wr(descriptor, r.size, big ? 8 : 4);
    pending += descriptor;
    cursor += descriptor.size();
  }
  const std::uint64_t cd_offset = cursor;
  std::string cd;
  for (std::size_t i = 0; i < records_.size(); ++i) {
    const Record& r = records_[i];
    const std::string name = archive_name_ + "/" + r.name;
    const bool big = r.size >= kU32Max, far = local_offsets[i] >= kU32Max;
    std::string zip64;
    if (big || far) {
      wr(zip64, 1, 2);
      wr(zip64, (big ? 16 : 0) + (far ? 8 : 0), 2);
      if (big) {
        wr(zip64, r.size, 8);
        wr(zip64, r.size, 8);
      }
      if (far) wr(zip64, local_offsets[i], 8);
    }
    wr(cd, kCentralSig, 4);
    wr(cd, 0, 2);  // made by
    wr(cd, 0, 2);  // needed
    wr(cd, 0x0808, 2);
    wr(cd, 0, 2);
    wr(cd, 0, 4);
    wr(cd, r.crc32, 4);
    wr(cd, big ? kU32Max : r.size, 4);
    wr(cd, big ? kU32Max : r.size, 4);
    wr(cd, name.size(), 2);
    wr(cd, zip64.size(), 2);
    wr(cd, 0, 2);  // comment
    wr(cd, 0, 2);  // disk
    wr(cd, 0, 2);  // internal attributes
    wr(cd, 0, 4);  // external attributes
    wr(cd, far ? kU32Max : local_offsets[i], 4);
    cd += name;
    cd += zip64;
  }
  const std::uint64_t n = records_.size();
  const std::uint64_t zip64_end = cd_offset + cd.size();
  std::string tail = cd;
  wr(tail, kZip64EndSig, 4);
  wr(tail, 44, 8);
  wr(tail, 0x031e, 2);
  wr(tail, 0x002d, 2);
  wr(tail, 0, 4);
  wr(tail, 0, 4);
  wr(tail, n, 8);
  wr(tail, n, 8);
  wr(tail, cd.size(), 8);
  wr(tail, cd_offset, 8);
  wr(tail, kZip64LocatorSig, 4);
  wr(tail, 0, 4);
  wr(tail, zip64_end, 8);
  wr(tail, 1, 4);
  wr(tail, kEndSig, 4);
  wr(tail, 0, 4);
  wr(tail, n >= 0xffff ? 0xffff : n, 2);
  wr(tail, n >= 0xffff ? 0xffff : n, 2);
  wr(tail, cd.size() >= kU32Max ? kU32Max : cd.size(), 4);
  wr(tail, cd_offset >= kU32Max ? kU32Max : cd_offset, 4);
  wr(tail, 0, 2);
  pending += tail;
  parts.push_back({std::move(pending), -1, 0});
  for (auto& p : parts)
    if (p.external < 0) p.size = p.bytes.size();
  return parts;
}

std::string zip_parts_to_bytes(const std::vector<TorchZipWriter::Part>& parts) {
  std::string out;
  for (const auto& p : parts) out += p.bytes;
  return out;
}

}  // namespace trestle
