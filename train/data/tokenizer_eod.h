// The end-of-document token id Megatron-LM's tokenizer of a type gives (its `eod`), read from the tokenizer's files
// without running it: HuggingFaceTokenizer (a directory holding tokenizer.json, or the file: the eos_token of
// special_tokens_map.json, else of tokenizer_config.json, as transformers' AutoTokenizer takes it, looked up in
// tokenizer.json's added tokens and vocabulary),
// GPT2BPETokenizer (--vocab-file's "<|endoftext|>") and NullTokenizer (--vocab-size V: V). Errors name the file and
// what it lacks, or the type that has no such files here.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "ckpt/status.h"

namespace trestle::data {

struct TokenizerFiles {
  std::string type;                        // Megatron's --tokenizer-type
  std::string model;                       // --tokenizer-model
  std::string vocab_file;                  // --vocab-file
  std::optional<std::int64_t> vocab_size;  // --vocab-size
};

Result<std::int64_t> tokenizer_eod_id(const TokenizerFiles& tokenizer);

// A tokenizer_config.json's (or special_tokens_map.json's) eos_token: a string or an AddedToken's {"content": ...};
// none when it holds none.
std::optional<std::string> eos_token_of(const nlohmann::json& config);

// The eos_token a tokenizer directory configures, as transformers' AutoTokenizer takes it (special_tokens_map.json's
// overrides tokenizer_config.json's), with the file that gives it; none when neither does. An unreadable file is an
// error naming it.
struct ConfiguredToken {
  std::string token;
  std::string file;
};
Result<std::optional<ConfiguredToken>> configured_eos_token(const std::string& dir);

}  // namespace trestle::data
