// SafetensorsWriter / ShardedSafetensorsWriter -> SafetensorsFile / SafetensorsCheckpoint: bytes, layout and failure
// behaviour of the streaming writers, and save_pretrained's shard cutting.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/formats/safetensors/safetensors_file.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "tests/support/status_matchers.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_file(const std::string& path, const std::string& content) {
  std::ofstream(path, std::ios::binary) << content;
}

// Deterministic, tensor-specific bytes, so a tensor read from the wrong offset does not match.
std::vector<std::byte> pattern_bytes(const TensorSpec& spec, std::uint32_t seed) {
  std::vector<std::byte> out(spec.nbytes());
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (auto& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::byte>(x >> 24);
  }
  return out;
}

bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

std::vector<TensorSpec> every_dtype_specs() {
  std::vector<TensorSpec> specs;
  std::int64_t rows = 1;
  for (DType d : kAllDTypes) specs.push_back({"t_" + std::string(dtype_name(d)), d, {rows++, 3}});
  specs.push_back({"empty_f32", DType::kF32, {0, 3}});
  specs.push_back({"empty_bf16", DType::kBF16, {3, 0}});
  specs.push_back({"scalar_f64", DType::kF64, {}});
  specs.push_back({"scalar_u8", DType::kU8, {}});
  specs.push_back({"odd_f8", DType::kF8E4M3, {7}});  // odd byte counts before wider types would misalign them
  specs.push_back({"odd_i16", DType::kI16, {5}});
  return specs;
}

// Writes `specs` with pattern bytes and returns them by name.
std::map<std::string, std::vector<std::byte>> write_all(SafetensorsWriter& writer,
                                                        const std::vector<TensorSpec>& specs) {
  std::map<std::string, std::vector<std::byte>> data;
  std::uint32_t seed = 1;
  for (const auto& s : specs) {
    data[s.name] = pattern_bytes(s, seed++);
    EXPECT_TRUE(writer.write(s.name, data[s.name]).ok()) << s.name;
  }
  return data;
}

