// Malformed safetensors files and inconsistent sharded directories: each must fail to open with a message that names
// the file and says what is wrong, and none may crash (the mutation test feeds the parser damaged headers).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/formats/safetensors/safetensors_file.h"
#include "convert/formats/safetensors/safetensors_header.h"
#include "convert/formats/safetensors/safetensors_writer.h"
#include "tests/support/temp_dir.h"

namespace trestle {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

void write_file(const std::string& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary);
  out << content;
}

std::string le64(std::uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A file as the format lays it out: length prefix, header text as given (no padding added), data buffer.
std::string st_file(const std::string& header, std::size_t data_bytes = 0) {
  return le64(header.size()) + header + std::string(data_bytes, '\x5a');
}

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
}

struct MalformedCase {
  const char* what;
  std::string bytes;
  std::vector<std::string> words;  // each must appear in the error message
  std::uint64_t sparse_size = 0;   // when set, the file is extended (sparsely) to this size
};

std::vector<MalformedCase> malformed_cases() {
  const std::string ok_a = entry("a", "F32", "[2]", "[0,8]");
  return {
      {"empty file", "", {"too short", "8-byte header length"}},
      {"shorter than 8 bytes", std::string("\x10\x00\x00", 3), {"3 bytes", "too short"}},
      {"header length past end of file", le64(1000) + "{}", {"header length 1000", "past the end of the file"}},
      {"header length near 2^64", le64(~0ULL) + "{}      ", {"header length"}},
      {"header length over 100,000,000",
       le64(100'000'008) + "{}",
       {"header length 100000008", "exceeds the limit", "100000000"},
       8 + 100'000'008 + 8},
      {"invalid JSON", st_file("{\"a\": {\"dtype\": "), {"not valid JSON"}},
      {"trailing garbage after the object", st_file("{} x"), {"not valid JSON"}},
      {"NUL padding", st_file("{}" + std::string(6, '\0')), {"NUL byte at byte 10", "only spaces"}},
      {"garbage after a NUL", st_file(std::string("{}\0x    ", 8)), {"NUL byte at byte 10"}},
      {"invalid UTF-8 in a name", st_file("{\"\xff\xfe\":1}"), {"not valid JSON"}},
      {"header not starting with '{'", st_file(" {}     "), {"does not start with", "'{'"}},
      {"empty header", st_file(""), {"does not start with", "'{'"}},
      {"JSON array instead of object", st_file("[{\"a\":1}]"), {"JSON object"}},
      {"entry not an object", st_file("{\"a\":[1,2]}"), {"tensor 'a'", "not a JSON object"}},
      {"unknown dtype",
       st_file("{" + entry("w", "F17", "[2]", "[0,8]") + "}", 8),
       {"tensor 'w'", "unknown dtype 'F17'", "BF16"}},
      {"lower-case dtype",
       st_file("{" + entry("w", "f32", "[2]", "[0,8]") + "}", 8),
       {"tensor 'w'", "unknown dtype 'f32'"}},
      {"missing dtype", st_file("{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8), {"tensor 'w'", "'dtype'"}},
      {"dtype not a string",
       st_file("{\"w\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,8]}}", 8),
       {"tensor 'w'", "'dtype'"}},
      {"missing shape", st_file("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8), {"tensor 'w'", "'shape'"}},
      {"shape not a list", st_file("{" + entry("w", "F32", "2", "[0,8]") + "}", 8), {"tensor 'w'", "'shape'"}},
      {"negative shape",
       st_file("{" + entry("w", "F32", "[-2,1]", "[0,8]") + "}", 8),
       {"tensor 'w'", "shape", "non-negative integers"}},
      {"float in shape",
       st_file("{" + entry("w", "F32", "[2.0]", "[0,8]") + "}", 8),
       {"tensor 'w'", "shape", "non-negative integers"}},
      {"string in shape", st_file("{" + entry("w", "F32", "[\"2\"]", "[0,8]") + "}", 8), {"tensor 'w'", "shape"}},
      {"shape overflowing 64 bits",
       st_file("{" + entry("w", "F32", "[4294967296,4294967296,4]", "[0,8]") + "}", 8),
       {"tensor 'w'", "too large"}},
      {"missing data_offsets", st_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8), {"tensor 'w'", "data_offsets"}},
      {"data_offsets with one int",
       st_file("{" + entry("w", "F32", "[2]", "[8]") + "}", 8),
       {"tensor 'w'", "data_offsets"}},
      {"data_offsets with three ints",
       st_file("{" + entry("w", "F32", "[2]", "[0,8,8]") + "}", 8),
       {"tensor 'w'", "data_offsets"}},
      {"data_offsets with a string",
       st_file("{" + entry("w", "F32", "[2]", "[0,\"8\"]") + "}", 8),
       {"tensor 'w'", "data_offsets"}},
      {"data_offsets negative",
       st_file("{" + entry("w", "F32", "[2]", "[-8,0]") + "}", 8),
       {"tensor 'w'", "data_offsets"}},
      {"data_offsets float",
       st_file("{" + entry("w", "F32", "[2]", "[0,8.0]") + "}", 8),
       {"tensor 'w'", "data_offsets"}},
      {"data_offsets an object",
       st_file("{" + entry("w", "F32", "[2]", "{\"b\":0}") + "}", 8),
       {"tensor 'w'", "data_offsets"}},
      {"begin > end", st_file("{" + entry("w", "F32", "[0]", "[8,0]") + "}", 8), {"tensor 'w'", "[8,0]", "end before"}},
      {"offsets past the buffer",
       st_file("{" + entry("w", "F32", "[4]", "[0,16]") + "}", 8),
       {"tensor 'w'", "past the data buffer", "8 bytes"}},
      {"offsets far past the buffer",
       st_file("{" + entry("w", "U8", "[16]", "[18446744073709551599,18446744073709551615]") + "}", 8),
       {"tensor 'w'", "past the data buffer"}},
      {"a tensor moved past the end, leaving a hole where it was",
       st_file("{" + entry("moved", "F32", "[1]", "[64,68]") + "," + entry("b", "F32", "[1]", "[4,8]") + "}", 8),
       {"tensor 'moved'", "past the data buffer"}},
      {"bytes not matching dtype x shape",
       st_file("{" + entry("w", "F32", "[3]", "[0,8]") + "}", 8),
       {"tensor 'w'", "hold 8 bytes", "F32 [3] needs 12"}},
      {"empty shape with bytes",
       st_file("{" + entry("w", "F32", "[0,3]", "[0,4]") + "}", 4),
       {"tensor 'w'", "needs 0"}},
      {"overlapping tensors",
       st_file("{" + entry("a", "F32", "[2]", "[0,8]") + "," + entry("b", "F32", "[2]", "[4,12]") + "}", 12),
       {"tensor 'b'", "overlap", "'a'"}},
      {"same offsets twice", st_file("{" + ok_a + "," + entry("b", "F32", "[2]", "[0,8]") + "}", 8), {"overlap"}},
      {"empty tensor inside another",
       st_file("{" + ok_a + "," + entry("e", "F32", "[0]", "[4,4]") + "}", 8),
       {"overlap"}},
      {"hole between tensors",
       st_file("{" + entry("a", "F32", "[1]", "[0,4]") + "," + entry("b", "F32", "[1]", "[8,12]") + "}", 12),
       {"bytes [4, 8)", "belong to no tensor", "'b'"}},
      {"hole before the first tensor",
       st_file("{" + entry("b", "F32", "[1]", "[4,8]") + "}", 8),
       {"bytes [0, 4)", "belong to no tensor"}},
      {"trailing bytes", st_file("{" + entry("a", "F32", "[1]", "[0,4]") + "}", 8), {"4 trailing bytes"}},
      {"trailing bytes with no tensors", st_file("{}", 3), {"3 trailing bytes"}},
      {"duplicated tensor name",
       st_file("{" + entry("dup", "F32", "[1]", "[0,4]") + "," + entry("dup", "F32", "[1]", "[4,8]") + "}", 8),
       {"'dup'", "appears twice"}},
      {"__metadata__ with a non-string value",
       st_file("{\"__metadata__\":{\"format\":\"pt\",\"step\":5}}"),
       {"__metadata__", "'step'", "not a string"}},
      {"__metadata__ not an object", st_file("{\"__metadata__\":\"pt\"}"), {"__metadata__", "object of strings"}},
      {"__metadata__ null value", st_file("{\"__metadata__\":{\"k\":null}}"), {"__metadata__", "'k'"}},
  };
}

bool contains(const std::string& text, const std::string& word) { return text.find(word) != std::string::npos; }

TEST(SafetensorsMalformed, EveryCaseFailsNamingTheFileAndTheProblem) {
  TempDir dir;
  int n = 0;
  for (const auto& c : malformed_cases()) {
    SCOPED_TRACE(c.what);
    const std::string path = dir / ("case_" + std::to_string(n++) + ".safetensors");
    write_file(path, c.bytes);
    if (c.sparse_size) fs::resize_file(path, c.sparse_size);
    auto file = SafetensorsFile::open(path);
    ASSERT_FALSE(file.ok()) << "opened a malformed file";
    const std::string message = file.status().message();
    EXPECT_TRUE(message.starts_with(path + ": ")) << message;
    for (const auto& word : c.words) EXPECT_TRUE(contains(message, word)) << "'" << word << "' not in: " << message;
    // The checkpoint reader reports the same error for the file opened directly.
    auto ckpt = SafetensorsCheckpoint::open(path);
    ASSERT_FALSE(ckpt.ok());
    EXPECT_TRUE(contains(ckpt.status().message(), path)) << ckpt.status().message();
  }
}

TEST(SafetensorsMalformed, WellFormedVariantsOpen) {
  // Near misses of the rows above that the format allows, so the checks are not simply over-strict.
  TempDir dir;
  const std::vector<std::pair<const char*, std::string>> cases = {
      {"no tensors", st_file("{}")},
      {"padded header", st_file("{}      ")},
      {"tab and newline padding", st_file("{}\n\t  ")},
      {"metadata only", st_file("{\"__metadata__\":{\"format\":\"pt\"}}")},
      {"empty metadata", st_file("{\"__metadata__\":{}}")},
      {"0-d tensor", st_file("{" + entry("s", "F64", "[]", "[0,8]") + "}", 8)},
      {"empty tensors share an offset",
       st_file("{" + entry("e1", "F32", "[0]", "[0,0]") + "," + entry("e2", "BF16", "[0,4]", "[0,0]") + "}")},
      {"empty tensor at the end",
       st_file("{" + entry("a", "F32", "[2]", "[0,8]") + "," + entry("e", "I8", "[0]", "[8,8]") + "}", 8)},
      {"tensors listed out of data order",
       st_file("{" + entry("b", "F32", "[1]", "[4,8]") + "," + entry("a", "F32", "[1]", "[0,4]") + "}", 8)},
      {"extra fields ignored", st_file("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}}", 1)},
      {"unicode names", st_file("{" + entry("gewicht.\xc3\xbc", "U8", "[1]", "[0,1]") + "}", 1)},
  };
  int n = 0;
  for (const auto& [what, bytes] : cases) {
    SCOPED_TRACE(what);
    const std::string path = dir / ("ok_" + std::to_string(n++) + ".safetensors");
    write_file(path, bytes);
    auto file = SafetensorsFile::open(path);
    EXPECT_TRUE(file.ok()) << file.status().message();
  }
}

TEST(SafetensorsMalformed, OutOfOrderEntriesAreSortedByOffset) {
  TempDir dir;
  const std::string path = dir / "order.safetensors";
  write_file(path, st_file("{" + entry("b", "F32", "[1]", "[4,8]") + "," + entry("a", "I8", "[4]", "[0,4]") + "}", 8));
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  ASSERT_EQ(file->tensors().size(), 2u);
  EXPECT_EQ(file->tensors()[0].name, "a");
  EXPECT_EQ(file->tensors()[1].name, "b");
  EXPECT_EQ(file->find("b")->begin, 4u);
  EXPECT_EQ(file->view(*file->find("b")).data, file->view(*file->find("a")).data + 4);
  auto missing = file->view("c");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(contains(missing.status().message(), path)) << missing.status().message();
  EXPECT_TRUE(contains(missing.status().message(), "'c'")) << missing.status().message();
}

TEST(SafetensorsMalformed, NotARegularFile) {
  TempDir dir;
  auto missing = SafetensorsFile::open(dir / "absent.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(contains(missing.status().message(), dir / "absent.safetensors"));
  fs::create_directory(dir / "folder.safetensors");
  auto folder = SafetensorsFile::open(dir / "folder.safetensors");
  ASSERT_FALSE(folder.ok());
  EXPECT_TRUE(contains(folder.status().message(), "not a regular file")) << folder.status().message();
  // A FIFO is refused without waiting for a writer (a plain open would block forever).
  ASSERT_EQ(::mkfifo((dir / "pipe.safetensors").c_str(), 0600), 0);
  auto pipe = SafetensorsCheckpoint::open(dir / "pipe.safetensors");
  ASSERT_FALSE(pipe.ok());
  EXPECT_TRUE(contains(pipe.status().message(), "a FIFO")) << pipe.status().message();
}

// Damaged copies of a valid header (flipped, replaced, inserted bytes; truncations at every length) must give either a
// file or an error, never a crash, and whatever opens must still satisfy the layout invariants.
TEST(SafetensorsMalformed, MutatedHeadersNeverCrash) {
  TempDir dir;
  const std::string path = dir / "seed.safetensors";
  {
    std::vector<TensorSpec> specs = {{"model.embed.weight", DType::kBF16, {4, 3}},
                                     {"b", DType::kF32, {2}},
                                     {"s", DType::kI64, {}},
                                     {"e", DType::kU8, {0, 5}},
                                     {"f8", DType::kF8E5M2, {3}}};
    auto writer = SafetensorsWriter::create(path, specs, {{"format", "pt"}});
    ASSERT_TRUE(writer.ok());
    for (const auto& s : specs) ASSERT_TRUE((*writer)->write(s.name, std::vector<std::byte>(s.nbytes())).ok());
    ASSERT_TRUE((*writer)->commit().ok());
  }
  std::ifstream in(path, std::ios::binary);
  const std::string seed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

  auto check = [](const std::string& bytes) {
    auto header = parse_safetensors_header(bytes, bytes.size());
    if (!header.ok()) {
      EXPECT_FALSE(header.status().message().empty());
      return;
    }
    std::uint64_t cursor = 0;
    for (const auto& t : header->tensors) {
      EXPECT_EQ(t.begin, cursor);
      EXPECT_EQ(checked_nbytes(t.shape, dtype_size(t.dtype)), t.nbytes());
      cursor = t.end;
    }
    EXPECT_EQ(header->data_start + cursor, bytes.size());
  };

  for (std::size_t length = 0; length <= seed.size(); ++length) check(seed.substr(0, length));
  const std::string alphabet = std::string("{}[]\":,-.0123456789eE \\ABFU_") + '\0' + '\xff' + '\x80';
  std::mt19937 rng(12345);
  for (int i = 0; i < 20000; ++i) {
    std::string bytes = seed;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = rng() % bytes.size();
      switch (rng() % 4) {
        case 0:
          bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
          break;
        case 1:
          bytes[at] = alphabet[rng() % alphabet.size()];
          break;
        case 2:
          bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(at), alphabet[rng() % alphabet.size()]);
          break;
        default:
          bytes.erase(at, 1);
          break;
      }
    }
    check(bytes);
  }
}

// --- sharded directories whose index and shards disagree ---

class ShardedDirTest : public ::testing::Test {
 protected:
  // Writes a valid safetensors file `name` in the directory holding F32 [2] tensors with the given names.
  void shard(const std::string& name, const std::vector<std::string>& tensors) {
    std::vector<TensorSpec> specs;
    for (const auto& t : tensors) specs.push_back({t, DType::kF32, {2}});
    auto writer = SafetensorsWriter::create(dir_ / name, specs, {{"format", "pt"}});
    ASSERT_TRUE(writer.ok()) << writer.status().message();
    for (const auto& t : tensors) ASSERT_TRUE((*writer)->write(t, std::vector<std::byte>(8)).ok());
    ASSERT_TRUE((*writer)->commit().ok());
  }
  void index(const std::string& text, const std::string& name = "model.safetensors.index.json") {
    write_file(dir_ / name, text);
  }
  // Opens the directory expecting failure; checks the message names the directory and holds `words`.
  void expect_failure(const std::vector<std::string>& words) {
    auto ckpt = SafetensorsCheckpoint::open(dir_.str());
    ASSERT_FALSE(ckpt.ok()) << "opened an inconsistent checkpoint";
    const std::string message = ckpt.status().message();
    EXPECT_TRUE(contains(message, dir_.str())) << message;
    for (const auto& word : words) EXPECT_TRUE(contains(message, word)) << "'" << word << "' not in: " << message;
  }
  TempDir dir_;
};

TEST_F(ShardedDirTest, ConsistentDirectoryOpens) {
  shard("model-00001-of-00002.safetensors", {"a", "b"});
  shard("model-00002-of-00002.safetensors", {"c"});
  index(R"({"metadata": {"total_size": 24}, "weight_map": {"a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})");
  auto ckpt = SafetensorsCheckpoint::open(dir_.str());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  EXPECT_EQ(ckpt->names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(ckpt->files().size(), 2u);
  EXPECT_EQ(ckpt->find("c")->file->path(), dir_ / "model-00002-of-00002.safetensors");
}

TEST_F(ShardedDirTest, SingleFileBesideAnIndexIsAmbiguous) {
  // transformers would load model.safetensors, other loaders the index's shards: two sets of weights, refused.
  shard("model-00001-of-00001.safetensors", {"a"});
  index(R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})");
  shard("model.safetensors", {"a"});
  expect_failure({"holds both model.safetensors and model.safetensors.index.json", "transformers loads"});
}

TEST_F(ShardedDirTest, IndexNamesAMissingShard) {
  shard("model-00001-of-00002.safetensors", {"a"});
  index(R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})");
  expect_failure({"model.safetensors.index.json", "'model-00002-of-00002.safetensors'", "does not exist"});
}

