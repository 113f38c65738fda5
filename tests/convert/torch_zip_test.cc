// torch.save archives: our writer reproduces torch 2.15's torch.save(torch.arange(6.).reshape(2, 3)) byte for byte
// (given its serialization id); the reader finds tensors and strided views; damaged archives fail with a message.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "convert/formats/torch/dcp_metadata.h"
#include "convert/formats/torch/torch_save.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

std::string unhex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

std::span<const std::byte> as_bytes(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

std::vector<float> arange(int n) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = static_cast<float>(i);
  return v;
}

TEST(TorchZipTest, TensorArchiveMatchesTorchSave) {
  // torch 2.15: b = io.BytesIO(); torch.save(torch.arange(6, dtype=torch.float32).reshape(2, 3), b)
  const std::string id = "1572819951185464302603622430115872126654";
  const auto data = arange(6);
  const std::string ours = torch_save_tensor_bytes(DType::kF32, {2, 3}, std::as_bytes(std::span(data)), "archive", id);
  EXPECT_EQ(ours.size(), 1577u);
  auto archive = TorchSaveArchive::parse(as_bytes(ours), "ours");
  ASSERT_TRUE(archive.ok()) << archive.status().message();
  auto ref = archive->tensor(archive->root());
  ASSERT_TRUE(ref.ok() && ref->has_value());
  EXPECT_EQ((*ref)->shape, (Shape{2, 3}));
  EXPECT_EQ((*ref)->data_offset % 64, 0u);
  // Records as torch writes them, in its order, each payload 64-byte aligned.
  std::vector<std::string> names;
  for (const auto& e : archive->zip().entries()) {
    names.push_back(e.name);
    EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"archive/data.pkl", "archive/.format_version",
                                             "archive/.storage_alignment", "archive/byteorder", "archive/data/0",
                                             "archive/version", "archive/.data/serialization_id"}));
  // data.pkl is CPython's pickle of the same call, byte for byte.
  const std::string expected_pkl = unhex(
      "800263746f7263682e5f7574696c730a5f72656275696c645f74656e736f725f76320a71002828580700000073746f72616765710163746f"
      "7263680a466c6f617453746f726167650a71025801000000307103580300000063707571044b06747105514b004b024b038671064b034b01"
      "8671078963636f6c6c656374696f6e730a4f726465726564446963740a71082952710974710a52710b2e");
  auto pkl = archive->zip().read("data.pkl");
  ASSERT_TRUE(pkl.ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(pkl->data()), pkl->size()), expected_pkl);
  std::vector<float> back(6);
  archive->copy_tensor(**ref, reinterpret_cast<std::byte*>(back.data()));
  EXPECT_EQ(back, data);
}

TEST(TorchZipTest, StridedViewsAreGathered) {
  const auto data = arange(12);
  std::string bytes = torch_save_tensor_bytes(DType::kF32, {12}, std::as_bytes(std::span(data)));
  auto archive = TorchSaveArchive::parse(as_bytes(bytes), "t");
  ASSERT_TRUE(archive.ok());
  auto ref = archive->tensor(archive->root());
  ASSERT_TRUE(ref.ok() && ref->has_value());
  TorchTensorRef view = **ref;  // the transpose of a [3, 4] view starting at element 0: shape [4, 3], strides [1, 4]
  view.shape = {4, 3};
  view.stride = {1, 4};
  EXPECT_FALSE(view.contiguous());
  std::vector<float> out(12);
  archive->copy_tensor(view, reinterpret_cast<std::byte*>(out.data()));
  EXPECT_EQ(out, (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
}

void expect_zip_error(const std::string& bytes, const std::string& fragment) {
  auto archive = TorchSaveArchive::parse(as_bytes(bytes), "bad.pt");
  ASSERT_FALSE(archive.ok());
  EXPECT_NE(archive.status().message().find("bad.pt"), std::string::npos);
  EXPECT_NE(archive.status().message().find(fragment), std::string::npos) << archive.status().message();
}

TEST(TorchZipMalformedTest, DamagedArchivesFail) {
  const auto data = arange(6);
  const std::string good = torch_save_tensor_bytes(DType::kF32, {6}, std::as_bytes(std::span(data)));
  expect_zip_error("PK", "too short");
  expect_zip_error(good.substr(0, good.size() - 30), "");  // truncated end records
  std::string bad_sig = good;
  const std::size_t cd = bad_sig.find("PK\x01\x02");
  bad_sig[cd + 2] = 9;
  expect_zip_error(bad_sig, "central directory entry 0");
  std::string bad_offset = good;  // the first entry's local header offset points past the end
  bad_offset[cd + 42] = '\xff';
  bad_offset[cd + 43] = '\xff';
  expect_zip_error(bad_offset, "local header");
  std::string huge = good;  // every entry's size made larger than the archive
  for (std::size_t at = huge.find("PK\x01\x02"); at != std::string::npos; at = huge.find("PK\x01\x02", at + 4)) {
    huge[at + 20] = '\xff';
    huge[at + 24] = '\xff';
    huge[at + 23] = '\x7f';
    huge[at + 27] = '\x7f';
  }
  expect_zip_error(huge, "runs past the end");
}

// A storage whose declared element count is negative or more than its record holds is named as such.
TEST(TorchZipMalformedTest, StorageSizesAreChecked) {
  const auto data = arange(6);
  for (const std::int64_t declared : {std::int64_t{-1}, std::int64_t{7}}) {
    PickleDocument d;
    PickleValue* tensor = torch_tensor_value(d, DType::kF32, {6}, 0);
    tensor->args->items[0]->pid->items[4]->integer = declared;
    auto bytes = torch_save_object_bytes(
        tensor, "archive", {std::string(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float))});
    ASSERT_TRUE(bytes.ok()) << bytes.status().message();
    auto archive = TorchSaveArchive::parse(as_bytes(*bytes), "t.pt");
    ASSERT_TRUE(archive.ok()) << archive.status().message();
    auto ref = archive->tensor(archive->root(), "decoder.final_layernorm.weight");
    ASSERT_FALSE(ref.ok());
    const std::string expected = declared < 0 ? "storage data/0 declares -1 elements"
                                              : "storage data/0 holds 24 bytes, fewer than 7 elements of f32";
    EXPECT_NE(ref.status().message().find("t.pt: tensor 'decoder.final_layernorm.weight': " + expected),
              std::string::npos)
        << ref.status().message();
  }
}

TEST(TorchZipMalformedTest, MutatedArchivesNeverCrash) {
  const auto data = arange(6);
  const std::string good = torch_save_tensor_bytes(DType::kF32, {6}, std::as_bytes(std::span(data)));
  for (std::size_t i = 0; i < good.size(); i += 3) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    auto archive = TorchSaveArchive::parse(as_bytes(bad), "m");
    if (!archive.ok()) continue;
    auto ref = archive->tensor(archive->root());
    if (ref.ok() && ref->has_value()) {
      std::vector<std::byte> out(static_cast<std::size_t>(numel((*ref)->shape)) * dtype_size((*ref)->dtype));
      archive->copy_tensor(**ref, out.data());
    }
  }
}

