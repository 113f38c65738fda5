#include "train/data/preprocess.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <thread>

#include "ckpt/atomic_file.h"
#include "ckpt/file_lock.h"
#include "ckpt/mapped_file.h"
#include "ckpt/removed_on_signal.h"
#include "train/data/indexed_dataset.h"
#include "train/data/json_line.h"

namespace trestle::data {
namespace {

// A document's text in the input and, for JSON lines, its line (from 0 within the text split).
struct Piece {
  std::string_view text;
  std::size_t line = 0;
};

// Where the line starting at `at` ends (its terminator's first byte) and the next one starts, lines ending as Python's
// universal newlines end them ("\n", "\r\n" or "\r"), as Megatron's preprocess_data.py reads its input.
struct LineSpan {
  std::size_t end = 0;
  std::size_t next = 0;
};

LineSpan line_at(std::string_view text, std::size_t at) {
  const std::size_t end = text.find_first_of("\r\n", at);
  if (end == std::string_view::npos) return {text.size(), text.size()};
  if (text[end] == '\r' && end + 1 < text.size() && text[end + 1] == '\n') return {end, end + 2};
  return {end, end + 1};
}

bool is_blank(std::string_view line) { return line.find_first_not_of(" \t\f\v") == std::string_view::npos; }

std::size_t count_lines(std::string_view text) {
  std::size_t lines = 0;
  for (std::size_t at = 0; at < text.size(); at = line_at(text, at).next) ++lines;
  return lines;
}

// The end of the batch that starts at `at` and holds at least `bytes` bytes (all of the text if less is left): the
// end of a line for JSON lines, the end of a blank line (or of the text) for plain text.
std::size_t batch_end(std::string_view text, std::size_t at, std::size_t bytes, bool json) {
  if (bytes >= text.size() - at) return text.size();
  LineSpan line = line_at(text, at + bytes);
  while (!json && line.next < text.size()) {
    const LineSpan following = line_at(text, line.next);
    if (is_blank(text.substr(line.next, following.end - line.next))) return following.next;
    line = following;
  }
  return line.next;
}

// Splits the text into documents: the non-blank lines for JSON, the paragraphs between blank lines for text.
std::vector<Piece> split_documents(std::string_view text, bool json) {
  std::vector<Piece> out;
  std::size_t line = 0;  // counts lines, blank ones included (plain text numbers no lines)
  std::optional<std::size_t> paragraph;
  std::size_t paragraph_end = 0;
  for (std::size_t at = 0; at < text.size(); ++line) {
    const LineSpan span = line_at(text, at);
    const std::string_view piece = text.substr(at, span.end - at);
    if (json) {
      if (piece.find_first_not_of(" \t\r\n") != std::string_view::npos) out.push_back({piece, line});
    } else if (is_blank(piece)) {
      if (paragraph) out.push_back({text.substr(*paragraph, paragraph_end - *paragraph), 0});
      paragraph.reset();
    } else {
      if (!paragraph) paragraph = at;
      paragraph_end = span.end;
    }
    at = span.next;
  }
  if (paragraph) out.push_back({text.substr(*paragraph, paragraph_end - *paragraph), 0});
  return out;
}

Status parse_json_documents(const std::vector<Piece>& lines, std::size_t first_line, const PreprocessOptions& options,
                            int workers, std::vector<DocumentTexts>& out) {
  out.assign(lines.size(), {});
  std::vector<Status> errors(static_cast<std::size_t>(workers));
  auto run = [&](std::size_t w, std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      const std::string where = options.input + ":" + std::to_string(first_line + lines[i].line);
      // (nlohmann's parser would stop at a NUL byte and take the line before it for the whole line)
      if (const std::size_t nul = lines[i].text.find('\0'); nul != std::string_view::npos) {
        errors[w] = Status::Error(where + ": a NUL byte at column " + std::to_string(nul + 1) + " (not JSON)");
        return;
      }
      auto line = parse_json_line(lines[i].text);
      if (!line.ok()) {
        errors[w] = Status::Error(where + ": not JSON: " + line.status().message());
        return;
      }
      const nlohmann::json& doc = line->value;
      if (!doc.is_object()) {
        errors[w] = Status::Error(where + ": not a JSON object (a " + doc.type_name() + ")");
        return;
      }
      for (const auto& key : options.json_keys) {
        auto it = doc.find(key);
        if (it == doc.end()) {
          errors[w] = Status::Error(where + ": no key '" + key + "'");
          return;
        }
        if (const auto inexact = line->inexact_keys.find(key); inexact != line->inexact_keys.end()) {
          errors[w] = Status::Error(where + ": '" + key + "' holds " + inexact->second +
                                    ", which Python's json reads but no tokenizer takes as text");
          return;
        }
        std::vector<std::string> texts;
        if (it->is_string()) {
          texts.push_back(it->get<std::string>());
        } else if (it->is_array() && std::all_of(it->begin(), it->end(), [](const auto& v) { return v.is_string(); })) {
          for (const auto& v : *it) texts.push_back(v.get<std::string>());
        } else {
          errors[w] = Status::Error(where + ": '" + key + "' is neither a string nor a list of strings");
          return;
        }
        out[i].per_key.push_back(std::move(texts));
      }
    }
  };
  const auto n = static_cast<std::size_t>(workers);
  const std::size_t per = (lines.size() + n - 1) / n;
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < n && w * per < lines.size(); ++w)
    threads.emplace_back(run, w, w * per, std::min(lines.size(), (w + 1) * per));
  run(0, 0, std::min(lines.size(), per));
  for (auto& t : threads) t.join();
  for (auto& e : errors) TRESTLE_RETURN_IF_ERROR(e);
  return OkStatus();
}

