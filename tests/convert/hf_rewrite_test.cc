// Hugging Face -> Hugging Face rewrite: tensors carried bit for bit (or cast), side files copied, destination rules.
#include "convert/hf_rewrite.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "tests/support/status_matchers.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;

class HfRewriteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "trestle_rw_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    root_ = pattern;
    fs::create_directory(src());
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string src() const { return (root_ / "src").string(); }
  std::string dst() const { return (root_ / "dst").string(); }
  static std::string read(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  static std::vector<std::string> entries(const fs::path& dir) {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
  // A sharded source: tensors with distinct bytes, an index, a config and side files.
  void make_source(std::uint64_t max_shard_bytes) {
    std::uint8_t next = 1;
    for (const auto& spec : specs_) {
      std::vector<std::byte> bytes(spec.nbytes());
      for (auto& b : bytes) b = static_cast<std::byte>(next++);
      data_[spec.name] = bytes;
    }
    auto writer = ShardedSafetensorsWriter::create(src(), specs_, max_shard_bytes, {{"format", "pt"}});
    ASSERT_TRUE(writer.ok()) << writer.status().message();
    for (const auto& spec : specs_) ASSERT_TRUE((*writer)->write(spec.name, data_[spec.name]).ok());
    ASSERT_TRUE((*writer)->commit().ok());
    std::ofstream(fs::path(src()) / "config.json") << R"({"model_type": "llama", "dtype": "float32", "vocab_size": 8})";
    std::ofstream(fs::path(src()) / "tokenizer.json") << R"({"model": {"type": "BPE"}})";
    std::ofstream(fs::path(src()) / ".cache") << "not copied";
  }
  HfRewriteOptions options(std::uint64_t max_shard_bytes) const {
    HfRewriteOptions o;
    o.max_shard_bytes = max_shard_bytes;
    o.progress = false;
    return o;
  }
  fs::path root_;
  std::vector<TensorSpec> specs_ = {{"embed.weight", DType::kF32, {8, 4}},
                                    {"layer.0.weight", DType::kF32, {4, 4}},
                                    {"layer.1.weight", DType::kF32, {4, 4}},
                                    {"ids", DType::kI64, {3}},
                                    {"empty", DType::kF32, {0, 4}}};
  std::map<std::string, std::vector<std::byte>> data_;
};

TEST_F(HfRewriteTest, ReshardsBitExactlyAndCopiesSideFiles) {
  make_source(100);  // several shards
  ASSERT_FALSE(entries(src()).empty());
  auto report = rewrite_hf_checkpoint(src(), dst(), options(1'000'000));
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_EQ(report->tensors, specs_.size());
  EXPECT_EQ(report->shards, 1u);
  std::uint64_t total = 0;
  for (const auto& s : specs_) total += s.nbytes();
  EXPECT_EQ(report->bytes_read, total);
  EXPECT_EQ(report->bytes_written, total);
  EXPECT_EQ(entries(dst()), (std::vector<std::string>{"config.json", "model.safetensors", "tokenizer.json"}));
  EXPECT_EQ(read(fs::path(dst()) / "config.json"), read(fs::path(src()) / "config.json"));
  EXPECT_EQ(read(fs::path(dst()) / "tokenizer.json"), read(fs::path(src()) / "tokenizer.json"));

  auto ckpt = SafetensorsCheckpoint::open(dst());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  ASSERT_EQ(ckpt->size(), specs_.size());
  EXPECT_EQ(ckpt->files().front().metadata().at("format"), "pt");
  for (const auto& s : specs_) {
    auto view = ckpt->view(s.name);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(view->dtype, s.dtype);
    EXPECT_EQ(view->shape, s.shape);
    ASSERT_EQ(view->nbytes(), data_[s.name].size());
    EXPECT_TRUE(view->nbytes() == 0 || std::memcmp(view->data, data_[s.name].data(), view->nbytes()) == 0) << s.name;
  }
}

// A hub cache snapshot (every file a link to ../../blobs/<hash>) rewrites like a plain directory, config.json included;
// a link out of the tree is refused before anything is written.
TEST_F(HfRewriteTest, ReadsAHubCacheSnapshotAndRefusesALinkOut) {
  make_source(100);
  const fs::path repo = root_ / "models--org--name", snapshot = repo / "snapshots" / "c0ffee";
  fs::create_directories(repo / "blobs");
  fs::create_directories(snapshot);
  int blob = 0;
  for (const auto& name : entries(src())) {
    const std::string hash = "blob" + std::to_string(blob++);
    fs::rename(fs::path(src()) / name, repo / "blobs" / hash);
    fs::create_symlink("../../blobs/" + hash, snapshot / name);
  }
  auto report = rewrite_hf_checkpoint(snapshot.string(), dst(), options(1'000'000));
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_EQ(entries(dst()), (std::vector<std::string>{"config.json", "model.safetensors", "tokenizer.json"}));
  EXPECT_EQ(read(fs::path(dst()) / "config.json"), read(snapshot / "config.json"));

  std::ofstream(root_ / "secret") << "not for the output";
  fs::remove(snapshot / "tokenizer.json");
  fs::create_symlink(root_ / "secret", snapshot / "tokenizer.json");
  const std::string out = (root_ / "out").string();
  report = rewrite_hf_checkpoint(snapshot.string(), out, options(1'000'000));
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find((snapshot / "tokenizer.json").string()), std::string::npos)
      << report.status().message();
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(HfRewriteTest, WritesAnIndexWhenSharded) {
  make_source(1'000'000);
  auto report = rewrite_hf_checkpoint(src(), dst(), options(64));
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_GT(report->shards, 1u);
  EXPECT_TRUE(fs::exists(fs::path(dst()) / "model.safetensors.index.json"));
  auto ckpt = SafetensorsCheckpoint::open(dst());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  EXPECT_EQ(ckpt->files().size(), report->shards);
}

TEST_F(HfRewriteTest, CastsFloatTensorsAndUpdatesTheConfig) {
  specs_ = {{"w", DType::kF32, {4}}, {"ids", DType::kI32, {2}}};
  const float values[4] = {1.0f, -2.5f, 1.00390625f /* halfway: rounds to even 1.0 */, 1.01171875f /* to 1.015625 */};
  make_source(1'000'000);
  {
    // Overwrite the pattern bytes of w with real values.
    auto writer =
        SafetensorsWriter::create((fs::path(src()) / "model.safetensors").string(), specs_, {{"format", "pt"}});
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->write("w", std::as_bytes(std::span(values))).ok());
    ASSERT_TRUE((*writer)->write("ids", data_["ids"]).ok());
    ASSERT_TRUE((*writer)->commit().ok());
  }
  HfRewriteOptions o = options(1'000'000);
  o.dtype = DType::kBF16;
  auto report = rewrite_hf_checkpoint(src(), dst(), o);
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_EQ(report->bytes_written, 4u * 2 + 2u * 4);
  auto ckpt = SafetensorsCheckpoint::open(dst());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  auto w = ckpt->view("w");
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w->dtype, DType::kBF16);
  std::uint16_t bits[4];
  std::memcpy(bits, w->data, sizeof bits);
  EXPECT_EQ(bits[0], 0x3F80);
  EXPECT_EQ(bits[1], 0xC020);
  EXPECT_EQ(bits[2], 0x3F80);
  EXPECT_EQ(bits[3], 0x3F82);
  EXPECT_EQ(ckpt->view("ids")->dtype, DType::kI32) << "integers are never cast";
  const auto config = nlohmann::json::parse(read(fs::path(dst()) / "config.json"));
  EXPECT_EQ(config["dtype"], "bfloat16");
}