TEST(SafetensorsRoundTrip, EveryDTypeEmptyAndScalarTensors) {
  TempDir dir;
  const auto path = dir / "model.safetensors";
  const auto specs = every_dtype_specs();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "héllo \"quoted\""}};
  auto writer = SafetensorsWriter::create(path, specs, metadata);
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  EXPECT_EQ((*writer)->path(), path);
  const auto data = write_all(**writer, specs);
  ASSERT_TRUE((*writer)->commit().ok());

  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ(file->metadata(), metadata);
  ASSERT_EQ(file->tensors().size(), specs.size());
  std::uint64_t total = 0;
  for (const auto& s : specs) {
    SCOPED_TRACE(s.name);
    const auto* entry = file->find(s.name);
    ASSERT_NE(entry, nullptr);
    EXPECT_EQ(entry->dtype, s.dtype);
    EXPECT_EQ(entry->shape, s.shape);
    EXPECT_EQ(entry->nbytes(), s.nbytes());
    auto view = file->view(s.name);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(view->dtype, s.dtype);
    EXPECT_EQ(view->shape, s.shape);
    EXPECT_TRUE(same_bytes(view->bytes(), data.at(s.name)));
    total += s.nbytes();
  }
  EXPECT_EQ(file->file_size(), file->data_start() + total);
  EXPECT_EQ(fs::file_size(path), file->file_size());
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsRoundTrip, LayoutIsAligned) {
  TempDir dir;
  const auto path = dir / "aligned.safetensors";
  const auto specs = every_dtype_specs();
  auto writer = SafetensorsWriter::create(path, specs, {{"format", "pt"}});
  ASSERT_TRUE(writer.ok());
  write_all(**writer, specs);
  ASSERT_TRUE((*writer)->commit().ok());

  const std::string raw = read_file(path);
  ASSERT_GE(raw.size(), 8u);
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | static_cast<unsigned char>(raw[i]);
  EXPECT_EQ(header_length % 8, 0u);
  EXPECT_EQ(raw[8], '{');
  // Padding is spaces after the closing brace, as the reference writer emits.
  const std::string header = raw.substr(8, header_length);
  const auto close = header.find_last_of('}');
  ASSERT_NE(close, std::string::npos);
  EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos);
  EXPECT_LT(header.size() - close - 1, 8u);

  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ(file->data_start(), 8 + header_length);
  EXPECT_EQ(file->data_start() % 8, 0u);
  std::size_t previous_size = 8;
  std::uint64_t cursor = 0;
  for (const auto& e : file->tensors()) {  // in data order
    SCOPED_TRACE(e.name);
    EXPECT_EQ(e.begin % dtype_size(e.dtype), 0u);
    EXPECT_EQ((file->data_start() + e.begin) % dtype_size(e.dtype), 0u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(file->view(e).data) % dtype_size(e.dtype), 0u);
    EXPECT_LE(dtype_size(e.dtype), previous_size) << "wider types come first";
    EXPECT_EQ(e.begin, cursor) << "no holes";
    previous_size = dtype_size(e.dtype);
    cursor = e.end;
  }
  // The reference writer's order (safetensors 0.8, observed): its dtype enum descending, then names.
  std::vector<std::string> dtype_order;
  for (const auto& e : file->tensors()) {
    const std::string name(safetensors_name(e.dtype));
    if (dtype_order.empty() || dtype_order.back() != name) dtype_order.push_back(name);
  }
  EXPECT_EQ(dtype_order, (std::vector<std::string>{"U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16",
                                                   "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"}));
  for (std::size_t i = 1; i < file->tensors().size(); ++i) {
    const auto& a = file->tensors()[i - 1];
    const auto& b = file->tensors()[i];
    if (a.dtype == b.dtype) {
      EXPECT_LT(a.name, b.name);
    }
  }
  // The JSON header lists the same tensors with __metadata__ first.
  const auto parsed = nlohmann::ordered_json::parse(header);
  EXPECT_EQ(parsed.begin().key(), "__metadata__");
  EXPECT_EQ(parsed.size(), specs.size() + 1);
  EXPECT_EQ(parsed["t_bf16"]["dtype"], "BF16");
  EXPECT_EQ(parsed["scalar_f64"]["shape"], nlohmann::json::array());
  EXPECT_EQ(parsed["empty_f32"]["shape"], nlohmann::json({0, 3}));
}

TEST(SafetensorsRoundTrip, NoMetadataAndNoTensors) {
  TempDir dir;
  auto writer = SafetensorsWriter::create(dir / "empty.safetensors", {}, {});
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->commit().ok());
  const std::string raw = read_file(dir / "empty.safetensors");
  EXPECT_EQ(raw.size(), 16u);
  EXPECT_EQ(raw.substr(8), "{}      ");
  auto file = SafetensorsFile::open(dir / "empty.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_TRUE(file->tensors().empty());
  EXPECT_TRUE(file->metadata().empty());
}