// Whether the two paths name one file (a path that does not exist names none).
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

void print_progress(std::uint64_t done, std::uint64_t total, std::uint64_t tokens, double seconds, bool final) {
  const double rate = seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
  std::fprintf(stderr, "preprocess: %5.1f%%  %.1f of %.1f MB  %llu tokens  %.2f M tokens/s  %.1f s%s",
               total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0,
               static_cast<double>(done) / 1e6, static_cast<double>(total) / 1e6,
               static_cast<unsigned long long>(tokens), rate / 1e6, seconds, final ? "\n" : "\r");
  std::fflush(stderr);
}

}  // namespace

Result<std::vector<DocumentTexts>> read_documents(std::string_view text, bool json, std::size_t first_line,
                                                  const PreprocessOptions& options, int workers) {
  const auto pieces = split_documents(text, json);
  std::vector<DocumentTexts> documents;
  if (json) {
    TRESTLE_RETURN_IF_ERROR(parse_json_documents(pieces, first_line, options, std::max(1, workers), documents));
  } else {
    for (const auto& piece : pieces) documents.push_back({{{std::string(piece.text)}}});
  }
  return documents;
}

bool is_json_lines(InputFormat format, const std::string& path, std::string_view content) {
  if (format != InputFormat::kAuto) return format == InputFormat::kJsonLines;
  std::string name = std::filesystem::path(path).filename().string();
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  if (name.find(".json") != std::string::npos) return true;
  if (content.starts_with("\xEF\xBB\xBF")) content.remove_prefix(3);
  const std::size_t first = content.find_first_not_of(" \t\r\n\f\v");
  return first != std::string_view::npos && content[first] == '{';
}

Status check_json_keys(const std::vector<std::string>& keys) {
  if (keys.empty()) return Status::Error("--json-keys: no key");
  for (std::size_t k = 0; k < keys.size(); ++k)
    if (std::count(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(k), keys[k]))
      return Status::Error("--json-keys: '" + keys[k] + "' given twice (each key is one output)");
  return OkStatus();
}

