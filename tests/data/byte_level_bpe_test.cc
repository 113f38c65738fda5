// Trestle's byte-level BPE (byte_level_bpe.h) against the tokenizers package, both run here through
// load_hf_tokenizer's two engines: the demo corpus's GPT-2-style tokenizer and variants of it give equal ids,
// vocabulary sizes and EOD tokens for texts of every kind of character; files it does not run are declined.
#include "train/data/byte_level_bpe.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "tests/support/status_matchers.h"
#include "train/data/gpt2_pretokenizer.h"
#include "train/data/tokenizer.h"

#ifndef TRESTLE_DATA_CORPUS_DIR
#error "TRESTLE_DATA_CORPUS_DIR (train/data/corpus) must be defined by the build"
#endif

namespace trestle::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string utf8(char32_t c) {
  std::string out;
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
  return out;
}

// Texts made of the pieces where pre-tokenizers differ: every kind of space, letters and numbers of many scripts
// and Unicode versions, marks, symbols, contractions, added-token look-alikes, runs of each.
std::vector<std::string> hostile_texts(int count, unsigned seed) {
  const std::vector<std::string> pieces = {"a",       "Z",
                                           "the",     "Lord",
                                           " ",       "  ",
                                           "   ",     "\t",
                                           "\n",      "\r\n",
                                           "\v",      "\f",
                                           "0",       "42",
                                           "2024",    "'s",
                                           "'t",      "'re",
                                           "'ve",     "'m",
                                           "'ll",     "'d",
                                           "'S",      "'",
                                           "''",      "!",
                                           "?!",      ".",
                                           ",",       "-",
                                           "_",       "(",
                                           "\"",      "<|endoftext|>",
                                           "<|endof", "endoftext|>",
                                           "<s>",     "</s>",
                                           "<",       "|",
                                           "\x01",    "\x1c",
                                           "\x7f",    "Lordship",
                                           "thee", "lll", "llll", "ooo", "sss", "eee", "...", "!!!", "ttt", "1111"};
  const std::vector<char32_t> code_points = {
      0x85,    0xA0,    0x1680, 0x2000, 0x200A,  0x2028,  0x2029,  0x202F, 0x205F, 0x3000,  0x180E,
      0x200B,  0xFEFF,  0xE9,   0xDF,   0x3A9,   0x416,   0x5D0,   0x639,  0x4E2D, 0x2EBF0, 0x31350,
      0x1E900, 0xB2,    0x660,  0x2160, 0x1D7CE, 0x1F600, 0x1F1FA, 0x301,  0x94D,  0xE000,  0x10FFFF,
      0x378,   0xE0001, 0x2E80, 0xFF21, 0x1F3FB, 0xAA,    0xBA,    0x2070, 0x16EE};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> length(0, 40), kind(0, 2);
  std::vector<std::string> texts;
  for (int t = 0; t < count; ++t) {
    std::string text;
    for (int n = length(rng); n > 0; --n) {
      if (kind(rng) == 0) text += utf8(code_points[rng() % code_points.size()]);
      else text += pieces[rng() % pieces.size()];
    }
    texts.push_back(std::move(text));
  }
  return texts;
}

std::vector<std::string> corpus_texts(int count) {
  std::ifstream in(fs::path(TRESTLE_DATA_CORPUS_DIR) / "kjv.jsonl");
  std::vector<std::string> texts;
  for (std::string line; texts.size() < static_cast<std::size_t>(count) && std::getline(in, line);)
    texts.push_back(json::parse(line)["text"].get<std::string>());
  return texts;
}

std::vector<std::string_view> views(const std::vector<std::string>& texts) { return {texts.begin(), texts.end()}; }

class ByteLevelBpeTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("trestle_byte_level_bpe_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()));
    fs::create_directories(dir_);
    std::ifstream in(fs::path(TRESTLE_DATA_CORPUS_DIR) / "tokenizer.json");
    demo_ = json::parse(in);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes `file` as NAME/tokenizer.json and returns its directory.
  fs::path write(const std::string& name, const json& file) {
    const fs::path path = dir_ / name;
    fs::create_directories(path);
    std::ofstream(path / "tokenizer.json") << file.dump();
    return path;
  }

  // Both engines on `texts`: equal ids, vocabulary size and EOD, and the native engine really ran.
  void expect_engines_agree(const fs::path& path, const std::vector<std::string>& texts, int workers = 1) {
    auto native = load_hf_tokenizer(path.string(), workers, "", TokenizerEngine::kNative);
    ASSERT_TRUE(native.ok()) << native.status().message();
    auto package = load_hf_tokenizer(path.string(), 1, "", TokenizerEngine::kPackage);
    ASSERT_TRUE(package.ok()) << package.status().message();
    EXPECT_EQ((*native)->engine(), "Trestle's byte-level BPE");
    EXPECT_EQ((*native)->vocab_size(), (*package)->vocab_size());
    EXPECT_EQ((*native)->eod(), (*package)->eod());
    auto native_ids = (*native)->encode_batch(views(texts));
    auto package_ids = (*package)->encode_batch(views(texts));
    ASSERT_TRUE(native_ids.ok()) << native_ids.status().message();
    ASSERT_TRUE(package_ids.ok()) << package_ids.status().message();
    ASSERT_EQ(native_ids->size(), texts.size());
    ASSERT_EQ(package_ids->size(), texts.size());
    int shown = 0;
    for (std::size_t i = 0; i < texts.size(); ++i) {
      if ((*native_ids)[i] != (*package_ids)[i] && shown++ < 5)
        ADD_FAILURE() << path << ": text " << i << " '" << texts[i] << "': ids differ";
    }
    EXPECT_EQ(shown, 0) << "texts whose ids differ";
  }

  std::vector<std::string> all_texts() {
    auto texts = corpus_texts(400);
    for (auto& t : hostile_texts(3000, 7)) texts.push_back(std::move(t));
    texts.push_back("");
    texts.push_back(std::string(5000, 'a') + std::string(3000, ' ') + "b");  // a long word and a long space run
    return texts;
  }

  fs::path dir_;
  json demo_;
};

TEST_F(ByteLevelBpeTest, DemoTokenizerMatchesThePackage) { expect_engines_agree(write("demo", demo_), all_texts()); }

TEST_F(ByteLevelBpeTest, PrefixSpaceMatchesThePackage) {
  json file = demo_;
  file["pre_tokenizer"]["add_prefix_space"] = true;
  expect_engines_agree(write("prefix", file), all_texts());
}

TEST_F(ByteLevelBpeTest, IgnoreMergesAndStringMergesMatchThePackage) {
  json file = demo_;
  file["model"]["ignore_merges"] = true;
  json merges = json::array();
  for (const auto& m : file["model"]["merges"])
    merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  file["model"]["merges"] = merges;
  expect_engines_agree(write("ignore_merges", file), all_texts());
}

// Added tokens split in the package's two passes (normalized: false first, then the others), leftmost-longest,
// with a BOS template around each text.
TEST_F(ByteLevelBpeTest, AddedTokensAndTemplateMatchThePackage) {
  json file = demo_;
  const std::int64_t next = static_cast<std::int64_t>(file["model"]["vocab"].size());
  auto added = [&](const std::string& content, std::int64_t id, bool special) {
    file["added_tokens"].push_back({{"id", id},
                                    {"content", content},
                                    {"single_word", false},
                                    {"lstrip", false},
                                    {"rstrip", false},
                                    {"normalized", !special},
                                    {"special", special}});
  };
  // The ids in the file are not the ones the package gives (it numbers them on from the vocabulary, in order).
  added("<s>", next + 7, true);
  added("Lordship", next + 1, false);
  added("Lord", next + 2, false);
  added("<|endof", next + 30, true);
  added("ship", next, true);
  file["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair", json::array()},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {next}}, {"tokens", {"<s>"}}}}}}};
  expect_engines_agree(write("added", file), all_texts());
}

TEST_F(ByteLevelBpeTest, RobertaProcessingAndAMissingByteMatchThePackage) {
  json file = demo_;
  file["post_processor"] = {{"type", "RobertaProcessing"},
                            {"sep", {"<|endoftext|>", 0}},
                            {"cls", {"<|endoftext|>", 0}},
                            {"trim_offsets", true},
                            {"add_prefix_space", false}};
  file["model"]["vocab"].erase("\xc4\x80");  // byte 0's token (U+0100); no merge uses it
  expect_engines_agree(write("roberta", file), all_texts());
}

