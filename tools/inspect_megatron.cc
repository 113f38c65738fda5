// trestle inspect for Megatron checkpoints: torch_dist (PyTorch DCP) directories and legacy mp_rank_* trees.
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "ckpt/byte_size.h"
#include "ckpt/checksum.h"
#include "ckpt/printable_text.h"
#include "convert/formats/torch/dcp_checkpoint.h"
#include "convert/formats/torch/megatron_legacy.h"
#include "convert/sources/canonical_source.h"
#include "tools/inspect.h"
#include "tools/table.h"

namespace trestle::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

// The model the bridge maps the checkpoint to (canonical_source.h), or why it cannot.
json mapped_model(CheckpointFormat format, const std::string& path) {
  auto source = open_canonical_source(format, path, {});
  if (!source.ok()) return {{"error", source.status().message()}};
  const BridgedModel& b = (*source)->model();
  const auto& c = b.model.hf;
  return {{"architecture", b.model.architecture},
          {"num_layers", c.num_layers},
          {"hidden_size", c.hidden_size},
          {"num_attention_heads", c.num_attention_heads},
          {"num_query_groups", c.num_kv_heads},
          {"vocab_size", c.vocab_size},
          {"num_experts", c.num_experts},
          {"layout", layout_to_json(b.layout)},
          {"canonical_tensors", (*source)->tensors().size()}};
}

void print_mapped_model(const json& m) {
  if (m.contains("error")) {
    std::printf("model         not mapped: %s\n", printable_text(m["error"].get<std::string>()).c_str());
    return;
  }
  std::printf(
      "model         %s, %lld layers, hidden %lld, %lld heads (%lld KV groups), vocab %lld%s; %zu canonical "
      "tensors; layout %s\n",
      printable_text(m["architecture"].get<std::string>()).c_str(), (long long)m["num_layers"].get<std::int64_t>(),
      (long long)m["hidden_size"].get<std::int64_t>(), (long long)m["num_attention_heads"].get<std::int64_t>(),
      (long long)m["num_query_groups"].get<std::int64_t>(), (long long)m["vocab_size"].get<std::int64_t>(),
      m["num_experts"].get<std::int64_t>()
          ? (", " + std::to_string(m["num_experts"].get<std::int64_t>()) + " experts").c_str()
          : "",
      m["canonical_tensors"].get<std::size_t>(), m["layout"].dump().c_str());
}

}  // namespace

bool is_torch_dist_checkpoint(const std::string& path) {
  const auto format = detect_format(path);
  return format.ok() && *format == CheckpointFormat::kTorchDist;
}

Status inspect_torch_dist(const std::string& root, const InspectOptions& options) {
  const auto located = torch_dist_iteration_dir(root, std::nullopt);  // a root: its latest iteration
  if (!located.ok()) return located.status();
  const std::string path = located->first;
  auto opened = DcpCheckpoint::open(path);
  if (!opened.ok()) return opened.status();
  const DcpCheckpoint& ckpt = *opened;
  const DcpMetadata& md = ckpt.metadata();

  json tensors = json::array();
  std::uint64_t total_bytes = 0, total_params = 0;
  for (const auto& t : md.tensors) {
    const std::uint64_t bytes = static_cast<std::uint64_t>(numel(t.shape)) * dtype_size(t.dtype);
    json entry = {{"name", t.name},
                  {"dtype", dtype_name(t.dtype)},
                  {"shape", t.shape},
                  {"bytes", bytes},
                  {"chunk_count", t.chunks.size()}};
    if (options.chunks || options.as_json) {
      json chunks = json::array();
      for (const auto& c : t.chunks)
        chunks.push_back({{"offset", c.box.offset},
                          {"shape", c.box.shape},
                          {"file", c.storage.file},
                          {"byte_offset", c.storage.offset},
                          {"length", c.storage.length}});
      entry["chunks"] = chunks;
    }
    if (options.checksums) {
      std::vector<std::byte> data(bytes);
      if (Status s = ckpt.read_box(t.name, whole_box(t.shape), data.data()); !s.ok()) return s;
      entry["xxh3_64"] = to_hex(xxh3_64(data));
    }
    total_bytes += bytes;
    total_params += static_cast<std::uint64_t>(numel(t.shape));
    tensors.push_back(std::move(entry));
  }
  json objects = json::array();
  for (const auto& b : md.bytes) {
    json entry = {
        {"name", b.name}, {"file", b.storage.file}, {"byte_offset", b.storage.offset}, {"length", b.storage.length}};
    auto object = ckpt.read_object(b);
    if (object.ok()) entry["value"] = pickle_to_json(object->root());
    else entry["value_error"] = object.status().message();
    objects.push_back(std::move(entry));
  }

  if (options.as_json) {
    json out = {{"format", "torch_dist"},
                {"path", path},
                {"dcp_version", md.version},
                {"module", md.module},
                {"files", ckpt.files()}};
    if (ckpt.megatron_metadata()) out["metadata_json"] = *ckpt.megatron_metadata();
    if (ckpt.common_state()) out["common_state"] = pickle_to_json(ckpt.common_state()->root());
    out["model"] = mapped_model(CheckpointFormat::kTorchDist, path);
    out["tensors"] = tensors;
    out["objects"] = objects;
    out["totals"] = {{"tensors", md.tensors.size()},
                     {"objects", md.bytes.size()},
                     {"parameters", total_params},
                     {"bytes", total_bytes}};
    std::cout << out.dump(2) << "\n";
    return OkStatus();
  }
  std::printf("Megatron torch_dist (PyTorch DCP) checkpoint: %s\n", printable_text(path).c_str());
  std::printf("dcp version   %s (%s)\n", md.version.empty() ? "(none)" : printable_text(md.version).c_str(),
              printable_text(md.module).c_str());
  std::printf("files         %zu\n", ckpt.files().size());
  if (ckpt.megatron_metadata())
    std::printf("metadata.json %s\n", printable_text(ckpt.megatron_metadata()->dump()).c_str());
  if (ckpt.common_state())
    std::printf("common.pt     %s\n", printable_text(pickle_repr(ckpt.common_state()->root(), 300)).c_str());
  print_mapped_model(mapped_model(CheckpointFormat::kTorchDist, path));
  std::printf("\n");
  std::vector<std::string> header = {"name", "dtype", "shape", "bytes", "chunks"};
  if (options.checksums) header.push_back("xxh3_64");
  Table table(header);
  for (const auto& t : tensors) {
    std::vector<std::string> row = {t["name"], t["dtype"], to_string(t["shape"].get<Shape>()),
                                    std::to_string(t["bytes"].get<std::uint64_t>()),
                                    std::to_string(t["chunk_count"].get<std::size_t>())};
    if (options.checksums) row.push_back(t["xxh3_64"]);
    table.add(std::move(row));
  }
  table.print(stdout, {false, false, false, true, true});
  if (options.chunks)
    for (const auto& t : md.tensors)
      for (const auto& c : t.chunks)
        std::printf("  %s %s  %s @%llu +%llu\n", printable_text(t.name).c_str(), to_string(c.box).c_str(),
                    printable_text(c.storage.file).c_str(), (unsigned long long)c.storage.offset,
                    (unsigned long long)c.storage.length);
  for (const auto& o : objects)
    std::printf(
        "object  %s: %s\n", printable_text(o["name"].get<std::string>()).c_str(),
        printable_text(o.contains("value") ? o["value"].dump().substr(0, 200) : o["value_error"].get<std::string>())
            .c_str());
  std::printf("\ntotal         %zu tensors, %llu parameters, %s; %zu objects\n", md.tensors.size(),
              (unsigned long long)total_params, format_bytes(total_bytes).c_str(), md.bytes.size());
  return OkStatus();
}