TEST(DcpMetadataTest, WrittenMetadataParsesBack) {
  DcpMetadata md;
  md.tensors.push_back(
      {"w",
       DType::kBF16,
       {4, 6},
       {{{{0, 0}, {2, 6}}, {"__0_0.distcp", 0, 100, {}}}, {{{2, 0}, {2, 6}}, {"__1_0.distcp", 4096, 100, {}}}}});
  md.bytes.push_back({"note", {"__0_0.distcp", 8192, 50, {}}});
  auto pickle = write_dcp_metadata(md);
  ASSERT_TRUE(pickle.ok()) << pickle.status().message();
  auto back = parse_dcp_metadata(*pickle, "m");
  ASSERT_TRUE(back.ok()) << back.status().message();
  ASSERT_EQ(back->tensors.size(), 1u);
  EXPECT_EQ(back->tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(back->tensors[0].shape, (Shape{4, 6}));
  ASSERT_EQ(back->tensors[0].chunks.size(), 2u);
  EXPECT_EQ(back->tensors[0].chunks[1].box.offset, (Shape{2, 0}));
  EXPECT_EQ(back->tensors[0].chunks[1].storage.file, "__1_0.distcp");
  EXPECT_EQ(back->tensors[0].chunks[1].storage.offset, 4096u);
  ASSERT_EQ(back->bytes.size(), 1u);
  EXPECT_EQ(back->bytes[0].storage.offset, 8192u);
  EXPECT_EQ(back->module, "torch.distributed.checkpoint.metadata");
}

TEST(DcpMetadataTest, MalformedMetadataFails) {
  DcpMetadata md;
  md.tensors.push_back({"w", DType::kF32, {4}, {{{{2}, {4}}, {"__0_0.distcp", 0, 100, {}}}}});  // chunk outside
  auto pickle = write_dcp_metadata(md);
  ASSERT_TRUE(pickle.ok());
  auto parsed = parse_dcp_metadata(*pickle, "ckpt/.metadata");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("'w' chunk [2:6] lies outside"), std::string::npos)
      << parsed.status().message();

  md.tensors[0].chunks[0] = {{{0}, {4}}, {"../escape", 0, 100, {}}};
  parsed = parse_dcp_metadata(*write_dcp_metadata(md), "ckpt/.metadata");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("not a file name"), std::string::npos) << parsed.status().message();
  // A NUL ends the path the OS sees: "__0_0.distcp\0x" would read __0_0.distcp under another name.
  md.tensors[0].chunks[0] = {{{0}, {4}}, {std::string("__0_0.distcp\0x", 14), 0, 100, {}}};
  parsed = parse_dcp_metadata(*write_dcp_metadata(md), "ckpt/.metadata");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("not a file name"), std::string::npos) << parsed.status().message();

  auto not_metadata = parse_dcp_metadata(unhex("80027d2e"), "ckpt/.metadata");  // {}
  ASSERT_FALSE(not_metadata.ok());
  EXPECT_NE(not_metadata.status().message().find("not a DCP Metadata"), std::string::npos);
  EXPECT_TRUE(fails_with(parse_dcp_metadata("garbage", "ckpt/.metadata"), "ckpt/.metadata: pickle:"));
}

}  // namespace
}  // namespace trestle
