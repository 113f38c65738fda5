#include "train/data/byte_level_bpe.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "train/data/gpt2_pretokenizer.h"

namespace trestle::data {
namespace {

using nlohmann::json;

// GPT-2's byte -> character table (bytes_to_unicode): printable Latin-1 bytes stand for themselves, the rest for
// U+0100 onwards in byte order. Vocabulary entries are strings of these characters.
const std::array<std::string, 256> kByteChars = [] {
  std::array<char32_t, 256> code{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    code[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  std::array<std::string, 256> out;
  for (std::size_t b = 0; b < 256; ++b) {
    const char32_t c = code[b];
    if (c < 0x80) {
      out[b] = std::string(1, static_cast<char>(c));
    } else {  // all below U+0800: two bytes
      out[b] = {static_cast<char>(0xC0 | (c >> 6)), static_cast<char>(0x80 | (c & 0x3F))};
    }
  }
  return out;
}();

std::string byte_level_string(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char b : bytes) out += kByteChars[static_cast<unsigned char>(b)];
  return out;
}

// A field that must be absent, null or `value` (the package's default behaviour) for this reader to run the file.
bool absent_or(const json& object, const char* key, const json& value) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() || *it == value;
}

bool is_bool(const json& object, const char* key) { return object.contains(key) && object[key].is_boolean(); }

struct Merge {
  std::uint32_t rank;
  std::int32_t id;
};

std::uint64_t pair_key(std::int32_t left, std::int32_t right) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) | static_cast<std::uint32_t>(right);
}

struct AddedToken {
  std::string content;
  std::int64_t id;
};

