// Text quoted from files written by strangers (tensor and file names, config values, bytes of a damaged file) is made
// printable before it reaches a user (stderr, inspect's tables, a Python exception): valid UTF-8 with no control
// character, so it can neither garble a terminal (escape sequences, bell) nor forge a line of output (newline).
#pragma once

#include <cstddef>
#include <string>

namespace trestle {

// `text` on one line: newline, carriage return and tab written as \n, \r and \t, and every other control character
// (C0, DEL, C1, the bidirectional marks, embeddings, overrides and isolates) and every byte that is not part of valid
// UTF-8 text as \xNN.
inline std::string printable_text(std::string text) {
  auto valid_at = [&text](std::size_t at) -> std::size_t {  // length of the printable character at `at`; 0: none
    const auto c = static_cast<unsigned char>(text[at]);
    if (c >= 0x20 && c < 0x7f) return 1;
    std::size_t n = 0;
    unsigned char low = 0x80, high = 0xbf;  // the second byte's range (no overlong forms, surrogates or > U+10FFFF)
    if (c >= 0xc2 && c <= 0xdf) n = 2, low = c == 0xc2 ? 0xa0 : 0x80;  // (U+0080-U+009F are the C1 controls)
    if (c >= 0xe0 && c <= 0xef) n = 3, low = c == 0xe0 ? 0xa0 : 0x80, high = c == 0xed ? 0x9f : 0xbf;
    if (c >= 0xf0 && c <= 0xf4) n = 4, low = c == 0xf0 ? 0x90 : 0x80, high = c == 0xf4 ? 0x8f : 0xbf;
    if (n == 0 || at + n > text.size()) return 0;
    for (std::size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(text[at + k]);
      if (k == 1 ? (b < low || b > high) : (b & 0xc0) != 0x80) return 0;
    }
    if (c == 0xe2) {  // the bidirectional controls, which reorder what follows them on screen
      const auto b1 = static_cast<unsigned char>(text[at + 1]), b2 = static_cast<unsigned char>(text[at + 2]);
      if (b1 == 0x80 && (b2 == 0x8e || b2 == 0x8f || (b2 >= 0xaa && b2 <= 0xae))) return 0;  // U+200E-F, U+202A-E
      if (b1 == 0x81 && b2 >= 0xa6 && b2 <= 0xa9) return 0;                                  // U+2066-U+2069
    }
    if (c == 0xd8 && static_cast<unsigned char>(text[at + 1]) == 0x9c) return 0;  // U+061C, the Arabic letter mark
    return n;
  };
  std::size_t at = 0;
  while (at < text.size() && valid_at(at) > 0) at += valid_at(at);
  if (at == text.size()) return text;  // the usual case: nothing to escape
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = text.substr(0, at);
  while (at < text.size()) {
    if (const std::size_t n = valid_at(at); n > 0) {
      out.append(text, at, n);
      at += n;
      continue;
    }
    const auto byte = static_cast<unsigned char>(text[at++]);
    if (byte == '\n' || byte == '\r' || byte == '\t') out += {'\\', byte == '\n' ? 'n' : byte == '\r' ? 'r' : 't'};
    else out += {'\\', 'x', kHex[byte >> 4], kHex[byte & 15]};
  }
  return out;
}

}  // namespace trestle