TEST_F(HfRewriteTest, RefusesANonEmptyDestination) {
  make_source(1'000'000);
  fs::create_directory(dst());
  std::ofstream(fs::path(dst()) / "model.safetensors") << "precious";
  auto report = rewrite_hf_checkpoint(src(), dst(), options(1'000'000));
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find(dst()), std::string::npos) << report.status().message();
  EXPECT_EQ(entries(dst()), std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(read(fs::path(dst()) / "model.safetensors"), "precious");

  std::ofstream(root_ / "a_file") << "x";
  EXPECT_TRUE(fails_with(rewrite_hf_checkpoint(src(), (root_ / "a_file").string(), options(1'000'000)),
                         "a_file: destination exists and is not an empty directory"));
}

TEST_F(HfRewriteTest, AnEmptyDirectoryIsAValidDestination) {
  make_source(1'000'000);
  fs::create_directory(dst());
  EXPECT_TRUE(rewrite_hf_checkpoint(src(), dst(), options(1'000'000)).ok());
}

TEST_F(HfRewriteTest, MissingOrMalformedSourceFails) {
  auto missing = rewrite_hf_checkpoint((root_ / "nowhere").string(), dst(), options(1'000'000));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nowhere"), std::string::npos);
  std::ofstream(fs::path(src()) / "config.json") << R"({"model_type": "llama"})";
  std::ofstream(fs::path(src()) / "model.safetensors") << "garbage!!";
  auto malformed = rewrite_hf_checkpoint(src(), dst(), options(1'000'000));
  ASSERT_FALSE(malformed.ok());
  EXPECT_NE(malformed.status().message().find("model.safetensors"), std::string::npos);
}

