// Megatron's tools/preprocess_data.py in one pass: JSON lines (or plain text, one document per blank-line-separated
// paragraph; lines end as Python's universal newlines end them) -> one indexed dataset per JSON key,
// PREFIX_<key>_document.bin/.idx, tokens in Megatron's dtype for the vocabulary. A key holding a list of strings gives
// one sequence per string; --append-eod adds the EOD id to each non-empty document's last sequence, as Megatron does.
// Documents are read in batches: the batch's JSON is parsed on `workers` threads and tokenized on as many, then written
// in input order.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/status.h"
#include "train/data/tokenizer.h"

namespace trestle::data {

// How the input is read: JSON lines, plain text, or (auto) JSON lines when the name says .json or the file's first
// character other than white space (after a UTF-8 byte-order mark) is '{', else plain text.
enum class InputFormat { kAuto, kJsonLines, kText };

struct PreprocessOptions {
  std::string input;
  InputFormat format = InputFormat::kAuto;
  std::string output_prefix;
  std::vector<std::string> json_keys = {"text"};
  bool append_eod = false;
  int workers = 1;
  std::size_t batch_bytes = 4u << 20;  // input bytes per batch
  bool progress = true;                // a progress line on stderr
};

struct PreprocessReport {
  std::uint64_t documents = 0;
  std::uint64_t tokens = 0;
  std::uint64_t input_bytes = 0;
  double seconds = 0;
  bool json_lines = true;            // how the input was read
  std::vector<std::string> outputs;  // the prefixes written
};

// One document's texts per key (each JSON key, or the one paragraph of plain text): a JSON string gives one
// sequence, a list of strings one per entry.
struct DocumentTexts {
  std::vector<std::vector<std::string>> per_key;
};

// The documents of a piece of the input that ends at a document boundary: JSON lines (each non-blank line a JSON
// object holding every key of options.json_keys, read as Python's json.loads reads it and parsed on `workers`
// threads) or blank-line-separated paragraphs of plain text. Errors name options.input and the line, the text's first
// line being first_line.
Result<std::vector<DocumentTexts>> read_documents(std::string_view text, bool json, std::size_t first_line,
                                                  const PreprocessOptions& options, int workers);

// Whether preprocess reads the input as JSON lines rather than plain text, given its name and content.
bool is_json_lines(InputFormat format, const std::string& path, std::string_view content);

// --json-keys as preprocess takes them: at least one, none given twice (each key is one output).
Status check_json_keys(const std::vector<std::string>& keys);

Result<PreprocessReport> preprocess(const PreprocessOptions& options, Tokenizer& tokenizer);

}  // namespace trestle::data
