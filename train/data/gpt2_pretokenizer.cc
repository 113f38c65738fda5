#include "train/data/gpt2_pretokenizer.h"

#include <algorithm>
#include <array>
#include <iterator>

namespace trestle::data {
namespace {

struct CodeRange {
  char32_t first, last;
};
#include "train/data/unicode_classes.inc"

bool in_ranges(const CodeRange* begin, const CodeRange* end, char32_t c) {
  const CodeRange* it = std::upper_bound(begin, end, c, [](char32_t v, const CodeRange& r) { return v < r.first; });
  return it != begin && c <= std::prev(it)->last;
}

template <std::size_t N>
bool in_ranges(const CodeRange (&ranges)[N], char32_t c) {
  return in_ranges(ranges, ranges + N, c);
}

CharClass class_from_tables(char32_t c) {
  if (in_ranges(kLetterRanges, c)) return CharClass::kLetter;
  if (in_ranges(kNumberRanges, c)) return CharClass::kNumber;
  if (in_ranges(kSpaceRanges, c)) return CharClass::kSpace;
  return CharClass::kOther;
}

const std::array<CharClass, 128> kAsciiClasses = [] {
  std::array<CharClass, 128> out{};
  for (char32_t c = 0; c < 128; ++c) out[c] = class_from_tables(c);
  return out;
}();

// The scalar value at text[at] (valid UTF-8) and its length in bytes.
struct Decoded {
  char32_t value;
  std::size_t length;
};

Decoded decode(std::string_view text, std::size_t at) {
  const auto b0 = static_cast<unsigned char>(text[at]);
  if (b0 < 0x80) return {b0, 1};
  auto next = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(text[at + k]) & 0x3F); };
  if (b0 < 0xE0) return {(static_cast<char32_t>(b0 & 0x1F) << 6) | next(1), 2};
  if (b0 < 0xF0) return {(static_cast<char32_t>(b0 & 0x0F) << 12) | (next(1) << 6) | next(2), 3};
  return {(static_cast<char32_t>(b0 & 0x07) << 18) | (next(1) << 12) | (next(2) << 6) | next(3), 4};
}

// Walks one piece of the pattern: where a run of a class ends, and what comes next.
class Cursor {
 public:
  explicit Cursor(std::string_view text) : text_(text) {}
  bool at_end(std::size_t at) const { return at >= text_.size(); }
  CharClass class_at(std::size_t at) const {
    const auto b = static_cast<unsigned char>(text_[at]);
    return b < 0x80 ? kAsciiClasses[b] : char_class(decode(text_, at).value);
  }
  std::size_t length_at(std::size_t at) const {
    const auto b = static_cast<unsigned char>(text_[at]);
    return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  }
  // The end of the run of `kind` characters starting at `at` (at itself when there is none).
  std::size_t run_end(std::size_t at, CharClass kind) const {
    while (!at_end(at) && class_at(at) == kind) at += length_at(at);
    return at;
  }

 private:
  std::string_view text_;
};

// The length of the contraction ('s 't 're 've 'm 'll 'd) at text[at], or 0.
std::size_t contraction_at(std::string_view text, std::size_t at) {
  if (text[at] != '\'' || at + 1 >= text.size()) return 0;
  const char c = text[at + 1];
  if (c == 's' || c == 't' || c == 'm' || c == 'd') return 2;
  if (at + 2 >= text.size()) return 0;
  const char d = text[at + 2];
  if ((c == 'r' && d == 'e') || (c == 'v' && d == 'e') || (c == 'l' && d == 'l')) return 3;
  return 0;
}

// The end of the piece starting at `at`: the regex's alternatives in order, the first that matches.
std::size_t piece_end(const Cursor& cursor, std::string_view text, std::size_t at) {
  if (const std::size_t n = contraction_at(text, at)) return at + n;
  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional ASCII space, then a run of one class.
  const std::size_t body = text[at] == ' ' && !cursor.at_end(at + 1) ? at + 1 : at;
  const CharClass kind = cursor.class_at(body);
  if (kind != CharClass::kSpace) return cursor.run_end(body, kind);
  // `\s+(?!\S)` then `\s+`: a run of spaces, less its last character when something other than a space follows
  // and the run has more than one.
  const std::size_t end = cursor.run_end(at, CharClass::kSpace);
  if (cursor.at_end(end)) return end;
  std::size_t last = at;
  for (std::size_t k = at; k < end; k += cursor.length_at(k)) last = k;
  return last > at ? last : end;
}

}  // namespace

CharClass char_class(char32_t c) { return c < 128 ? kAsciiClasses[c] : class_from_tables(c); }

std::size_t invalid_utf8_at(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char b = s[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    std::size_t length;
    unsigned char low = 0x80, high = 0xBF;  // the allowed range of the second byte
    if (b >= 0xC2 && b <= 0xDF) {
      length = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      length = 3;
      if (b == 0xE0) low = 0xA0;   // overlong
      if (b == 0xED) high = 0x9F;  // surrogates
    } else if (b >= 0xF0 && b <= 0xF4) {
      length = 4;
      if (b == 0xF0) low = 0x90;   // overlong
      if (b == 0xF4) high = 0x8F;  // past U+10FFFF
    } else {
      return i;
    }
    if (i + length > n || s[i + 1] < low || s[i + 1] > high) return i;
    for (std::size_t k = 2; k < length; ++k)
      if ((s[i + k] & 0xC0) != 0x80) return i;
    i += length;
  }
  return std::string_view::npos;
}

void split_gpt2_pieces(std::string_view text, std::vector<std::string_view>& pieces) {
  const Cursor cursor(text);
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = piece_end(cursor, text, at);
    pieces.push_back(text.substr(at, end - at));
    at = end;
  }
}

}  // namespace trestle::data
