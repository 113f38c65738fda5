// Text -> token ids for preprocessing: a Hugging Face tokenizer.json (byte-level BPE natively, anything else through
// the `tokenizers` library) or raw UTF-8 bytes. encode_batch may be called from one thread at a time; it
// parallelizes inside.
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
  virtual std::string engine() const = 0;  // what runs it, in words
};

// One id per UTF-8 byte (0-255), EOD 256, vocabulary 257; needs no file.
std::unique_ptr<Tokenizer> make_byte_tokenizer(int workers);

// What runs a tokenizer.json. kAuto: Trestle's own byte-level BPE (byte_level_bpe.h) when the file is one it runs,
// else the `tokenizers` package; kNative: only Trestle's (an error says why a file is not one it runs); kPackage:
// only the package. Both give the package's ids.
enum class TokenizerEngine { kAuto, kNative, kPackage };

// A Hugging Face tokenizer.json (a file or a directory holding one), run on `workers` threads; the package runs in
// the embedded Python of the project's venv. The EOD token is eod_token when given, else tokenizer_config.json's
// eos_token beside it, else the first of <|endoftext|>, </s>, <|end_of_text|>, <eos> it knows.
Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path, int workers,
                                                     const std::string& eod_token = "",
                                                     TokenizerEngine engine = TokenizerEngine::kAuto);

}  // namespace trestle::data