TEST(SafetensorsRoundTrip, WritePartInPiecesAnyOrder) {
  TempDir dir;
  const TensorSpec a{"a", DType::kF32, {10, 7}};
  const TensorSpec b{"b", DType::kBF16, {3}};
  auto writer = SafetensorsWriter::create(dir / "parts.safetensors", {a, b}, {});
  ASSERT_TRUE(writer.ok());
  const auto bytes_a = pattern_bytes(a, 11);
  const auto bytes_b = pattern_bytes(b, 12);
  const std::span<const std::byte> all(bytes_a);
  ASSERT_TRUE((*writer)->write_part("a", 200, all.subspan(200)).ok());
  ASSERT_TRUE((*writer)->write("b", bytes_b).ok());
  ASSERT_TRUE((*writer)->write_part("a", 0, all.subspan(0, 13)).ok());
  ASSERT_TRUE((*writer)->write_part("a", 13, all.subspan(13, 0)).ok());  // an empty part is harmless
  EXPECT_TRUE(fails_with((*writer)->commit(), "parts.safetensors: 1 tensor(s) not completely written: a"))
      << "bytes [13, 200) of a are still missing";
  ASSERT_TRUE((*writer)->write_part("a", 13, all.subspan(13, 187)).ok());
  ASSERT_TRUE((*writer)->commit().ok());

  auto file = SafetensorsFile::open(dir / "parts.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_TRUE(same_bytes(file->view("a")->bytes(), bytes_a));
  EXPECT_TRUE(same_bytes(file->view("b")->bytes(), bytes_b));
}

TEST(SafetensorsWriterErrors, WritesOutsideTheLayoutFail) {
  TempDir dir;
  const auto path = dir / "w.safetensors";
  auto writer = SafetensorsWriter::create(path, {{"a", DType::kF32, {4}}}, {});
  ASSERT_TRUE(writer.ok());
  std::vector<std::byte> sixteen(16), twelve(12), eight(8);

  Status status = (*writer)->write("nope", sixteen);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("'nope'"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find(path), std::string::npos) << status.message();

  status = (*writer)->write("a", twelve);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("expects 16 bytes, got 12"), std::string::npos) << status.message();

  EXPECT_TRUE(fails_with((*writer)->write_part("a", 12, eight), "tensor 'a': bytes [12, 20) exceed its 16 bytes"))
      << "runs past the end";
  EXPECT_TRUE(fails_with((*writer)->write_part("a", 17, {}), "tensor 'a': bytes [17, 17) exceed its 16 bytes"))
      << "starts past the end";
  EXPECT_TRUE(fails_with((*writer)->write_part("a", ~0ULL, eight),
                         "tensor 'a': bytes [18446744073709551615, 7) exceed its 16 bytes"))
      << "offset overflow";
  ASSERT_TRUE((*writer)->write_part("a", 0, eight).ok());
  ASSERT_TRUE((*writer)->write_part("a", 8, eight).ok());
  EXPECT_TRUE(fails_with((*writer)->write_part("a", 0, eight),
                         "tensor 'a': bytes [0, 8) exceed its 16 bytes or were already written"))
      << "more bytes than the tensor holds";
  EXPECT_TRUE((*writer)->has("a"));
  EXPECT_FALSE((*writer)->has("b"));
  ASSERT_TRUE((*writer)->commit().ok());
  EXPECT_TRUE((*writer)->commit().ok()) << "commit is idempotent";
  EXPECT_TRUE(fails_with((*writer)->write_part("a", 0, {}), "w.safetensors: write after commit"))
      << "write after commit";
}

TEST(SafetensorsWriterErrors, CreateRejectsBadSpecs) {
  TempDir dir;
  const auto path = dir / "bad.safetensors";
  auto twice = SafetensorsWriter::create(path, {{"a", DType::kF32, {1}}, {"a", DType::kF16, {2}}}, {});
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("'a' given twice"), std::string::npos) << twice.status().message();
  auto reserved = SafetensorsWriter::create(path, {{"__metadata__", DType::kF32, {1}}}, {});
  ASSERT_FALSE(reserved.ok());
  EXPECT_NE(reserved.status().message().find("reserved"), std::string::npos);
  auto negative = SafetensorsWriter::create(path, {{"n", DType::kF32, {-1}}}, {});
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("'n'"), std::string::npos);
  auto missing_dir = SafetensorsWriter::create(dir / "no/such/dir.safetensors", {}, {});
  ASSERT_TRUE(fails_with(missing_dir, "no/such/.dir.safetensors.tmp."));
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsWriterErrors, CommitNamesMissingTensorsAndLeavesNoFile) {
  TempDir dir;
  const auto path = dir / "partial.safetensors";
  {
    auto writer = SafetensorsWriter::create(
        path, {{"done", DType::kF32, {2}}, {"half", DType::kF32, {4}}, {"never", DType::kI64, {3}}}, {});
    ASSERT_TRUE(writer.ok());
    std::vector<std::byte> eight(8);
    ASSERT_TRUE((*writer)->write("done", eight).ok());
    ASSERT_TRUE((*writer)->write_part("half", 0, eight).ok());
    const Status status = (*writer)->commit();
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find(path), std::string::npos) << status.message();
    EXPECT_NE(status.message().find("2 tensor(s)"), std::string::npos) << status.message();
    EXPECT_NE(status.message().find("half"), std::string::npos) << status.message();
    EXPECT_NE(status.message().find("never"), std::string::npos) << status.message();
    EXPECT_EQ(status.message().find("done"), std::string::npos) << status.message();
    EXPECT_FALSE(fs::exists(path));
  }
  EXPECT_TRUE(dir.entries().empty()) << "the temporary file is removed";
}