Result<PreprocessReport> preprocess(const PreprocessOptions& options, Tokenizer& tokenizer) {
  const auto start = std::chrono::steady_clock::now();
  TRESTLE_RETURN_IF_ERROR(check_json_keys(options.json_keys));
  std::optional<std::int64_t> eod = tokenizer.eod();
  if (options.append_eod && !eod)
    return Status::Error(tokenizer.name() +
                         ": --append-eod, but the tokenizer has no end-of-document token (--eod-token)");
  TRESTLE_ASSIGN_OR_RETURN(auto input, MappedFile::open(options.input));
  const std::string_view text(reinterpret_cast<const char*>(input.bytes().data()), input.size());
  const bool json = is_json_lines(options.format, options.input, text);
  const int workers = std::max(1, options.workers);

  const TokenDType dtype = optimal_token_dtype(tokenizer.vocab_size());
  std::vector<IndexedDatasetWriter> writers;
  PreprocessReport report;
  for (const auto& key : json ? options.json_keys : std::vector<std::string>{"text"}) {
    const std::string prefix = options.output_prefix + "_" + key + "_document";
    for (const std::string& output : {bin_path(prefix), idx_path(prefix)})
      if (same_file(options.input, output))
        return Status::Error(options.input + ": the input is also an output (" + output +
                             "); write the dataset under another --output-prefix");
    TRESTLE_ASSIGN_OR_RETURN(auto writer, IndexedDatasetWriter::create(prefix, dtype));
    writers.push_back(std::move(writer));
    report.outputs.push_back(prefix);
  }
  // (one run writing under the prefix at a time: two would both report success, the later one's files replacing the
  // other's)
  TRESTLE_ASSIGN_OR_RETURN(const FileLock writing, lock_output(options.output_prefix));
  const RemovedOnSignal lock_removed_on_signal(writing.path());

  std::size_t at = 0;
  std::size_t line_number = 1;
  auto last_print = start;
  while (at < text.size()) {
    const std::size_t end = batch_end(text, at, options.batch_bytes, json);
    const std::string_view chunk = text.substr(at, end - at);
    TRESTLE_ASSIGN_OR_RETURN(const auto documents, read_documents(chunk, json, line_number, options, workers));
    const std::size_t first_line = line_number;
    if (json) line_number += count_lines(chunk);
    std::vector<std::string_view> flat;
    for (const auto& d : documents)
      for (const auto& texts : d.per_key)
        for (const auto& t : texts) flat.push_back(t);
    auto ids = tokenizer.encode_batch(flat);
    if (!ids.ok())
      return ids.status().with_context(
          options.input + ": " +
          (json ? "lines " + std::to_string(first_line) + " to " + std::to_string(line_number - 1)
                : "bytes [" + std::to_string(at) + ", " + std::to_string(end) + ")"));

    std::size_t next = 0;
    std::vector<std::int64_t> tokens;
    std::vector<std::int32_t> lengths;
    for (const auto& d : documents) {
      for (std::size_t k = 0; k < d.per_key.size(); ++k) {
        tokens.clear();
        lengths.clear();
        for (std::size_t s = 0; s < d.per_key[k].size(); ++s) {
          const auto& sentence = (*ids)[next++];
          if (sentence.empty()) continue;
          tokens.insert(tokens.end(), sentence.begin(), sentence.end());
          lengths.push_back(static_cast<std::int32_t>(sentence.size()));
        }
        if (options.append_eod && !tokens.empty()) {
          tokens.push_back(*eod);
          lengths.back() += 1;
        }
        TRESTLE_RETURN_IF_ERROR(writers[k].add_document(tokens, lengths));
        report.tokens += tokens.size();
      }
      ++report.documents;
    }
    at = end;
    const auto now = std::chrono::steady_clock::now();
    if (options.progress && now - last_print > std::chrono::milliseconds(500)) {
      last_print = now;
      print_progress(at, text.size(), report.tokens, std::chrono::duration<double>(now - start).count(), false);
    }
  }
  // Every key's dataset replaces its old one together: all written first, then renamed in as one unit.
  std::vector<StagedFile> staged;
  for (auto& w : writers) {
    auto files = w.stage();
    if (!files.ok()) {
      remove_staged(staged);
      return files.status();
    }
    staged.insert(staged.end(), files->begin(), files->end());
  }
  TRESTLE_RETURN_IF_ERROR(commit_renames(staged));
  report.input_bytes = text.size();
  report.json_lines = json;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (options.progress) print_progress(text.size(), text.size(), report.tokens, report.seconds, true);
  return report;
}

}  // namespace trestle::data
