// trestle inspect for Trestle checkpoints: iterations, layout, model, tensors and (with --chunks) every chunk.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <vector>

#include "ckpt/byte_size.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/checkpoint_path.h"
#include "ckpt/checksum.h"
#include "ckpt/load.h"
#include "ckpt/printable_text.h"
#include "convert/lora_convert.h"
#include "parallel/layout/parallel_layout.h"
#include "tools/inspect.h"
#include "tools/table.h"

namespace trestle::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

// The kept model in one line for people: architecture, pattern (hybrids) and Megatron sizes; any other description
// as its JSON. Fields of the wrong type read as '?' (the manifest comes from a file).
std::string describe_model(const nlohmann::json& model) {
  const auto megatron = model.is_object() ? model.find("megatron") : model.end();
  if (!model.is_object() || megatron == model.end() || !megatron->is_object()) return model.dump();
  const nlohmann::json& m = *megatron;
  auto number = [&](const char* key) {
    const auto it = m.find(key);
    return it != m.end() && it->is_number_integer() ? std::to_string(it->get<std::int64_t>()) : std::string("?");
  };
  const auto arch = model.find("architecture");
  std::string out = (arch != model.end() && arch->is_string() ? arch->get<std::string>() : std::string("GPT")) + ": " +
                    number("num_layers") + " layers";
  if (const auto p = m.find("hybrid_override_pattern"); p != m.end() && p->is_string())
    out += " (" + p->get<std::string>().substr(0, 200) + ")";
  out += ", hidden " + number("hidden_size") + ", ffn " + number("ffn_hidden_size") + ", heads " +
         number("num_attention_heads") + " (" + number("num_query_groups") + " KV groups), vocab " + number("vocab_size");
  if (m.contains("num_experts") && m["num_experts"].is_number_integer())
    out += ", " + number("num_experts") + " experts (top-" + number("moe_router_topk") + ")";
  return out + "; the whole description: inspect --json";
}

// The xxh3-64 of a tensor's bytes (its stored dtype, row-major), read whole through the load planner, which checks
// every block's checksum on the way: a corrupt block fails naming the tensor and the file.
Result<std::string> tensor_digest(const CheckpointReader& reader, const std::string& name, const TensorEntry& t) {
  std::vector<std::byte> data(static_cast<std::size_t>(numel(t.global_shape)) * dtype_size(t.dtype));
  const LoadRequest request{name, Piece{whole_box(t.global_shape), std::nullopt}, data.data()};
  if (!data.empty()) TRESTLE_RETURN_IF_ERROR(reader.load({&request, 1}));
  return to_hex(xxh3_64(data));
}

}  // namespace

bool is_trestle_checkpoint(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  // (a root before its first commit too: its reader says that nothing is committed there yet)
  return fs::exists(p / kTrackerFile, ec) || fs::exists(p / kManifestFile, ec) || !list_iterations(path).empty() ||
         holds_uncommitted_save(path);
}