TEST(SafetensorsWriterErrors, FailedCommitLeavesAnExistingFileUntouched) {
  TempDir dir;
  const auto path = dir / "model.safetensors";
  write_file(path, "the previous checkpoint");
  {
    auto writer = SafetensorsWriter::create(path, {{"w", DType::kBF16, {8}}}, {});
    ASSERT_TRUE(writer.ok());
    EXPECT_EQ(read_file(path), "the previous checkpoint") << "create does not touch the target";
    std::vector<std::byte> part(6);
    ASSERT_TRUE((*writer)->write_part("w", 0, part).ok());
    EXPECT_TRUE(fails_with((*writer)->commit(), "model.safetensors: 1 tensor(s) not completely written: w"));
    EXPECT_EQ(read_file(path), "the previous checkpoint");
  }
  EXPECT_EQ(read_file(path), "the previous checkpoint");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsWriterErrors, AbandonedWriterLeavesAnExistingFileUntouched) {
  TempDir dir;
  const auto path = dir / "model.safetensors";
  write_file(path, "old");
  {
    auto writer = SafetensorsWriter::create(path, {{"w", DType::kU8, {3}}}, {});
    ASSERT_TRUE(writer.ok());
    std::vector<std::byte> three(3);
    ASSERT_TRUE((*writer)->write("w", three).ok());
    // destroyed without commit
  }
  EXPECT_EQ(read_file(path), "old");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsWriterErrors, SuccessfulCommitReplacesAnExistingFile) {
  TempDir dir;
  const auto path = dir / "model.safetensors";
  write_file(path, "old");
  auto writer = SafetensorsWriter::create(path, {{"w", DType::kU8, {3}}}, {});
  ASSERT_TRUE(writer.ok());
  const std::vector<std::byte> three = {std::byte{1}, std::byte{2}, std::byte{3}};
  ASSERT_TRUE((*writer)->write("w", three).ok());
  ASSERT_TRUE((*writer)->commit().ok());
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_TRUE(same_bytes(file->view("w")->bytes(), three));
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

// --- save_pretrained's shard cutting (huggingface_hub split_state_dict_into_shards_factory) ---

std::vector<TensorSpec> u8_specs(const std::vector<std::pair<std::string, std::int64_t>>& sizes) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, bytes] : sizes) specs.push_back({name, DType::kU8, {bytes}});
  return specs;
}

std::vector<std::vector<std::string>> names_of(const std::vector<std::vector<TensorSpec>>& plan) {
  std::vector<std::vector<std::string>> out;
  for (const auto& shard : plan) {
    out.emplace_back();
    for (const auto& s : shard) out.back().push_back(s.name);
  }
  return out;
}

