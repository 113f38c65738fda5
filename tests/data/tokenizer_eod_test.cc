// tokenizer_eod_id: Megatron's tokenizer's end of document from its files, and what it says when they lack one.
#include "train/data/tokenizer_eod.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "tests/support/status_matchers.h"

namespace trestle::data {
namespace {

namespace fs = std::filesystem;

class TokenizerEodTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("trestle_eod_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  fs::path dir_;
};

TEST_F(TokenizerEodTest, HuggingFaceEosTokenFromAddedTokensOrVocabulary) {
  write("tokenizer.json",
        R"({"added_tokens": [{"id": 7, "content": "</s>"}], "model": {"vocab": {"a": 0, "<e>": 5}}})");
  write("tokenizer_config.json", R"({"eos_token": {"content": "</s>", "special": true}})");
  TokenizerFiles t{"HuggingFaceTokenizer", dir_.string(), "", std::nullopt};
  ASSERT_TRUE(tokenizer_eod_id(t).ok());
  EXPECT_EQ(*tokenizer_eod_id(t), 7);
  write("tokenizer_config.json", R"({"eos_token": "<e>"})");
  t.model = (dir_ / "tokenizer.json").string();
  EXPECT_EQ(*tokenizer_eod_id(t), 5);
  // Unigram's vocabulary: [piece, score] pairs, the index the id.
  write("tokenizer.json", R"({"model": {"vocab": [["<unk>", 0.0], ["<e>", 0.0]]}})");
  EXPECT_EQ(*tokenizer_eod_id(t), 1);
  write("tokenizer_config.json", R"({"eos_token": "<nope>"})");
  EXPECT_TRUE(fails_with(tokenizer_eod_id(t), "the eos_token '<nope>' " + (dir_ / "tokenizer_config.json").string() +
                                                  " names is not in its vocabulary"));
  // special_tokens_map.json's overrides tokenizer_config.json's, as transformers' AutoTokenizer reads them.
  write("special_tokens_map.json", R"({"eos_token": "<e>"})");
  EXPECT_EQ(*tokenizer_eod_id(t), 1);
  fs::remove(dir_ / "tokenizer_config.json");
  EXPECT_EQ(*tokenizer_eod_id(t), 1);
  fs::remove(dir_ / "special_tokens_map.json");
  EXPECT_TRUE(fails_with(tokenizer_eod_id(t), "no eos_token"));
  t.model = (dir_ / "missing").string();
  EXPECT_TRUE(fails_with(tokenizer_eod_id(t), "no tokenizer.json"));
}

TEST_F(TokenizerEodTest, NullAndGpt2AndOthers) {
  EXPECT_EQ(*tokenizer_eod_id({"NullTokenizer", "", "", 4095}), 4095);
  EXPECT_TRUE(fails_with(tokenizer_eod_id({"NullTokenizer", "", "", std::nullopt}), "needs --vocab-size"));
  write("vocab.json", R"({"!": 0, "<|endoftext|>": 50256})");
  EXPECT_EQ(*tokenizer_eod_id({"GPT2BPETokenizer", "", (dir_ / "vocab.json").string(), std::nullopt}), 50256);
  EXPECT_TRUE(
      fails_with(tokenizer_eod_id({"SentencePieceTokenizer", "m.model", "", std::nullopt}), "give --eod-token-id"));
}

}  // namespace
}  // namespace trestle::data