// hf -> trestle refuses a model without a readable config.json; hf -> hf did not, and wrote a model without one.
TEST_F(HfRewriteTest, RefusesAMissingOrInvalidConfig) {
  make_source(1'000'000);
  const fs::path config = fs::path(src()) / "config.json";
  const std::pair<const char*, const char*> cases[] = {{"missing", "config.json"},
                                                       {"directory", "config.json"},
                                                       {"{oops", "not valid JSON"},
                                                       {"[1, 2]", "not a JSON object"},
                                                       {R"({"hidden_size": "64"})", "'hidden_size'"}};
  for (const auto& [content, words] : cases) {
    SCOPED_TRACE(content);
    fs::remove_all(config);
    if (std::string(content) == "directory") fs::create_directory(config);
    else if (std::string(content) != "missing") std::ofstream(config) << content;
    auto report = rewrite_hf_checkpoint(src(), dst(), options(1'000'000));
    EXPECT_TRUE(fails_with(report, config.string()));
    EXPECT_TRUE(fails_with(report, words));
    EXPECT_FALSE(fs::exists(dst()));
  }
}

// The 9 shards of a model whose index lists none of their tensors: written out, that was a model of 0 tensors.
TEST_F(HfRewriteTest, RefusesAnIndexThatLeavesTensorsOut) {
  make_source(100);  // several shards
  const fs::path index = fs::path(src()) / "model.safetensors.index.json";
  std::ofstream(index, std::ios::trunc) << R"({"metadata": {}, "weight_map": {}})";
  auto report = rewrite_hf_checkpoint(src(), dst(), options(1'000'000));
  EXPECT_TRUE(fails_with(report, index.string()));
  EXPECT_TRUE(fails_with(report, "lists no tensors"));
  EXPECT_FALSE(fs::exists(dst()));
}

TEST_F(HfRewriteTest, RefusesAModelWithoutWeights) {
  std::ofstream(fs::path(src()) / "config.json") << R"({"model_type": "llama"})";
  auto writer = ShardedSafetensorsWriter::create(src(), {}, 1'000'000, {{"format", "pt"}});
  ASSERT_TRUE(writer.ok()) << writer.status().message();
  ASSERT_TRUE((*writer)->commit().ok());
  auto report = rewrite_hf_checkpoint(src(), dst(), options(1'000'000));
  EXPECT_TRUE(fails_with(report, src() + ": holds no tensors"));
  EXPECT_FALSE(fs::exists(dst()));
}

}  // namespace
}  // namespace trestle