Status inspect_legacy(const std::string& path, const InspectOptions& options) {
  auto found = find_legacy_checkpoint(path);
  if (!found.ok()) return found.status();
  json ranks = json::array();
  for (const auto& [id, file] : found->rank_files) {
    auto rank = LegacyRankFile::open(file, id);
    if (!rank.ok()) return rank.status();
    json tensors = json::array();
    for (const auto& t : rank->tensors()) {
      json entry = {{"name", t.name},
                    {"dtype", dtype_name(t.ref.dtype)},
                    {"shape", t.ref.shape},
                    {"bytes", static_cast<std::uint64_t>(numel(t.ref.shape)) * dtype_size(t.ref.dtype)},
                    {"contiguous", t.ref.contiguous()}};
      if (options.checksums) {
        std::vector<std::byte> data(entry["bytes"].get<std::uint64_t>());
        if (Status s = rank->read(t.name, data.data()); !s.ok()) return s;
        entry["xxh3_64"] = to_hex(xxh3_64(data));
      }
      tensors.push_back(std::move(entry));
    }
    json r = {{"tp", id.tp}, {"pp", id.pp}, {"ep", id.ep}, {"file", file}, {"model_keys", rank->model_keys()}};
    if (auto it = rank->iteration()) r["iteration"] = *it;
    if (auto v = rank->checkpoint_version()) r["checkpoint_version"] = *v;
    if (const PickleValue* args = rank->args()) r["args"] = pickle_to_json(args->state ? args->state : args);
    r["tensors"] = tensors;
    ranks.push_back(std::move(r));
  }
  if (options.as_json) {
    json out = {{"format", "megatron_legacy"}, {"path", path}, {"directory", found->directory}};
    if (found->iteration) out["iteration"] = *found->iteration;
    out["model"] = mapped_model(CheckpointFormat::kLegacy, path);
    out["ranks"] = ranks;
    std::cout << out.dump(2) << "\n";
    return OkStatus();
  }
  std::printf("Megatron legacy checkpoint: %s\n", printable_text(found->directory).c_str());
  if (found->iteration) std::printf("iteration     %lld\n", (long long)*found->iteration);
  print_mapped_model(mapped_model(CheckpointFormat::kLegacy, path));
  for (const auto& r : ranks) {
    std::printf("\nrank tp %d pp %d ep %d: %s (model keys %s)\n", r["tp"].get<int>(), r["pp"].get<int>(),
                r["ep"].get<int>(), printable_text(r["file"].get<std::string>()).c_str(),
                printable_text(r["model_keys"].dump()).c_str());
    Table table({"name", "dtype", "shape", "bytes"});
    for (const auto& t : r["tensors"])
      table.add(
          {t["name"], t["dtype"], to_string(t["shape"].get<Shape>()), std::to_string(t["bytes"].get<std::uint64_t>())});
    table.print(stdout, {false, false, false, true});
  }
  return OkStatus();
}

}  // namespace trestle::cli
