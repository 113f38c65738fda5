#include "train/data/tokenizer_eod.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "ckpt/json_file.h"

namespace trestle::data {
namespace {

namespace fs = std::filesystem;

// The token's id in a tokenizer.json: its added tokens first (where the special tokens are), then the model's
// vocabulary (an object of token -> id, or Unigram's list of [piece, score] whose index is the id).
std::optional<std::int64_t> token_id(const nlohmann::json& tokenizer, const std::string& token) {
  if (tokenizer.contains("added_tokens") && tokenizer["added_tokens"].is_array())
    for (const auto& added : tokenizer["added_tokens"])
      if (added.is_object() && added.value("content", nlohmann::json()) == token && added.contains("id") &&
          added["id"].is_number_integer())
        return added["id"].get<std::int64_t>();
  if (!tokenizer.contains("model") || !tokenizer["model"].is_object() || !tokenizer["model"].contains("vocab"))
    return std::nullopt;
  const auto& vocab = tokenizer["model"]["vocab"];
  if (vocab.is_object()) {
    const auto it = vocab.find(token);
    if (it != vocab.end() && it->is_number_integer()) return it->get<std::int64_t>();
  } else if (vocab.is_array()) {
    for (std::size_t i = 0; i < vocab.size(); ++i)
      if (vocab[i].is_array() && !vocab[i].empty() && vocab[i][0] == token) return static_cast<std::int64_t>(i);
  }
  return std::nullopt;
}

Result<std::int64_t> hugging_face_eod(const std::string& model) {
  if (model.empty()) return Status::Error("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model");
  std::error_code ec;
  const bool directory = fs::is_directory(model, ec);
  const fs::path dir = directory ? fs::path(model) : fs::path(model).parent_path();
  const fs::path file = directory ? dir / "tokenizer.json" : fs::path(model);
  if (!fs::exists(file, ec))
    return Status::Error(model + ": no tokenizer.json (a hub model's name is not fetched here: give its directory)");
  TRESTLE_ASSIGN_OR_RETURN(const auto eos, configured_eos_token(dir.string()));
  if (!eos)
    return Status::Error(dir.string() +
                         ": no eos_token in special_tokens_map.json or tokenizer_config.json, so the tokenizer has no "
                         "end-of-document token (give --eod-token-id)");
  TRESTLE_ASSIGN_OR_RETURN(const auto tokenizer, read_json_file(file.string()));
  const auto id = token_id(tokenizer, eos->token);
  if (!id || *id < 0)
    return Status::Error(file.string() + ": the eos_token '" + eos->token + "' " + eos->file +
                         " names is not in its vocabulary");
  return *id;
}

}  // namespace

std::optional<std::string> eos_token_of(const nlohmann::json& config) {
  if (!config.is_object() || !config.contains("eos_token")) return std::nullopt;
  const auto& eos = config["eos_token"];
  if (eos.is_string()) return eos.get<std::string>();
  if (eos.is_object() && eos.contains("content") && eos["content"].is_string())
    return eos["content"].get<std::string>();
  return std::nullopt;
}

Result<std::optional<ConfiguredToken>> configured_eos_token(const std::string& dir) {
  for (const char* name : {"special_tokens_map.json", "tokenizer_config.json"}) {
    const fs::path path = fs::path(dir) / name;
    std::error_code ec;
    if (!fs::exists(path, ec)) continue;
    TRESTLE_ASSIGN_OR_RETURN(const auto config, read_json_file(path.string()));
    if (auto eos = eos_token_of(config)) return std::optional<ConfiguredToken>(ConfiguredToken{*eos, path.string()});
  }
  return std::optional<ConfiguredToken>();
}

Result<std::int64_t> tokenizer_eod_id(const TokenizerFiles& t) {
  if (t.type == "HuggingFaceTokenizer") return hugging_face_eod(t.model);
  if (t.type == "NullTokenizer") {
    if (!t.vocab_size || *t.vocab_size < 1) return Status::Error("--tokenizer-type NullTokenizer needs --vocab-size");
    return *t.vocab_size;  // Megatron's NullTokenizer: ids 0 .. V - 1 and its end of document, V
  }
  if (t.type == "GPT2BPETokenizer") {
    if (t.vocab_file.empty()) return Status::Error("--tokenizer-type GPT2BPETokenizer needs --vocab-file");
    TRESTLE_ASSIGN_OR_RETURN(const auto vocab, read_json_file(t.vocab_file));
    if (!vocab.is_object() || !vocab.contains("<|endoftext|>") || !vocab["<|endoftext|>"].is_number_integer())
      return Status::Error(t.vocab_file + ": no '<|endoftext|>' id (GPT-2's end of document)");
    return vocab["<|endoftext|>"].get<std::int64_t>();
  }
  return Status::Error("--tokenizer-type " + t.type +
                       ": Trestle reads the end-of-document token from HuggingFaceTokenizer, GPT2BPETokenizer and "
                       "NullTokenizer files only; give --eod-token-id");
}

}  // namespace trestle::data