TEST_F(ShardedDirTest, IndexMapsATensorToAShardThatLacksIt) {
  shard("model-00001-of-00002.safetensors", {"a"});
  shard("model-00002-of-00002.safetensors", {"b"});
  index(R"({"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})");
  // a is in shard 1, which the index does not name: the shard is reported as left out.
  expect_failure({"does not list shard model-00001-of-00002.safetensors"});
}

TEST_F(ShardedDirTest, IndexMapsATensorToTheWrongListedShard) {
  shard("model-00001-of-00002.safetensors", {"a"});
  shard("model-00002-of-00002.safetensors", {"b"});
  index(R"({"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}})");
  expect_failure({"maps tensor", "no such tensor"});
}

TEST_F(ShardedDirTest, IndexNamesATensorNoShardHolds) {
  shard("model-00001-of-00001.safetensors", {"a"});
  index(R"({"weight_map": {"a": "model-00001-of-00001.safetensors", "ghost": "model-00001-of-00001.safetensors"}})");
  expect_failure({"'ghost'", "no such tensor"});
}

TEST_F(ShardedDirTest, AShardHoldsATensorNotInTheIndex) {
  shard("model-00001-of-00001.safetensors", {"a", "stowaway"});
  index(R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})");
  expect_failure({"'stowaway'", "not in the weight_map", "model-00001-of-00001.safetensors"});
}

