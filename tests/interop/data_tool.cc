// Test-only entry points the data interop tests drive (tests/interop/test_data_*.py):
//   data_tool read PREFIX                 -> JSON {dtype, documents: [[seq tokens...]...]} of a whole indexed dataset
//   data_tool write PREFIX DTYPE_CODE     <- JSON [[[tokens of sequence]...] per document] on stdin
//   data_tool splits OPTIONS              -> builds the GPT splits (caching under Megatron's names) and writes the
//                                            first N training samples as an int64 .npy (shape N x seq_length+1)
//   splits options: --data-path W P ... --split S (or --train-data-path W P ..., --valid-data-path ...,
//                   --test-data-path ...; or --mock-data --vocab-size V --eod E) --samples T,V,E --seq-length L
//                   --seed N --cache DIR (empty: none, for mock data) --tokenizer JSON --dump N
//                   [--dump-split train|valid|test] [--surplus MID_LEVEL_DATASET_SURPLUS] --out FILE.npy
//   data_tool integers SEED LOW HIGH SIZE -> JSON numpy.random.default_rng(SEED).integers(LOW, HIGH, SIZE, int32)
#include <cstdlib>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/data/blended_dataset.h"
#include "train/data/gpt_data_builder.h"
#include "train/data/indexed_dataset.h"
#include "train/data/npy.h"
#include "train/data/numpy_generator.h"

namespace {

using namespace trestle;
using namespace trestle::data;

int fail(const Status& s) {
  std::cerr << "data_tool: " << s.message() << "\n";
  return 1;
}

int read(const std::string& prefix) {
  auto opened = IndexedDataset::open(prefix);
  if (!opened.ok()) return fail(opened.status());
  nlohmann::json documents = nlohmann::json::array();
  for (std::size_t d = 0; d < opened->document_count(); ++d) {
    nlohmann::json sequences = nlohmann::json::array();
    for (auto s = opened->document_index(d); s < opened->document_index(d + 1); ++s) {
      std::vector<std::int64_t> tokens;
      if (auto st = opened->read(static_cast<std::size_t>(s), 0, std::nullopt, tokens); !st.ok()) return fail(st);
      sequences.push_back(tokens);
    }
    documents.push_back(sequences);
  }
  std::cout << nlohmann::json{{"dtype", token_dtype_name(opened->dtype())}, {"documents", documents}}.dump() << "\n";
  return 0;
}

int write(const std::string& prefix, int code) {
  const auto documents = nlohmann::json::parse(std::cin);
  auto writer = IndexedDatasetWriter::create(prefix, static_cast<TokenDType>(code));
  if (!writer.ok()) return fail(writer.status());
  for (const auto& document : documents) {
    std::vector<std::int64_t> tokens;
    std::vector<std::int32_t> lengths;
    for (const auto& sequence : document) {
      for (const auto& t : sequence) tokens.push_back(t.get<std::int64_t>());
      lengths.push_back(static_cast<std::int32_t>(sequence.size()));
    }
    if (auto st = writer->add_document(tokens, lengths); !st.ok()) return fail(st);
  }
  if (auto st = writer->finalize(); !st.ok()) return fail(st);
  return 0;
}

int splits(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  std::map<std::string, std::vector<std::string>> lists;
  bool mock = false;
  for (int i = 0; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--mock-data") {
      mock = true;
    } else if (flag.ends_with("data-path")) {
      auto& words = lists[flag];
      while (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) words.push_back(argv[++i]);
    } else if (i + 1 < argc) {
      flags[flag] = argv[++i];
    }
  }
  GptDataOptions options;
  for (const auto& [flag, words] : lists) {
    auto blend = parse_data_path(words);
    if (!blend.ok()) return fail(blend.status());
    if (flag == "--data-path") options.blend = *blend;
    for (std::size_t s = 0; s < 3; ++s)
      if (flag == "--" + std::string(split_name(static_cast<Split>(s))) + "-data-path")
        options.blend_per_split[s] = *blend;
  }
  options.split = flags["--split"];
  if (mock) options.mock = MockDataTokenizer{std::stoll(flags["--vocab-size"]), std::stoll(flags["--eod"])};
  std::string samples = flags["--samples"];
  for (std::size_t s = 0, at = 0; s < 3; ++s) {
    const std::size_t comma = samples.find(',', at);
    options.samples[s] = std::stoll(samples.substr(at, comma - at));
    at = comma + 1;
  }
  options.config.sequence_length = std::stoi(flags["--seq-length"]);
  options.config.random_seed = static_cast<std::uint32_t>(std::stoul(flags["--seed"]));
  options.config.path_to_cache = flags["--cache"];
  if (flags.contains("--surplus")) options.mid_level_dataset_surplus = std::stod(flags["--surplus"]);
  options.config.tokenizer_identity = nlohmann::ordered_json::parse(flags["--tokenizer"]);
  auto built = build_gpt_splits(options);
  if (!built.ok()) return fail(built.status());
  nlohmann::json summary;
  for (std::size_t s = 0; s < 3; ++s)
    summary[split_name(static_cast<Split>(s))] =
        built->splits[s] ? nlohmann::json(built->splits[s]->size()) : nlohmann::json(nullptr);
  std::size_t dumped = 0;
  for (std::size_t s = 0; s < 3; ++s)
    if (flags.contains("--dump-split") && flags["--dump-split"] == split_name(static_cast<Split>(s))) dumped = s;
  if (!built->splits[dumped]) return fail(Status::Error("no such split to dump"));
  const auto& split = *built->splits[dumped];
  const std::size_t dump = std::min<std::size_t>(std::stoul(flags["--dump"]), split.size());
  std::vector<std::int64_t> tokens;
  for (std::size_t i = 0; i < dump; ++i) {
    auto sample = split.sample(i);
    if (!sample.ok()) return fail(sample.status());
    tokens.insert(tokens.end(), sample->tokens.begin(), sample->tokens.end());
  }
  const std::size_t shape[2] = {dump, static_cast<std::size_t>(options.config.sequence_length + 1)};
  if (auto st = write_npy(flags["--out"], NpyDType::kInt64, shape, tokens); !st.ok()) return fail(st);
  std::cout << summary.dump() << "\n";
  return 0;
}

int integers(char** argv) {
  NumpyGenerator generator(std::stoull(argv[0]));
  std::cout << nlohmann::json(generator.integers_int32(std::stoll(argv[1]), std::stoll(argv[2]), std::stoull(argv[3])))
            << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "read" && argc == 3) return read(argv[2]);
  if (command == "write" && argc == 4) return write(argv[2], std::atoi(argv[3]));
  if (command == "splits") return splits(argc - 2, argv + 2);
  if (command == "integers" && argc == 6) return integers(argv + 2);
  std::cerr
      << "usage: data_tool read PREFIX | write PREFIX DTYPE_CODE | splits OPTIONS | integers SEED LOW HIGH SIZE\n";
  return 2;
}