TEST(PlanShards, MatchesSavePretrained) {
  // Expected plans computed with huggingface_hub.split_torch_state_dict_into_shards on uint8 tensors of these sizes.
  struct Case {
    std::vector<std::pair<std::string, std::int64_t>> sizes;
    std::uint64_t limit;
    std::vector<std::vector<std::string>> expected;
  };
  const Case cases[] = {
      {{{"a", 40}, {"b", 40}, {"c", 40}}, 100, {{"a", "b"}, {"c"}}},
      {{{"a", 50}, {"b", 50}, {"c", 1}}, 100, {{"a", "b"}, {"c"}}},  // exactly full stays one shard
      {{{"a", 10}, {"B", 200}, {"c", 10}}, 100, {{"B"}, {"a", "c"}}},
      {{{"A", 200}, {"b", 10}, {"c", 10}}, 100, {{"A"}, {"b", "c"}}},
      {{{"a", 60}, {"B", 101}, {"c", 30}, {"D", 150}, {"e", 20}}, 100, {{"B"}, {"D"}, {"a", "c"}, {"e"}}},
      {{{"a", 0}, {"B", 101}, {"c", 0}}, 100, {{"B"}, {"a", "c"}}},
      {{{"A", 101}, {"B", 101}}, 100, {{"A"}, {"B"}}},
      {{{"a", 1}, {"b", 1}, {"c", 1}}, 5'000'000'000, {{"a", "b", "c"}}},
  };
  for (const auto& c : cases) {
    const auto plan = names_of(plan_safetensors_shards(u8_specs(c.sizes), c.limit));
    EXPECT_EQ(plan, c.expected) << "limit " << c.limit << ", first tensor " << c.sizes.front().first;
  }
}

TEST(PlanShards, NoTensorsGiveOneEmptyShard) {
  const auto plan = plan_safetensors_shards({}, 100);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_TRUE(plan[0].empty());
}

TEST(PlanShards, EveryTensorPlacedOnceAndShardsRespectTheLimit) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 200; ++i)
    specs.push_back(
        {"t" + std::to_string(i), i % 3 ? DType::kBF16 : DType::kF32, {(i * 37) % 23 + (i % 17 == 0 ? 90 : 0)}});
  for (std::uint64_t limit : {1ULL, 50ULL, 64ULL, 100ULL, 333ULL, 1000ULL, 100000ULL}) {
    const auto plan = plan_safetensors_shards(specs, limit);
    std::vector<std::string> seen;
    for (const auto& shard : plan) {
      EXPECT_FALSE(shard.empty()) << "limit " << limit;
      std::uint64_t bytes = 0;
      for (const auto& s : shard) {
        bytes += s.nbytes();
        seen.push_back(s.name);
      }
      if (shard.size() > 1) {
        EXPECT_LE(bytes, limit);
      }
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end());
    EXPECT_EQ(seen.size(), specs.size());
  }
}

// --- the sharded writer ---

struct ShardedFixture {
  std::vector<TensorSpec> specs = {
      {"model.embed_tokens.weight", DType::kBF16, {64, 16}},  // 2048 bytes: larger than the limit
      {"model.layers.0.mlp.weight", DType::kBF16, {16, 16}},  // 512
      {"model.layers.0.norm.weight", DType::kF32, {16}},      // 64
      {"model.layers.1.mlp.weight", DType::kBF16, {16, 16}},  // 512
      {"model.layers.1.norm.weight", DType::kF32, {16}},      // 64
      {"model.norm.weight", DType::kF32, {16}},               // 64
      {"model.empty", DType::kF16, {0, 16}},                  // 0
  };
  std::uint64_t limit = 1024;
};