// Without the package (scripts/sanitize runs this under TSan): four workers give one worker's ids.
TEST_F(ByteLevelBpeTest, WorkersGiveTheSameIds) {
  const auto path = write("demo", demo_) / "tokenizer.json";
  std::string declined;
  auto one = ByteLevelBpeTokenizer::load(path.string(), 1, declined);
  auto four = ByteLevelBpeTokenizer::load(path.string(), 4, declined);
  ASSERT_TRUE(one && four) << declined;
  const auto texts = all_texts();
  auto a = one->encode_batch(views(texts));
  auto b = four->encode_batch(views(texts));
  ASSERT_TRUE(a.ok()) << a.status().message();
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ(*a, *b);
  for (std::size_t i = 0; i < texts.size(); ++i) ASSERT_EQ((*a)[i], one->encode(texts[i])) << i;
}

TEST_F(ByteLevelBpeTest, InvalidUtf8IsRefusedAsPythonRefusesIt) {
  for (const std::string bad :
       {"\xed\xa0\x80", "\xc0\xaf", "\xf4\x90\x80\x80", "ok\xff", "\xe2\x82", "\xf5\x80\x80\x80"})
    EXPECT_NE(invalid_utf8_at(bad), std::string_view::npos) << bad;
  for (const std::string good : {"", "\xed\x9f\xbf", "\xf4\x8f\xbf\xbf", "\xc2\x80", "\xe0\xa0\x80"})
    EXPECT_EQ(invalid_utf8_at(good), std::string_view::npos) << good;
  const auto path = write("demo", demo_);
  for (const auto engine : {TokenizerEngine::kNative, TokenizerEngine::kPackage}) {
    auto tokenizer = load_hf_tokenizer(path.string(), 1, "", engine);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().message();
    const std::vector<std::string> texts = {"fine", "caf\xc3", "x"};
    auto ids = (*tokenizer)->encode_batch(views(texts));
    EXPECT_TRUE(fails_with(ids, "text 1 of the batch is not valid UTF-8"));
  }
}

// Files it does not run natively are declined with the reason, and the automatic choice hands them to the package.
TEST_F(ByteLevelBpeTest, OtherTokenizersAreDeclinedAndRunByThePackage) {
  json nfc = demo_;
  nfc["normalizer"] = {{"type", "NFC"}};
  json split = demo_;
  split["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "\\p{N}{1,3}"}}}, {"behavior", "Isolated"}, {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
  json dropout = demo_;
  dropout["model"]["dropout"] = 0.1;
  for (const auto& [name, file, reason] :
       std::vector<std::tuple<std::string, json, std::string>>{{"nfc", nfc, "normalizer NFC"},
                                                               {"split", split, "pre_tokenizer Sequence"},
                                                               {"dropout", dropout, "dropout"}}) {
    const auto path = write(name, file);
    auto native = load_hf_tokenizer(path.string(), 1, "", TokenizerEngine::kNative);
    EXPECT_TRUE(fails_with(native, "not a tokenizer Trestle runs itself")) << name;
    EXPECT_TRUE(fails_with(native, reason)) << name;
    if (name == "dropout") continue;  // the package runs it with random merges; nothing to compare
    auto automatic = load_hf_tokenizer(path.string(), 1);
    ASSERT_TRUE(automatic.ok()) << automatic.status().message();
    EXPECT_EQ((*automatic)->engine(),
              "the tokenizers package (Trestle's byte-level BPE declined it: " + reason +
                  (name == "split" ? " (only ByteLevel on GPT-2's pattern runs natively))" : ")"))
        << name;
  }
}

TEST_F(ByteLevelBpeTest, UnicodeClassesAreTheGpt2PatternsOnes) {
  EXPECT_EQ(char_class(U'a'), CharClass::kLetter);
  EXPECT_EQ(char_class(0x2EBF0), CharClass::kLetter);  // CJK Extension I (Unicode 15.1)
  EXPECT_EQ(char_class(U'7'), CharClass::kNumber);
  EXPECT_EQ(char_class(0xB2), CharClass::kNumber);
  EXPECT_EQ(char_class(U' '), CharClass::kSpace);
  EXPECT_EQ(char_class(0x85), CharClass::kSpace);
  EXPECT_EQ(char_class(0x1C), CharClass::kOther);  // Python's isspace() says space; the pattern's \s does not
  EXPECT_EQ(char_class(0x200B), CharClass::kOther);
  std::vector<std::string_view> pieces;
  split_gpt2_pieces("Hello world's  3 apples!!\n\n x", pieces);
  EXPECT_EQ(pieces, (std::vector<std::string_view>{"Hello", " world", "'s", " ", " 3", " apples", "!!", "\n\n", " x"}));
}

}  // namespace
}  // namespace trestle::data
