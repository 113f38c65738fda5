// preprocess on many threads: JSON lines parsed and bytes tokenized on 4 workers over many small batches give the
// same indexed datasets as one worker, and every document reads back as its text's bytes plus the EOD (the run
// scripts/sanitize repeats under TSan).
#include "train/data/preprocess.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "tests/support/status_matchers.h"
#include "train/data/indexed_dataset.h"

namespace trestle::data {
namespace {

namespace fs = std::filesystem;

class PreprocessTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("trestle_preprocess_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Documents of 0 to 300 printable characters (some with quotes and escapes), one JSON line each, with a "title"
  // key beside "text".
  std::vector<std::string> write_corpus(const fs::path& path, int documents) {
    std::mt19937 rng(5);
    std::uniform_int_distribution<int> length(0, 300), letter(32, 126);
    std::vector<std::string> texts;
    std::ofstream out(path);
    for (int d = 0; d < documents; ++d) {
      std::string text, escaped;
      for (int n = length(rng), i = 0; i < n; ++i) text += static_cast<char>(letter(rng));
      for (const char c : text) {
        if (c == '"' || c == '\\') escaped += '\\';
        escaped += c;
      }
      out << "{\"title\": \"doc " << d << "\", \"text\": \"" << escaped << "\"}\n";
      texts.push_back(text);
    }
    return texts;
  }

  static std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  fs::path dir_;
};

TEST_F(PreprocessTest, FourWorkersWriteWhatOneWorkerWrites) {
  const fs::path input = dir_ / "corpus.jsonl";
  const std::vector<std::string> texts = write_corpus(input, 2000);
  std::string written[2][2];  // [run][.bin, .idx]
  for (const int workers : {1, 4}) {
    PreprocessOptions options;
    options.input = input.string();
    options.output_prefix = (dir_ / ("w" + std::to_string(workers))).string();
    options.json_keys = {"text", "title"};
    options.append_eod = true;
    options.workers = workers;
    options.batch_bytes = 8192;  // about 50 batches
    options.progress = false;
    auto tokenizer = make_byte_tokenizer(workers);
    const auto report = preprocess(options, *tokenizer);
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_EQ(report->documents, texts.size());
    const std::string prefix = options.output_prefix + "_text_document";
    written[workers == 4][0] = read_file(bin_path(prefix));
    written[workers == 4][1] = read_file(idx_path(prefix));

    const auto dataset = IndexedDataset::open(prefix);
    ASSERT_TRUE(dataset.ok()) << dataset.status().message();
    ASSERT_EQ(dataset->document_count(), texts.size());
    std::size_t sequence = 0;
    for (std::size_t d = 0; d < texts.size(); ++d) {
      // An empty document gets no sequence and no EOD.
      if (texts[d].empty()) {
        EXPECT_EQ(dataset->document_index(d + 1) - dataset->document_index(d), 0) << "document " << d;
        continue;
      }
      std::vector<std::int64_t> tokens, expected(texts[d].begin(), texts[d].end());
      expected.push_back(256);
      ASSERT_TRUE(dataset->read(sequence++, 0, std::nullopt, tokens).ok());
      ASSERT_EQ(tokens, expected) << "document " << d << " with " << workers << " workers";
    }
  }
  EXPECT_EQ(written[0][0], written[1][0]);
  EXPECT_EQ(written[0][1], written[1][1]);
}

TEST_F(PreprocessTest, AnErrorOnAnyWorkerNamesTheLine) {
  const fs::path input = dir_ / "corpus.jsonl";
  write_corpus(input, 500);
  {
    std::ofstream out(input, std::ios::app);
    out << "{\"text\": \"fine\"}\n{\"text\": 7}\n";
  }
  PreprocessOptions options;
  options.input = input.string();
  options.output_prefix = (dir_ / "bad").string();
  options.workers = 4;
  options.batch_bytes = 4096;
  options.progress = false;
  auto tokenizer = make_byte_tokenizer(4);
  EXPECT_TRUE(fails_with(preprocess(options, *tokenizer), "corpus.jsonl:502: 'text' is neither a string"));
}

// Lines end at \n, \r\n or \r (Python's universal newlines); plain-text paragraphs at blank lines. Whatever the batch
// size, a batch never cuts a line ending or a paragraph: the documents and the line an error names stay the same.
TEST_F(PreprocessTest, BatchesNeverCutALineEndingOrAParagraph) {
  const std::string json_lines =
      "{\"text\": \"ab\"}\r\n{\"text\": \"c\"}\r{\"text\": \"\"}\n\r\n{\"text\": \"de\"}\r\r\n";
  const std::string text = "ab\r\ncd\r\n\r\nef\r \rgh\n\n\nij";
  for (std::size_t batch = 1; batch <= 48; ++batch) {
    for (const bool json : {true, false}) {
      PreprocessOptions options;
      options.batch_bytes = batch;
      options.format = json ? InputFormat::kJsonLines : InputFormat::kText;
      const std::string& input = json ? json_lines : text;
      const fs::path path = dir_ / (json ? "in.jsonl" : "in.txt");
      std::ofstream(path, std::ios::binary) << input;
      options.input = path.string();
      options.output_prefix = (dir_ / ("b" + std::to_string(batch) + (json ? "j" : "t"))).string();
      options.progress = false;
      auto tokenizer = make_byte_tokenizer(1);
      const auto report = preprocess(options, *tokenizer);
      ASSERT_TRUE(report.ok()) << report.status().message();
      const auto dataset = IndexedDataset::open(options.output_prefix + "_text_document");
      ASSERT_TRUE(dataset.ok()) << dataset.status().message();
      std::vector<std::string> got;
      for (std::size_t d = 0; d < dataset->document_count(); ++d) {
        std::string doc;
        for (auto s = dataset->document_index(d); s < dataset->document_index(d + 1); ++s) {
          std::vector<std::int64_t> tokens;
          ASSERT_TRUE(dataset->read(static_cast<std::size_t>(s), 0, std::nullopt, tokens).ok());
          for (const auto t : tokens) doc += static_cast<char>(t);
        }
        got.push_back(doc);
      }
      const std::vector<std::string> expected =
          json ? std::vector<std::string>{"ab", "c", "", "de"} : std::vector<std::string>{"ab\r\ncd", "ef", "gh", "ij"};
      EXPECT_EQ(got, expected) << "batches of " << batch << " bytes, " << (json ? "JSON lines" : "text");
    }
    // The bad line is the file's 7th, counting \r\n, \r and \n endings and the blank lines.
    const fs::path bad = dir_ / "bad.jsonl";
    std::ofstream(bad, std::ios::binary) << json_lines << "{\"text\": 7}\n";
    PreprocessOptions options;
    options.input = bad.string();
    options.output_prefix = (dir_ / "bad").string();
    options.batch_bytes = batch;
    options.progress = false;
    auto tokenizer = make_byte_tokenizer(1);
    EXPECT_TRUE(fails_with(preprocess(options, *tokenizer), "bad.jsonl:7: 'text' is neither a string"))
        << "batches of " << batch << " bytes";
  }
}

}  // namespace
}  // namespace trestle::data
