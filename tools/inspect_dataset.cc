// `trestle inspect PREFIX` for Megatron indexed datasets (PREFIX.idx + PREFIX.bin): dtype, sequences, documents,
// tokens and the shortest, longest and mean document.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "ckpt/byte_size.h"
#include "ckpt/printable_text.h"
#include "tools/inspect.h"
#include "train/data/indexed_dataset.h"

namespace trestle::cli {

bool is_indexed_dataset(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string prefix = data::dataset_prefix(path);
  // Any file at PREFIX.idx (one that is no regular file is then refused by the reader, naming it), or the old .idx an
  // interrupted preprocess set aside (the reader says so).
  if (!fs::exists(fs::symlink_status(data::idx_path(prefix), ec)) &&
      !fs::exists(fs::symlink_status(set_aside_name(data::idx_path(prefix)), ec)))
    return false;
  if (!fs::is_directory(path, ec)) return true;
  // A directory PREFIX beside PREFIX.idx is the dataset's own when it holds only the index cache training writes there
  // (PREFIX/cache/GPTDataset_indices); anything else makes it a checkpoint or model directory of the same name.
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename() != "cache") return false;
  return !ec;
}

Status inspect_dataset(const std::string& path, const InspectOptions& options) {
  auto opened = data::IndexedDataset::open(data::dataset_prefix(path));
  if (!opened.ok()) return opened.status();
  const auto& d = *opened;
  std::uint64_t shortest = 0, longest = 0;
  for (std::size_t doc = 0; doc < d.document_count(); ++doc) {
    std::uint64_t tokens = 0;
    for (auto s = d.document_index(doc); s < d.document_index(doc + 1); ++s)
      tokens += static_cast<std::uint64_t>(d.sequence_length(static_cast<std::size_t>(s)));
    shortest = doc == 0 ? tokens : std::min(shortest, tokens);
    longest = std::max(longest, tokens);
  }
  const double mean =
      d.document_count() ? static_cast<double>(d.token_count()) / static_cast<double>(d.document_count()) : 0.0;
  const std::uint64_t bytes = d.token_count() * data::token_dtype_size(d.dtype());
  if (options.as_json) {
    nlohmann::ordered_json out = {{"format", "megatron-indexed-dataset"},
                                  {"prefix", d.prefix()},
                                  {"dtype", data::token_dtype_name(d.dtype())},
                                  {"sequences", d.sequence_count()},
                                  {"documents", d.document_count()},
                                  {"tokens", d.token_count()},
                                  {"bin_bytes", bytes},
                                  {"multimodal", d.multimodal()},
                                  {"document_tokens", {{"min", shortest}, {"max", longest}, {"mean", mean}}}};
    std::cout << out.dump(2) << "\n";
    return OkStatus();
  }
  std::cout << "Megatron indexed dataset " << printable_text(d.prefix()) << " (.idx + .bin)\n"
            << "  dtype      " << data::token_dtype_name(d.dtype()) << "\n"
            << "  sequences  " << d.sequence_count() << "\n"
            << "  documents  " << d.document_count() << "\n"
            << "  tokens     " << d.token_count() << " (" << format_bytes(bytes) << ")\n"
            << "  document   " << shortest << " to " << longest << " tokens, mean " << mean << "\n";
  if (d.multimodal()) std::cout << "  modes      present (multimodal)\n";
  return OkStatus();
}

}  // namespace trestle::cli