// Added tokens matched whole, leftmost-longest, as the package's aho-corasick does: candidates by first byte,
// longest first.
class AddedTokenMatcher {
 public:
  void add(AddedToken token) { tokens_.push_back(std::move(token)); }
  void finish() {
    std::stable_sort(tokens_.begin(), tokens_.end(),
                     [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
    for (std::size_t i = 0; i < tokens_.size(); ++i)
      by_first_byte_[static_cast<unsigned char>(tokens_[i].content[0])].push_back(i);
  }
  bool empty() const { return tokens_.empty(); }
  // The longest token at text[at], or nullptr.
  const AddedToken* match(std::string_view text, std::size_t at) const {
    for (const std::size_t i : by_first_byte_[static_cast<unsigned char>(text[at])])
      if (text.compare(at, tokens_[i].content.size(), tokens_[i].content) == 0) return &tokens_[i];
    return nullptr;
  }

 private:
  std::vector<AddedToken> tokens_;
  std::array<std::vector<std::size_t>, 256> by_first_byte_;
};

// A stretch of text: an added token's id, or text still to be pre-tokenized (id -1).
struct Segment {
  std::string_view text;
  std::int64_t id;
};

void split_on(const AddedTokenMatcher& matcher, std::string_view text, std::vector<Segment>& out) {
  if (matcher.empty()) {
    out.push_back({text, -1});
    return;
  }
  std::size_t start = 0;
  for (std::size_t at = 0; at < text.size();) {
    if (const AddedToken* token = matcher.match(text, at)) {
      if (at > start) out.push_back({text.substr(start, at - start), -1});
      out.push_back({text.substr(at, token->content.size()), token->id});
      at += token->content.size();
      start = at;
    } else {
      ++at;
    }
  }
  if (start < text.size()) out.push_back({text.substr(start), -1});
}

// The ids a post-processor puts before and after each text; nullopt when it is not one this reads.
struct Template {
  std::vector<std::int64_t> before, after;
};

std::optional<Template> read_template(const json& processor, std::string& declined) {
  Template out;
  if (processor.is_null()) return out;
  const std::string type = processor.value("type", "");
  if (type == "ByteLevel") return out;  // offsets only
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    const auto& cls = processor.value("cls", json());
    const auto& sep = processor.value("sep", json());
    if (!(cls.is_array() && cls.size() == 2 && cls[1].is_number_unsigned() && sep.is_array() && sep.size() == 2 &&
          sep[1].is_number_unsigned())) {
      declined = "post_processor " + type + " without cls and sep";
      return std::nullopt;
    }
    out.before.push_back(cls[1].get<std::int64_t>());
    out.after.push_back(sep[1].get<std::int64_t>());
    return out;
  }
  if (type == "TemplateProcessing") {
    const auto& single = processor.value("single", json());
    const auto& specials = processor.value("special_tokens", json());
    if (!single.is_array() || !specials.is_object()) {
      declined = "post_processor TemplateProcessing without single or special_tokens";
      return std::nullopt;
    }
    bool seen_text = false;
    for (const auto& piece : single) {
      if (piece.is_object() && piece.contains("Sequence") && piece["Sequence"].value("id", "") == "A" && !seen_text) {
        seen_text = true;
        continue;
      }
      const json* special = piece.is_object() && piece.contains("SpecialToken") ? &piece["SpecialToken"] : nullptr;
      const std::string name = special && special->contains("id") && (*special)["id"].is_string()
                                   ? (*special)["id"].get<std::string>()
                                   : std::string();
      const auto it = specials.find(name);
      if (!special || it == specials.end() || !it->is_object() || !it->contains("ids") || !(*it)["ids"].is_array()) {
        declined = "post_processor TemplateProcessing piece " + piece.dump() + " this does not read";
        return std::nullopt;
      }
      for (const auto& id : (*it)["ids"]) {
        if (!id.is_number_unsigned()) {
          declined = "post_processor TemplateProcessing special token '" + name + "' with an id that is not a number";
          return std::nullopt;
        }
        (seen_text ? out.after : out.before).push_back(id.get<std::int64_t>());
      }
    }
    if (!seen_text) {
      declined = "post_processor TemplateProcessing without the text ($A)";
      return std::nullopt;
    }
    return out;
  }
  if (type == "Sequence" && processor.contains("processors") && processor["processors"].is_array()) {
    std::optional<Template> adds;
    for (const auto& each : processor["processors"]) {
      auto one = read_template(each, declined);
      if (!one) return std::nullopt;
      if (one->before.empty() && one->after.empty()) continue;
      if (adds) {
        declined = "post_processor Sequence with more than one processor adding tokens";
        return std::nullopt;
      }
      adds = std::move(one);
    }
    return adds ? *adds : out;
  }
  declined = "post_processor " + (type.empty() ? processor.dump() : type);
  return std::nullopt;
}

// Whether the pre-tokenizer is ByteLevel on GPT-2's pattern; sets add_prefix_space.
bool read_pre_tokenizer(const json& pre, bool& add_prefix_space, std::string& declined) {
  const json* byte_level = &pre;
  if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
      pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 1)
    byte_level = &pre["pretokenizers"][0];
  if (!byte_level->is_object() || byte_level->value("type", "") != "ByteLevel") {
    declined = "pre_tokenizer " + (pre.is_object() ? pre.value("type", pre.dump()) : pre.dump()) +
               " (only ByteLevel on GPT-2's pattern runs natively)";
    return false;
  }
  if (!is_bool(*byte_level, "add_prefix_space") || !is_bool(*byte_level, "use_regex") ||
      !(*byte_level)["use_regex"].get<bool>()) {
    declined = "pre_tokenizer ByteLevel without use_regex true and add_prefix_space";
    return false;
  }
  add_prefix_space = (*byte_level)["add_prefix_space"].get<bool>();
  return true;
}

}  // namespace

struct ByteLevelBpeTokenizer::Model {
  std::unordered_map<std::string, std::int32_t> vocab;  // the file's strings (byte-level characters) -> id
  std::array<std::int32_t, 256> byte_ids;               // each byte's one-character token, -1 when it has none
  std::unordered_map<std::uint64_t, Merge> merges;      // (left id, right id) -> rank and merged id
  bool ignore_merges = false;
  bool add_prefix_space = false;
  AddedTokenMatcher raw_tokens, normalized_tokens;  // split out first (normalized: false), then the others
  std::unordered_map<std::string, std::int64_t> added_ids;
  Template around;
  std::int64_t vocab_size = 0;

  // Reads the model section; false and `declined` when it is not a byte-level BPE this runs.
  bool read_model(const json& model, std::string& declined);
  bool read_added_tokens(const json& added, std::string& declined);
  void bpe(std::string_view word, std::vector<std::int32_t>& out) const;
};