Status inspect_trestle(const std::string& path, const InspectOptions& options) {
  auto reader = open_checkpoint_path(path, std::nullopt);
  if (!reader.ok()) {
    return reader.status();
  }
  const Manifest& m = reader->manifest();
  const std::string root = fs::path(reader->directory()).parent_path().string();
  std::uint64_t total_bytes = 0, stored_bytes = 0, params = 0, chunk_count = 0;
  json tensors = json::array();
  for (const auto& [name, t] : m.tensors) {
    const std::uint64_t bytes = static_cast<std::uint64_t>(numel(t.global_shape)) * dtype_size(t.dtype);
    std::uint64_t stored = 0;
    json chunks = json::array();
    for (const auto& c : t.chunks) {
      stored += c.stored_bytes;
      if (options.chunks || options.as_json) chunks.push_back(json::parse(chunk_to_json(c).dump()));
    }
    total_bytes += bytes;
    stored_bytes += stored;
    params += static_cast<std::uint64_t>(numel(t.global_shape));
    chunk_count += t.chunks.size();
    json entry = {{"name", name},   {"dtype", dtype_name(t.dtype)}, {"global_shape", t.global_shape},
                  {"bytes", bytes}, {"stored_bytes", stored},       {"chunks", t.chunks.size()}};
    if (options.checksums) {
      auto digest = tensor_digest(*reader, name, t);
      if (!digest.ok()) return digest.status();
      entry["xxh3_64"] = *digest;
    }
    if (!chunks.empty()) entry["chunk_table"] = chunks;
    tensors.push_back(std::move(entry));
  }
  const auto layout = layout_from_json(m.layout, reader->directory() + "/manifest.json");
  if (!layout.ok()) return layout.status();
  const ParallelLayout& l = *layout;
  // Its identity: the manifest's digest, and (a model's) the weights origin a reshard carries and LoRA checks.
  const std::string manifest_path = reader->directory() + "/" + kManifestFile;
  TRESTLE_ASSIGN_OR_RETURN(const std::string digest, manifest_file_digest(manifest_path));
  const bool adapters = is_adapter_checkpoint(*reader);
  const auto origin = adapters ? Result<std::string>(std::string()) : weights_origin_digest(m.training, manifest_path);
  if (options.as_json) {
    json out = {{"format", "trestle"},
                {"path", reader->directory()},
                {"iteration", m.iteration},
                {"iterations", list_iterations(root)},
                {"world_size", m.world_size},
                {"layout", layout_sizes_to_json(l)},
                {"model", m.model},
                {"manifest_xxh3_64", digest},
                {"tensors", tensors},
                {"totals",
                 {{"tensors", m.tensors.size()},
                  {"parameters", params},
                  {"bytes", total_bytes},
                  {"stored_bytes", stored_bytes},
                  {"chunks", chunk_count}}}};
    if (!adapters) out["weights_origin_xxh3_64"] = origin.ok() ? json(*origin) : json(nullptr);
    if (const auto from = m.training.find("resharded_from"); from != m.training.end()) out["resharded_from"] = *from;
    std::cout << out.dump(2) << "\n";
    return OkStatus();
  }
  std::string iterations;
  for (auto i : list_iterations(root)) iterations += (iterations.empty() ? "" : ", ") + std::to_string(i);
  std::printf("Trestle checkpoint: %s\n", printable_text(reader->directory()).c_str());
  std::printf("iteration     %lld (committed: %s)\n", static_cast<long long>(m.iteration), iterations.c_str());
  const std::string etp = l.expert_tp() != l.tp ? ", etp " + std::to_string(l.expert_tp()) : "";
  // A pipeline layout string's split (Megatron's --pipeline-model-parallel-layout) is the model's, not the sizes'.
  std::string split;
  if (const auto parallel = m.model.find("parallel"); parallel != m.model.end() && parallel->is_object())
    if (const auto chunks = parallel->find("chunk_layers"); chunks != parallel->end() && chunks->is_array())
      for (const auto& n : *chunks) split += (split.empty() ? ", layers per virtual stage " : " ") + n.dump();
  std::printf("layout        tp %d, pp %d, vpp %d, dp %d, ep %d%s, cp %d (world size %d)%s\n", l.tp, l.pp, l.vpp,
              l.dp(), l.ep, etp.c_str(), l.cp, m.world_size, printable_text(split).c_str());
  if (adapters) std::printf("%s", describe_adapter_checkpoint(*reader).c_str());
  std::printf("manifest      xxh3 %s", digest.c_str());
  if (!adapters)
    std::printf(", weights origin %s",
                origin.ok() ? origin->c_str() : printable_text(origin.status().message()).c_str());
  std::printf("\n");
  if (!m.model.empty()) std::printf("model         %s\n", printable_text(describe_model(m.model)).c_str());
  std::printf("\n");
  std::vector<std::string> header = {"name", "dtype", "global shape", "bytes", "stored", "chunks"};
  if (options.checksums) header.push_back("xxh3_64");
  Table table(header);
  for (const auto& t : tensors) {
    std::vector<std::string> row = {t["name"],
                                    t["dtype"],
                                    to_string(t["global_shape"].get<Shape>()),
                                    std::to_string(t["bytes"].get<std::uint64_t>()),
                                    std::to_string(t["stored_bytes"].get<std::uint64_t>()),
                                    std::to_string(t["chunks"].get<std::size_t>())};
    if (options.checksums) row.push_back(t["xxh3_64"]);
    table.add(std::move(row));
    if (options.chunks)
      for (const auto& c : t["chunk_table"]) {
        Piece p{Box{c["offset"].get<Shape>(), c["shape"].get<Shape>()}, std::nullopt};
        if (c.contains("flat")) p.flat = FlatRange{c["flat"][0].get<std::int64_t>(), c["flat"][1].get<std::int64_t>()};
        std::vector<std::string> chunk_row = {
            "  " + to_string(p),
            c["codec"],
            c["file"].get<std::string>() + " @" + std::to_string(c["byte_offset"].get<std::uint64_t>()),
            "",
            std::to_string(c["stored_bytes"].get<std::uint64_t>()),
            ""};
        table.add(std::move(chunk_row));
      }
  }
  table.print(stdout, {false, false, false, true, true, true, false});
  std::printf("\ntotal         %zu tensors, %llu parameters, %s (%s stored) in %llu chunks\n", m.tensors.size(),
              static_cast<unsigned long long>(params), format_bytes(total_bytes).c_str(),
              format_bytes(stored_bytes).c_str(), static_cast<unsigned long long>(chunk_count));
  return OkStatus();
}

}  // namespace trestle::cli