TEST(ShardedWriter, WritesShardsAndIndexAsSavePretrained) {
  TempDir dir;
  const ShardedFixture f;
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  auto writer = ShardedSafetensorsWriter::create(dir.path().string(), f.specs, f.limit, metadata);
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  const auto plan = plan_safetensors_shards(f.specs, f.limit);
  ASSERT_EQ(plan.size(), 3u);  // [embed], [layer 0], [layer 1, norm, empty]
  const std::vector<std::string> expected_files = {
      "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"};
  EXPECT_EQ((*writer)->shard_files(), expected_files);

  std::map<std::string, std::vector<std::byte>> data;
  std::uint32_t seed = 100;
  for (const auto& s : f.specs) {
    data[s.name] = pattern_bytes(s, seed++);
    ASSERT_TRUE((*writer)->write(s.name, data[s.name]).ok()) << s.name;
  }
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json")) << "the index is written last, on commit";
  EXPECT_TRUE(fails_with((*writer)->write("not.a.tensor", {}), "tensor 'not.a.tensor' is not part of this checkpoint"));
  ASSERT_TRUE((*writer)->commit().ok());

  std::vector<std::string> expected_entries = expected_files;
  expected_entries.push_back("model.safetensors.index.json");
  EXPECT_EQ(dir.entries(), expected_entries);

  const auto index = nlohmann::json::parse(read_file(dir / "model.safetensors.index.json"));
  std::uint64_t total_bytes = 0, total_params = 0;
  for (const auto& s : f.specs) {
    total_bytes += s.nbytes();
    total_params += static_cast<std::uint64_t>(numel(s.shape));
  }
  EXPECT_EQ(index["metadata"]["total_size"], total_bytes);
  EXPECT_EQ(index["metadata"]["total_parameters"], total_params);
  ASSERT_EQ(index["weight_map"].size(), f.specs.size());
  for (std::size_t shard = 0; shard < plan.size(); ++shard)
    for (const auto& s : plan[shard]) EXPECT_EQ(index["weight_map"][s.name], expected_files[shard]) << s.name;
  // save_pretrained's own cutting for this order: the oversized embedding first, then the open shard.
  EXPECT_EQ(index["weight_map"]["model.embed_tokens.weight"], expected_files[0]);
  EXPECT_EQ(index["weight_map"]["model.layers.0.mlp.weight"], expected_files[1]);
  EXPECT_EQ(index["weight_map"]["model.layers.1.mlp.weight"], expected_files[2]);

  auto ckpt = SafetensorsCheckpoint::open(dir.path().string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  EXPECT_EQ(ckpt->index_path(), dir / "model.safetensors.index.json");
  EXPECT_EQ(ckpt->files().size(), 3u);
  ASSERT_EQ(ckpt->size(), f.specs.size());
  EXPECT_TRUE(std::is_sorted(ckpt->names().begin(), ckpt->names().end()));
  for (const auto& s : f.specs) {
    auto view = ckpt->view(s.name);
    ASSERT_TRUE(view.ok()) << view.status().message();
    EXPECT_EQ(view->dtype, s.dtype);
    EXPECT_EQ(view->shape, s.shape);
    EXPECT_TRUE(same_bytes(view->bytes(), data[s.name])) << s.name;
    auto located = ckpt->find(s.name);
    ASSERT_TRUE(located.ok());
    EXPECT_EQ(located->file->metadata(), metadata);
  }
  EXPECT_TRUE(fails_with(ckpt->find("missing"), "no tensor named 'missing'"));
}

TEST(ShardedWriter, OneShardIsASingleFileWithoutIndex) {
  TempDir dir;
  const ShardedFixture f;
  auto writer = ShardedSafetensorsWriter::create(dir.path().string(), f.specs, 5'000'000'000, {{"format", "pt"}});
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  EXPECT_EQ((*writer)->shard_files(), std::vector<std::string>{"model.safetensors"});
  for (const auto& s : f.specs) ASSERT_TRUE((*writer)->write(s.name, pattern_bytes(s, 7)).ok());
  ASSERT_TRUE((*writer)->commit().ok());
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
  auto ckpt = SafetensorsCheckpoint::open(dir.path().string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  EXPECT_TRUE(ckpt->index_path().empty());
  EXPECT_EQ(ckpt->size(), f.specs.size());
}

TEST(ShardedWriter, PrefixNamesFilesAndIndex) {
  TempDir dir;
  const std::vector<TensorSpec> specs = {{"a", DType::kF32, {100}}, {"b", DType::kF32, {100}}};
  auto writer = ShardedSafetensorsWriter::create((dir.path() / "sub").string(), specs, 400, {}, "adapter");
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  for (const auto& s : specs) ASSERT_TRUE((*writer)->write_part(s.name, 0, pattern_bytes(s, 3)).ok());
  ASSERT_TRUE((*writer)->commit().ok());
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(dir.path() / "sub")) entries.push_back(e.path().filename().string());
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries,
            (std::vector<std::string>{"adapter-00001-of-00002.safetensors", "adapter-00002-of-00002.safetensors",
                                      "adapter.safetensors.index.json"}));
}

TEST(ShardedWriter, IncompleteCommitWritesNoIndex) {
  TempDir dir;
  const ShardedFixture f;
  {
    auto writer = ShardedSafetensorsWriter::create(dir.path().string(), f.specs, f.limit, {});
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->write(f.specs[0].name, pattern_bytes(f.specs[0], 1)).ok());
    const Status status = (*writer)->commit();
    ASSERT_TRUE(fails_with(status, "model-00002-of-00003.safetensors: 2 tensor(s) not completely written"));
    EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  }
  // Shards committed before the failing one remain, but no index claims a complete checkpoint.
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  for (const auto& name : dir.entries()) EXPECT_NE(name.front(), '.') << "temporary left behind: " << name;
}

}  // namespace
}  // namespace trestle
