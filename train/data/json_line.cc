#include "train/data/json_line.h"

#include <cmath>
#include <cstdlib>
#include <optional>
#include <vector>

#include "ckpt/printable_text.h"

namespace trestle::data {
namespace {

// nlohmann's message without its "[json.exception.parse_error.101] " tag, with the bytes it quotes escaped.
std::string json_error(const nlohmann::json::exception& e) {
  std::string_view what = e.what();
  if (const std::size_t tag = what.find("] "); what.starts_with("[json.exception.") && tag != std::string_view::npos)
    what.remove_prefix(tag + 2);
  return printable_text(std::string(what));
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The code unit of the \uXXXX escape starting at `at`, if the text holds one there.
std::optional<unsigned> escape_at(std::string_view s, std::size_t at) {
  if (at + 6 > s.size() || s[at] != '\\' || s[at + 1] != 'u') return std::nullopt;
  unsigned unit = 0;
  for (std::size_t k = 2; k < 6; ++k) {
    const int digit = hex_digit(s[at + k]);
    if (digit < 0) return std::nullopt;
    unit = unit * 16 + static_cast<unsigned>(digit);
  }
  return unit;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// The length of the JSON number at the start of the text (0 if none), read as Python's json reads one: the longest
// prefix of the form -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?
std::size_t json_number_length(std::string_view t) {
  std::size_t i = 0;
  auto digits = [&] {
    const std::size_t from = i;
    while (i < t.size() && is_digit(t[i])) ++i;
    return i > from;
  };
  if (i < t.size() && t[i] == '-') ++i;
  if (i < t.size() && t[i] == '0') {
    ++i;
  } else if (!digits()) {
    return 0;
  }
  if (const std::size_t integer = i; i < t.size() && t[i] == '.' && (++i, !digits())) return integer;
  if (const std::size_t before = i; i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    if (!digits()) return before;
  }
  return i;
}

// The line with what Python's json reads and strict JSON does not replaced, keeping every other byte where it was (so
// that a parse error's column is the line's): numbers by a 0 padded with spaces, lone surrogate escapes by \ufffd;
// noting per top-level key what its value held. Anything else is copied as it is, for the strict parser to judge.
std::string strict_form(std::string_view in, std::map<std::string, std::string>& inexact_keys) {
  std::string out;
  out.reserve(in.size() + 16);
  std::vector<char> open;          // the containers around the position, '{' or '['
  char last = 0;                   // the last character outside strings that is not white space ('"' for a string)
  std::optional<std::string> key;  // the top-level key whose value is being read
  auto note = [&](std::string what) {
    if (key) inexact_keys.emplace(*key, std::move(what));
  };
  std::size_t i = 0;
  while (i < in.size()) {
    const char c = in[i];
    if (c == '"') {
      const bool is_key = open.size() == 1 && open[0] == '{' && (last == '{' || last == ',');
      const std::size_t start = out.size();
      out += c;
      ++i;
      while (i < in.size() && in[i] != '"') {
        if (in[i] != '\\') {
          out += in[i++];
          continue;
        }
        if (const auto unit = escape_at(in, i); unit && *unit >= 0xD800 && *unit <= 0xDFFF) {
          const auto next = escape_at(in, i + 6);
          if (*unit <= 0xDBFF && next && *next >= 0xDC00 && *next <= 0xDFFF) {
            out.append(in.substr(i, 12));
            i += 12;
            continue;
          }
          if (!is_key) note("a lone UTF-16 surrogate escape (" + std::string(in.substr(i, 6)) + ")");
          out += "\\ufffd";
          i += 6;
          continue;
        }
        out += in[i++];                     // the backslash
        if (i < in.size()) out += in[i++];  // what it escapes
      }
      if (i < in.size()) out += in[i++];
      last = '"';
      if (is_key) {
        const auto name = nlohmann::json::parse(out.substr(start), nullptr, /*allow_exceptions=*/false);
        key = name.is_string() ? name.get<std::string>() : out.substr(start);
        inexact_keys.erase(*key);  // Python keeps a repeated key's last value
      }
      continue;
    }
    // Where a value may start, Python's json reads its three literals and numbers of any size.
    const bool value_start = last == 0 || last == ':' || last == '[' || last == ',';
    std::string_view literal;
    for (std::string_view word : {"NaN", "Infinity", "-Infinity"})
      if (value_start && in.substr(i).starts_with(word)) literal = word;
    if (!literal.empty()) {
      note(std::string(literal));
      out += '0';
      out.append(literal.size() - 1, ' ');
      i += literal.size();
      last = 'v';
      continue;
    }
    if (const std::size_t length = value_start ? json_number_length(in.substr(i)) : 0; length > 0) {
      const std::string number(in.substr(i, length));
      if (std::isinf(std::strtod(number.c_str(), nullptr))) {
        note("a number beyond a double's range (" + printable_text(number.substr(0, 40)) +
             (number.size() > 40 ? "...)" : ")"));
        out += '0';
        out.append(number.size() - 1, ' ');
      } else {
        out += number;
      }
      i += length;
      last = 'v';
      continue;
    }
    if (c == '{' || c == '[') {
      open.push_back(c);
    } else if (c == '}' || c == ']') {
      if (!open.empty()) open.pop_back();
      if (open.empty()) key.reset();
    }
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n') last = c;
    out += c;
    ++i;
  }
  return out;
}

}  // namespace

Result<JsonLine> parse_json_line(std::string_view line) {
  // nlohmann skips a leading byte-order mark; json.loads refuses it, and so does Megatron's preprocess_data.py.
  if (line.starts_with("\xEF\xBB\xBF"))
    return Status::Error("Unexpected UTF-8 BOM (decode using utf-8-sig): line 1 column 1 (char 0)");
  JsonLine parsed;
  try {
    parsed.value = nlohmann::json::parse(line);
    return parsed;
  } catch (const nlohmann::json::exception&) {
  }
  try {
    parsed.value = nlohmann::json::parse(strict_form(line, parsed.inexact_keys));
    return parsed;
  } catch (const nlohmann::json::exception& e) {
    return Status::Error(json_error(e));
  }
}

}  // namespace trestle::data