bool ByteLevelBpeTokenizer::Model::read_model(const json& model, std::string& declined) {
  if (!model.is_object() || model.value("type", "") != "BPE") {
    declined = "model " + (model.is_object() ? model.value("type", "without a type") : model.dump());
    return false;
  }
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!absent_or(model, key, json())) {
      declined = std::string("BPE model with ") + key;
      return false;
    }
  }
  if (!model.contains("vocab") || !model["vocab"].is_object() || !model.contains("merges") ||
      !model["merges"].is_array()) {
    declined = "BPE model without a vocab object and a merges list";
    return false;
  }
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_unsigned() || id.get<std::uint64_t>() > INT32_MAX) {
      declined = "vocab entry '" + token + "' without a valid id";
      return false;
    }
    vocab.emplace(token, id.get<std::int32_t>());
  }
  bool every_byte = true;
  for (std::size_t b = 0; b < 256; ++b) {
    const auto it = vocab.find(kByteChars[b]);
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
    every_byte = every_byte && it != vocab.end();
  }
  // A byte without a token is dropped by the package when there is no unk_token and no byte fallback, as here.
  if (!every_byte && (!absent_or(model, "unk_token", json()) || !absent_or(model, "byte_fallback", false))) {
    declined = "BPE model with an unk_token or byte_fallback and bytes the vocab lacks";
    return false;
  }
  if (model.contains("ignore_merges") && !model["ignore_merges"].is_null()) {
    if (!model["ignore_merges"].is_boolean()) {
      declined = "BPE model's ignore_merges is not a boolean";
      return false;
    }
    ignore_merges = model["ignore_merges"].get<bool>();
  }
  const auto id_of = [&](const std::string& token) {
    const auto it = vocab.find(token);
    return it == vocab.end() ? -1 : it->second;
  };
  std::uint32_t rank = 0;
  for (const auto& merge : model["merges"]) {
    std::string left, right;
    if (merge.is_string()) {  // "left right", one space
      const std::string text = merge.get<std::string>();
      const auto space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
        declined = "merge '" + text + "' is not two tokens";
        return false;
      }
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      declined = "merge " + merge.dump() + " is not two tokens";
      return false;
    }
    const std::int32_t a = id_of(left), b = id_of(right), merged = id_of(left + right);
    if (a < 0 || b < 0 || merged < 0) {
      declined = "merge '" + left + " " + right + "' names a token the vocab lacks";
      return false;
    }
    merges.insert_or_assign(pair_key(a, b), Merge{rank++, merged});  // a repeated pair keeps its last rank
  }
  return true;
}

bool ByteLevelBpeTokenizer::Model::read_added_tokens(const json& added, std::string& declined) {
  if (added.is_null()) return true;
  if (!added.is_array()) {
    declined = "added_tokens is not a list";
    return false;
  }
  std::optional<std::int64_t> last_added;  // the largest id given so far
  for (const auto& token : added) {
    if (!token.is_object() || !token.contains("content") || !token["content"].is_string() || !token.contains("id") ||
        !token["id"].is_number_unsigned() || !is_bool(token, "normalized")) {
      declined = "added token " + token.dump() + " without content, id and normalized";
      return false;
    }
    for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
      if (!absent_or(token, flag, false)) {
        declined = "added token with " + std::string(flag);
        return false;
      }
    }
    AddedToken entry{token["content"].get<std::string>(), 0};
    if (entry.content.empty() || added_ids.count(entry.content)) {
      declined = "an added token that is empty or listed twice";
      return false;
    }
    // The package ignores the file's id: a token the vocabulary has keeps its id there; any other takes the next id
    // past the vocabulary and the added tokens so far, in the file's order.
    if (const auto it = vocab.find(entry.content); it != vocab.end()) entry.id = it->second;
    else
      entry.id = last_added && *last_added >= static_cast<std::int64_t>(vocab.size())
                     ? *last_added + 1
                     : static_cast<std::int64_t>(vocab.size());
    last_added = std::max(last_added.value_or(entry.id), entry.id);
    added_ids.emplace(entry.content, entry.id);
    (token["normalized"].get<bool>() ? normalized_tokens : raw_tokens).add(std::move(entry));
  }
  raw_tokens.finish();
  normalized_tokens.finish();
  return true;
}