TEST_F(ShardedDirTest, AShardOfTheIndexsNamingIsNotListed) {
  shard("model-00001-of-00002.safetensors", {"a"});
  shard("model-00002-of-00002.safetensors", {"b"});
  shard("consolidated.safetensors", {"a", "b"});  // another file (Mistral's) is not the index's business
  index(R"({"weight_map": {"a": "model-00001-of-00002.safetensors"}})");
  expect_failure({"model.safetensors.index.json", "does not list shard model-00002-of-00002.safetensors"});
}

TEST_F(ShardedDirTest, EmptyWeightMap) {
  shard("model-00001-of-00001.safetensors", {"a"});
  index(R"({"metadata": {}, "weight_map": {}})");
  expect_failure({"model.safetensors.index.json", "lists no tensors"});
  fs::remove(dir_ / "model-00001-of-00001.safetensors");
  expect_failure({"model.safetensors.index.json", "lists no tensors"});
}

TEST_F(ShardedDirTest, SameTensorInTwoShards) {
  shard("model-00001-of-00002.safetensors", {"a", "twice"});
  shard("model-00002-of-00002.safetensors", {"twice"});
  index(R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "twice": "model-00002-of-00002.safetensors"}})");
  // Shard 1 is not named for "twice" but is opened for "a", so the duplicate is found either way.
  expect_failure({"'twice'", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"});
}

TEST_F(ShardedDirTest, InvalidIndexJson) {
  shard("model-00001-of-00001.safetensors", {"a"});
  index(R"({"weight_map": {"a": "model-00001-of-00001.safetensors",)");
  expect_failure({"model.safetensors.index.json", "not valid JSON"});
}

TEST_F(ShardedDirTest, IndexWithoutWeightMap) {
  shard("model-00001-of-00001.safetensors", {"a"});
  for (const char* text : {R"({"metadata": {}})", R"([1, 2])", R"({"weight_map": ["a"]})", R"("weight_map")"}) {
    SCOPED_TRACE(text);
    index(text);
    expect_failure({"model.safetensors.index.json", "'weight_map'"});
  }
}

TEST_F(ShardedDirTest, WeightMapValueNotAString) {
  shard("model-00001-of-00001.safetensors", {"a"});
  index(R"({"weight_map": {"a": 1}})");
  expect_failure({"weight_map['a']", "not a file name"});
}

TEST_F(ShardedDirTest, ShardNamesOutsideTheDirectoryAreRejected) {
  shard("model-00001-of-00001.safetensors", {"a"});
  fs::create_directory(dir_ / "sub");
  shard("sub/inner.safetensors", {"b"});
  for (const char* name : {"sub/inner.safetensors", "../model-00001-of-00001.safetensors", "..", ".", "", "/etc/passwd",
                           "./model-00001-of-00001.safetensors", R"(model-00001-of-00001.safetensors\u0000x)"}) {
    SCOPED_TRACE(name);
    index(std::string(R"({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": ")") + name + "\"}}");
    expect_failure({"weight_map['b']", "is not a file in the directory"});
  }
}

TEST_F(ShardedDirTest, MalformedShardIsNamed) {
  shard("model-00001-of-00002.safetensors", {"a"});
  write_file(dir_ / "model-00002-of-00002.safetensors", le64(4) + "{}");
  index(R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})");
  expect_failure({dir_ / "model-00002-of-00002.safetensors", "header"});
}

