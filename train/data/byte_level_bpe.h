// Hugging Face byte-level BPE tokenizers run natively: the kind GPT-2, RoBERTa, GPT-NeoX and StarCoder ship, a
// tokenizer.json with no normalizer, the ByteLevel pre-tokenizer on GPT-2's pattern, a BPE model without dropout or
// subword affixes, whole-match added tokens and a template (or none) around each text. Ids equal the `tokenizers`
// package's encode() of the same file; a file that uses anything else is declined with the reason, never
// approximated, so the caller can run it through the package instead.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "train/data/tokenizer.h"

namespace trestle::data {

class ByteLevelBpeTokenizer final : public Tokenizer {
 public:
  // Reads tokenizer.json at `file`; nullptr with `declined` saying why when the file is not one this runs (including
  // a file the package itself would refuse).
  static std::unique_ptr<ByteLevelBpeTokenizer> load(const std::string& file, int workers, std::string& declined);
  // The same from the file's text; `name` is what name() says.
  static std::unique_ptr<ByteLevelBpeTokenizer> parse(std::string_view text, std::string name, int workers,
                                                      std::string& declined);
  ~ByteLevelBpeTokenizer() override;

  // The id of a token as the package's token_to_id gives it: the added tokens first, then the vocabulary.
  std::optional<std::int64_t> token_to_id(const std::string& token) const;
  void set_eod(std::optional<std::int64_t> eod) { eod_ = eod; }

  // Splits the batch over the workers; every text must be valid UTF-8 (an error names the first that is not).
  Result<std::vector<std::vector<std::int64_t>>> encode_batch(const std::vector<std::string_view>& texts) override;
  std::vector<std::int64_t> encode(std::string_view text, int worker = 0);  // one valid UTF-8 text
  std::int64_t vocab_size() const override;
  std::optional<std::int64_t> eod() const override { return eod_; }
  std::string name() const override { return path_; }
  std::string engine() const override { return "Trestle's byte-level BPE"; }

  struct Model;  // the file's tables (byte_level_bpe.cc)

 private:
  ByteLevelBpeTokenizer(std::string path, std::unique_ptr<Model> model, int workers);

  std::string path_;
  std::unique_ptr<Model> model_;
  std::optional<std::int64_t> eod_;
  struct WordCache;
  std::vector<std::unique_ptr<WordCache>> caches_;  // one per worker: encode_batch runs on one thread at a time
};

}  // namespace trestle::data
