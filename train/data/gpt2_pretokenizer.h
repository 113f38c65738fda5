// GPT-2's pre-tokenizer: valid UTF-8 text cut into the pieces the `tokenizers` package's ByteLevel pre-tokenizer cuts
// it into with its regex ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+), with the
// package's own Unicode classes (unicode_classes.inc); plus the UTF-8 check Python's strict decoder makes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace trestle::data {

enum class CharClass : std::uint8_t { kOther, kLetter, kNumber, kSpace };

// The class of a Unicode scalar value in that regex (\p{L}, \p{N}, \s, or none of them).
CharClass char_class(char32_t c);

// The byte offset of the first byte that is not valid UTF-8 as Python's strict decoder reads it (overlong forms,
// surrogates and values past U+10FFFF refused), or npos when the text is valid.
std::size_t invalid_utf8_at(std::string_view text);

// Appends text's pieces, in order, to `pieces` (views into text; together they are text). Text must be valid UTF-8.
void split_gpt2_pieces(std::string_view text, std::vector<std::string_view>& pieces);

}  // namespace trestle::data