// Merges the word's byte tokens, lowest rank first and leftmost among equals, as the package's Word::merge_all.
void ByteLevelBpeTokenizer::Model::bpe(std::string_view word, std::vector<std::int32_t>& out) const {
  if (ignore_merges) {
    const auto it = vocab.find(byte_level_string(word));
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  struct Symbol {
    std::int32_t id, prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (const char b : word) {
    const std::int32_t id = byte_ids[static_cast<unsigned char>(b)];
    if (id < 0) continue;
    const auto at = static_cast<std::int32_t>(symbols.size());
    symbols.push_back({id, at - 1, at + 1, true});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;
  using Candidate = std::tuple<std::uint32_t, std::int32_t, std::int32_t>;  // rank, left position, merged id
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto offer = [&](std::int32_t left) {
    if (left < 0 || symbols[static_cast<std::size_t>(left)].next < 0) return;
    const auto& l = symbols[static_cast<std::size_t>(left)];
    const auto it = merges.find(pair_key(l.id, symbols[static_cast<std::size_t>(l.next)].id));
    if (it != merges.end()) queue.emplace(it->second.rank, left, it->second.id);
  };
  for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(symbols.size()); ++i) offer(i);
  while (!queue.empty()) {
    const auto [rank, left, merged] = queue.top();
    queue.pop();
    auto& l = symbols[static_cast<std::size_t>(left)];
    if (!l.alive || l.next < 0) continue;
    auto& r = symbols[static_cast<std::size_t>(l.next)];
    const auto it = merges.find(pair_key(l.id, r.id));
    if (it == merges.end() || it->second.id != merged) continue;  // stale: a neighbour merged first
    l.id = merged;
    r.alive = false;
    l.next = r.next;
    if (r.next >= 0) symbols[static_cast<std::size_t>(r.next)].prev = left;
    offer(l.prev);
    offer(left);
  }
  for (std::int32_t i = 0; i >= 0; i = symbols[static_cast<std::size_t>(i)].next)
    out.push_back(symbols[static_cast<std::size_t>(i)].id);
}

// Recent words' ids (short words only; cleared when full).
struct ByteLevelBpeTokenizer::WordCache {
  static constexpr std::size_t kMaxWordBytes = 64, kMaxEntries = 1 << 17;
  std::unordered_map<std::string, std::vector<std::int32_t>> ids;
  std::vector<Segment> segments;  // scratch
  std::vector<std::string_view> pieces;
  std::string prefixed;
};

std::unique_ptr<ByteLevelBpeTokenizer> ByteLevelBpeTokenizer::load(const std::string& file, int workers,
                                                                   std::string& declined) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  if (!in) {
    declined = "cannot read the file";
    return nullptr;
  }
  return parse(bytes.str(), file, workers, declined);
}

std::unique_ptr<ByteLevelBpeTokenizer> ByteLevelBpeTokenizer::parse(std::string_view text, std::string name,
                                                                    int workers, std::string& declined) {
  const json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!root.is_object()) {
    declined = "not a JSON object";
    return nullptr;
  }
  for (const char* key : {"normalizer", "truncation", "padding"}) {
    if (!absent_or(root, key, json())) {
      declined = std::string(key) + " " + root[key].value("type", root[key].dump().substr(0, 80));
      return nullptr;
    }
  }
  auto model = std::make_unique<Model>();
  if (!read_pre_tokenizer(root.value("pre_tokenizer", json()), model->add_prefix_space, declined) ||
      !model->read_model(root.value("model", json()), declined) ||
      !model->read_added_tokens(root.value("added_tokens", json()), declined))
    return nullptr;
  auto around = read_template(root.value("post_processor", json()), declined);
  if (!around) return nullptr;
  model->around = std::move(*around);
  // get_vocab_size(with_added_tokens=True): the distinct strings of the vocabulary and the added tokens.
  std::size_t size = model->vocab.size();
  for (const auto& [content, id] : model->added_ids) size += model->vocab.count(content) ? 0 : 1;
  model->vocab_size = static_cast<std::int64_t>(size);
  return std::unique_ptr<ByteLevelBpeTokenizer>(new ByteLevelBpeTokenizer(std::move(name), std::move(model), workers));
}