TEST_F(ShardedDirTest, ShardIsADirectory) {
  shard("model-00001-of-00002.safetensors", {"a"});
  fs::create_directory(dir_ / "model-00002-of-00002.safetensors");
  index(R"({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})");
  expect_failure({"model-00002-of-00002.safetensors"});
}

TEST_F(ShardedDirTest, SeveralFilesWithoutIndex) {
  shard("model-00001-of-00002.safetensors", {"a"});
  shard("model-00002-of-00002.safetensors", {"b"});
  expect_failure({"found 2 safetensors files and no index"});
}

TEST_F(ShardedDirTest, EmptyDirectory) { expect_failure({"found 0 safetensors files"}); }

TEST_F(ShardedDirTest, TwoIndexFiles) {
  shard("model-00001-of-00001.safetensors", {"a"});
  index(R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})");
  index(R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})", "other.safetensors.index.json");
  expect_failure({"several"});
}

TEST_F(ShardedDirTest, MissingPath) {
  auto ckpt = SafetensorsCheckpoint::open(dir_ / "nothing");
  ASSERT_FALSE(ckpt.ok());
  EXPECT_TRUE(contains(ckpt.status().message(), dir_ / "nothing")) << ckpt.status().message();
  EXPECT_TRUE(contains(ckpt.status().message(), "no such file")) << ckpt.status().message();
}

TEST_F(ShardedDirTest, SingleFileDirectoryOpensWithoutIndex) {
  shard("model.safetensors", {"x", "y"});
  auto ckpt = SafetensorsCheckpoint::open(dir_.str());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().message();
  EXPECT_TRUE(ckpt->index_path().empty());
  EXPECT_EQ(ckpt->names(), (std::vector<std::string>{"x", "y"}));
}

}  // namespace
}  // namespace trestle
