// Text -> token ids for preprocessing: a Hugging Face tokenizer.json (through the `tokenizers` library) or raw
// UTF-8 bytes. encode_batch may be called from one thread at a time; it parallelizes inside.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/status.h"

namespace trestle::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The ids of each text, with the tokenizer's own special tokens (BOS, ...) as Megatron's tokenize() adds them.
  virtual Result<std::vector<std::vector<std::int64_t>>> encode_batch(const std::vector<std::string_view>& texts) = 0;
  virtual std::int64_t vocab_size() const = 0;          // ids are below this
  virtual std::optional<std::int64_t> eod() const = 0;  // the end-of-document id --append-eod adds
  virtual std::string name() const = 0;
};

// One id per UTF-8 byte (0-255), EOD 256, vocabulary 257; needs no file.
std::unique_ptr<Tokenizer> make_byte_tokenizer(int workers);

// A Hugging Face tokenizer.json (a file or a directory holding one) run by the `tokenizers` package in the
// embedded Python of the project's venv, on `workers` threads. The EOD token is tokenizer_config.json's eos_token
// beside it, else eod_token when given, else the first of <|endoftext|>, </s>, <|end_of_text|>, <eos> it knows.
Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path, int workers,
                                                     const std::string& eod_token = "");

}  // namespace trestle::data