ByteLevelBpeTokenizer::ByteLevelBpeTokenizer(std::string path, std::unique_ptr<Model> model, int workers)
    : path_(std::move(path)), model_(std::move(model)) {
  for (int w = 0; w < std::max(1, workers); ++w) caches_.push_back(std::make_unique<WordCache>());
}

ByteLevelBpeTokenizer::~ByteLevelBpeTokenizer() = default;

std::optional<std::int64_t> ByteLevelBpeTokenizer::token_to_id(const std::string& token) const {
  if (const auto it = model_->added_ids.find(token); it != model_->added_ids.end()) return it->second;
  if (const auto it = model_->vocab.find(token); it != model_->vocab.end()) return it->second;
  return std::nullopt;
}

std::int64_t ByteLevelBpeTokenizer::vocab_size() const { return model_->vocab_size; }

std::vector<std::int64_t> ByteLevelBpeTokenizer::encode(std::string_view text, int worker) {
  const Model& m = *model_;
  WordCache& cache = *caches_[static_cast<std::size_t>(worker)];
  std::vector<std::int64_t> out(m.around.before.begin(), m.around.before.end());
  auto& segments = cache.segments;
  segments.clear();
  std::vector<Segment> raw;
  split_on(m.raw_tokens, text, raw);
  for (const auto& segment : raw) {
    if (segment.id >= 0) segments.push_back(segment);
    else split_on(m.normalized_tokens, segment.text, segments);
  }
  std::vector<std::int32_t> word_ids;
  for (const auto& segment : segments) {
    if (segment.id >= 0) {
      out.push_back(segment.id);
      continue;
    }
    std::string_view piece_text = segment.text;
    if (m.add_prefix_space && piece_text.front() != ' ') {
      cache.prefixed.assign(1, ' ');
      cache.prefixed.append(piece_text);
      piece_text = cache.prefixed;
    }
    cache.pieces.clear();
    split_gpt2_pieces(piece_text, cache.pieces);
    for (const std::string_view word : cache.pieces) {
      if (word.size() > WordCache::kMaxWordBytes) {
        word_ids.clear();
        m.bpe(word, word_ids);
        out.insert(out.end(), word_ids.begin(), word_ids.end());
        continue;
      }
      auto it = cache.ids.find(std::string(word));
      if (it == cache.ids.end()) {
        if (cache.ids.size() >= WordCache::kMaxEntries) cache.ids.clear();
        word_ids.clear();
        m.bpe(word, word_ids);
        it = cache.ids.emplace(std::string(word), word_ids).first;
      }
      out.insert(out.end(), it->second.begin(), it->second.end());
    }
  }
  out.insert(out.end(), m.around.after.begin(), m.around.after.end());
  return out;
}

Result<std::vector<std::vector<std::int64_t>>> ByteLevelBpeTokenizer::encode_batch(
    const std::vector<std::string_view>& texts) {
  for (std::size_t i = 0; i < texts.size(); ++i) {
    if (const std::size_t at = invalid_utf8_at(texts[i]); at != std::string_view::npos)
      return Status::Error("text " + std::to_string(i) + " of the batch is not valid UTF-8 (byte " +
                           std::to_string(at) + ")");
  }
  std::vector<std::vector<std::int64_t>> out(texts.size());
  std::atomic<std::size_t> next{0};
  constexpr std::size_t kTextsPerClaim = 16;
  const auto run = [&](int worker) {
    for (std::size_t begin; (begin = next.fetch_add(kTextsPerClaim)) < texts.size();)
      for (std::size_t i = begin; i < std::min(texts.size(), begin + kTextsPerClaim); ++i)
        out[i] = encode(texts[i], worker);
  };
  const int workers = static_cast<int>(
      std::min(caches_.size(), std::max<std::size_t>(1, (texts.size() + kTextsPerClaim - 1) / kTextsPerClaim)));
  std::vector<std::thread> threads;
  for (int w = 1; w < workers; ++w) threads.emplace_back(run, w);
  run(0);
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace trestle::data
