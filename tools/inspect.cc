// trestle inspect PATH: what a checkpoint holds (architecture, tensors, totals), as a table or as JSON.
#include "tools/inspect.h"

#include <cxxopts.hpp>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "ckpt/byte_size.h"
#include "ckpt/checksum.h"
#include "ckpt/printable_text.h"
#include "convert/bridge/architectures.h"
#include "convert/bridge/hf_config.h"
#include "convert/bridge/hf_side_files.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "convert/formats/torch/megatron_legacy.h"
#include "convert/lora_convert.h"
#include "convert/peft_files.h"
#include "convert/sources/hf_model.h"
#include "tools/command.h"
#include "tools/table.h"

namespace trestle::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

// What the Megatron bridge makes of the model: its family and Megatron tensors, or why it cannot convert it.
json bridge_summary(const HfModelConfig& c) {
  auto model = bridge_model_from_config(c);
  if (!model.ok()) return {{"convertible", false}, {"reason", model.status().message()}};
  const GptModelSpec spec = megatron_spec(*model, NormNaming::kTransformerEngine);
  auto tensors = canonical_tensors(spec);
  json out = {{"convertible", tensors.ok()}, {"family", model->family}};
  if (!tensors.ok()) out["reason"] = tensors.status().message();
  else out["megatron_tensors"] = tensors->size();
  out["megatron_model"] = model->nemotron_h() ? "MambaModel" : "GPT";
  if (model->nemotron_h()) out["hybrid_override_pattern"] = model->hybrid_layers;
  if (model->gemma4) {  // the layers that differ: their attention sizes, keys as values, shared keys and values
    json layers = json::array();
    for (std::int64_t i = 0; i < spec.num_layers; ++i)
      layers.push_back({{"head_dim", spec.layer_kv_channels_of(i)},
                        {"kv_heads", spec.layer_query_groups_of(i)},
                        {"attention", spec.layer_kv_shared(i) ? "shared keys and values"
                                      : spec.layer_k_eq_v(i)  ? "keys as values"
                                                              : "keys and values"},
                        {"window", spec.layer_has_window(i)}});
    out["gemma4_layers"] = std::move(layers);
    out["per_layer_input_size"] = spec.per_layer_input_size;
  }
  // Quantised weights: FP8 blocks and MXFP4 are dequantised to bfloat16 on the way, other quantisations refused.
  if (const auto q = hf_quantization(c.raw, "config.json"); !q.ok()) {
    out = {{"convertible", false}, {"family", model->family}, {"reason", q.status().message()}};
  } else if (q->any()) {
    out["dequantised_to_bf16"] = q->kind == HfQuantization::Kind::kFp8 ? "fp8" : "mxfp4";
  }
  return out;
}

void print_bridge(const json& b) {
  if (!b["convertible"].get<bool>()) {
    std::printf("bridge        not convertible: %s\n", printable_text(b["reason"].get<std::string>()).c_str());
    return;
  }
  const std::string pattern =
      b.contains("hybrid_override_pattern") ? " (layers " + b["hybrid_override_pattern"].get<std::string>() + ")" : "";
  if (b.contains("gemma4_layers")) {
    // Runs of alike layers: "0-2 head dim 256, 8 kv heads, window; 3 head dim 512, 2 kv heads, keys as values; ..."
    std::string runs;
    const json& layers = b["gemma4_layers"];
    for (std::size_t i = 0; i < layers.size();) {
      std::size_t j = i;
      while (j + 1 < layers.size() && layers[j + 1] == layers[i]) ++j;
      const json& l = layers[i];
      runs += (runs.empty() ? "" : "; ") + std::to_string(i) + (j > i ? "-" + std::to_string(j) : "") + " head dim " +
              l["head_dim"].dump() + ", " + l["kv_heads"].dump() + " kv heads, " + l["attention"].get<std::string>() +
              (l["window"].get<bool>() ? ", window" : "");
      i = j + 1;
    }
    std::printf("layers        %s; per-layer inputs %lld wide\n", runs.c_str(),
                static_cast<long long>(b["per_layer_input_size"].get<std::int64_t>()));
  }
  std::printf("bridge        %s family -> Megatron-Core %s%s, %lld canonical Megatron tensors%s\n",
              b["family"].get<std::string>().c_str(), b["megatron_model"].get<std::string>().c_str(),
              printable_text(pattern).c_str(), static_cast<long long>(b["megatron_tensors"].get<std::int64_t>()),
              b.contains("dequantised_to_bf16")
                  ? (" (" + b["dequantised_to_bf16"].get<std::string>() + " weights dequantised to bf16)").c_str()
                  : "");
}

json config_summary(const HfModelConfig& c) {
  json out = {{"architecture", c.architecture},
              {"model_type", c.model_type},
              {"num_layers", c.num_layers},
              {"hidden_size", c.hidden_size},
              {"ffn_hidden_size", c.intermediate_size},
              {"num_attention_heads", c.num_attention_heads},
              {"num_kv_heads", c.num_kv_heads},
              {"head_dim", c.head_dim},
              {"vocab_size", c.vocab_size},
              {"tie_word_embeddings", c.tie_word_embeddings},
              {"dtype", c.dtype}};
  if (c.num_experts) {
    out["num_experts"] = c.num_experts;
    out["experts_per_token"] = c.experts_per_token;
  }
  out["bridge"] = bridge_summary(c);
  return out;
}

void print_config(const HfModelConfig& c) {
  std::printf("architecture  %s (%s)\n", printable_text(c.architecture).c_str(), printable_text(c.model_type).c_str());
  std::printf(
      "sizes         layers %lld, hidden %lld, ffn %lld, heads %lld, kv heads %lld, head dim %lld, vocab %lld\n",
      (long long)c.num_layers, (long long)c.hidden_size, (long long)c.intermediate_size,
      (long long)c.num_attention_heads, (long long)c.num_kv_heads, (long long)c.head_dim, (long long)c.vocab_size);
  if (c.num_experts)
    std::printf("experts       %lld, top-%lld\n", (long long)c.num_experts, (long long)c.experts_per_token);
  std::printf("embeddings    %s\n", c.tie_word_embeddings ? "tied" : "untied");
  if (!c.dtype.empty()) std::printf("dtype         %s\n", printable_text(c.dtype).c_str());
  print_bridge(bridge_summary(c));
}

}  // namespace

Status inspect_safetensors(const std::string& path, const InspectOptions& options) {
  std::error_code links_ec;
  if (fs::is_directory(path, links_ec)) TRESTLE_RETURN_IF_ERROR(check_hf_dir_links(path));  // as convert does
  auto ckpt = SafetensorsCheckpoint::open(path);
  if (!ckpt.ok()) return ckpt.status();
  std::optional<HfModelConfig> config;
  std::error_code ec;
  const std::string config_path =
      (fs::is_directory(path, ec) ? fs::path(path) : fs::path(path).parent_path()) / "config.json";
  if (fs::exists(config_path, ec)) {
    auto parsed = read_hf_config(config_path);
    if (!parsed.ok()) {
      return parsed.status();
    }
    config = std::move(parsed).value();
  }

  json tensors = json::array();
  std::map<std::string, std::uint64_t> params_by_dtype;
  std::uint64_t total_bytes = 0, total_params = 0;
  for (const auto& name : ckpt->names()) {
    const auto at = ckpt->find(name).value();
    const auto& e = *at.entry;
    json t = {{"name", name},
              {"dtype", dtype_name(e.dtype)},
              {"shape", e.shape},
              {"bytes", e.nbytes()},
              {"file", fs::path(at.file->path()).filename().string()}};
    if (options.checksums) t["xxh3_64"] = to_hex(xxh3_64(at.file->view(e).bytes()));
    tensors.push_back(std::move(t));
    params_by_dtype[std::string(dtype_name(e.dtype))] += static_cast<std::uint64_t>(numel(e.shape));
    total_bytes += e.nbytes();
    total_params += static_cast<std::uint64_t>(numel(e.shape));
  }

  if (options.as_json) {
    json out = {{"format", "safetensors"}, {"path", path}};
    if (config) out["config"] = config_summary(*config);
    json files = json::array();
    for (const auto& f : ckpt->files())
      files.push_back({{"file", fs::path(f.path()).filename().string()},
                       {"bytes", f.file_size()},
                       {"tensors", f.tensors().size()},
                       {"metadata", f.metadata()}});
    out["files"] = files;
    out["tensors"] = tensors;
    out["totals"] = {{"tensors", ckpt->size()},
                     {"parameters", total_params},
                     {"bytes", total_bytes},
                     {"parameters_by_dtype", params_by_dtype}};
    std::cout << out.dump(2) << "\n";
    return OkStatus();
  }

  std::printf("Hugging Face safetensors checkpoint: %s\n", printable_text(path).c_str());
  std::printf("files         %zu%s\n", ckpt->files().size(),
              ckpt->index_path().empty()
                  ? ""
                  : printable_text(" (index " + fs::path(ckpt->index_path()).filename().string() + ")").c_str());
  if (config) print_config(*config);
  std::printf("\n");
  std::vector<std::string> header = {"name", "dtype", "shape", "bytes", "file"};
  if (options.checksums) header.push_back("xxh3_64");
  Table table(header);
  for (const auto& t : tensors) {
    std::vector<std::string> row = {t["name"], t["dtype"], to_string(t["shape"].get<Shape>()),
                                    std::to_string(t["bytes"].get<std::uint64_t>()), t["file"]};
    if (options.checksums) row.push_back(t["xxh3_64"]);
    table.add(std::move(row));
  }
  table.print(stdout, {false, false, false, true, false});
  std::string dtypes;
  for (const auto& [dtype, n] : params_by_dtype)
    dtypes += (dtypes.empty() ? "" : ", ") + dtype + " " + std::to_string(n);
  std::printf("\ntotal         %zu tensors, %llu parameters (%s), %s\n", ckpt->size(), (unsigned long long)total_params,
              dtypes.c_str(), format_bytes(total_bytes).c_str());
  return OkStatus();
}

namespace {

// A Hugging Face PEFT LoRA adapter: its configuration and what its weights file adapts.
Status inspect_peft(const std::string& path, const InspectOptions& options) {
  TRESTLE_ASSIGN_OR_RETURN(const json s, summarize_peft_dir(path));
  if (options.as_json) {
    std::cout << s.dump(2) << "\n";
    return OkStatus();
  }
  std::printf("Hugging Face PEFT LoRA adapter: %s\n", printable_text(path).c_str());
  std::printf("rank          %lld, alpha %g (scale %g), dropout %g\n",
              static_cast<long long>(s["r"].get<std::int64_t>()), s["lora_alpha"].get<double>(),
              s["lora_alpha"].get<double>() / s["r"].get<double>(), s["lora_dropout"].get<double>());
  std::printf("targets       %s\n", printable_text(s["target_modules"].dump()).c_str());
  if (!s["target_parameters"].empty())
    std::printf("parameters    %s\n", printable_text(s["target_parameters"].dump()).c_str());
  if (!s["rank_pattern"].empty()) std::printf("other ranks   %s\n", printable_text(s["rank_pattern"].dump()).c_str());
  std::printf("base model    %s\n", printable_text(s["base_model_name_or_path"].get<std::string>()).c_str());
  std::printf("adapted       %zu modules, %zu tensors, %s\n", s["modules"].get<std::size_t>(),
              s["tensors"].get<std::size_t>(), format_bytes(s["bytes"].get<std::uint64_t>()).c_str());
  return OkStatus();
}

void declare_inspect(cxxopts::Options& spec) {
  spec.add_options()("json", "print machine-readable JSON instead of tables")(
      "checksums", "read every tensor and print its xxh3-64 digest")(
      "chunks", "list every stored chunk of every tensor (Trestle checkpoints)")("path", "checkpoint to inspect",
                                                                                 cxxopts::value<std::string>());
  spec.parse_positional({"path"});
  spec.positional_help("PATH");
}

Outcome run_inspect(const cxxopts::ParseResult& args) {
  if (!args.count("path")) return usage_error("PATH is required");
  if (Outcome usage = check_paths_not_empty(args, {{"path", "PATH"}}); usage.code != kExitOk) return usage;
  const InspectOptions options{args.count("json") > 0, args.count("checksums") > 0, args.count("chunks") > 0};
  const auto path = args["path"].as<std::string>();
  Status status;
  if (is_indexed_dataset(path)) {
    status = inspect_dataset(path, options);
  } else if (is_torch_dist_checkpoint(path)) {
    status = inspect_torch_dist(path, options);
  } else if (is_legacy_checkpoint(path)) {
    status = inspect_legacy(path, options);
  } else if (is_peft_dir(path)) {
    status = inspect_peft(path, options);
  } else {
    status = is_trestle_checkpoint(path) ? inspect_trestle(path, options) : inspect_safetensors(path, options);
  }
  return status.ok() ? finished() : failure(status);
}

}  // namespace

const CommandSpec kInspectCommand = {
    .name = "inspect",
    .summary = "show a checkpoint's architecture, tensors and totals",
    .description =
        "Show what a checkpoint holds: architecture and sizes (from config.json), every tensor\n"
        "(name, dtype, shape, bytes, file) and totals.\n\n"
        "PATH is a .safetensors file, a Hugging Face directory (sharded with an index, or one file), or a\n"
        "Trestle checkpoint (its root, showing the latest iteration, or one iter_N directory), a Megatron torch_dist\n"
        "(PyTorch DCP) directory, a Megatron legacy tree (root with tracker, iter_N, mp_rank_* files), or a\n"
        "Hugging Face PEFT LoRA adapter directory (adapter_config.json). An adapter checkpoint of `trestle train\n"
        "--lora-rank` shows its rank, alpha, type, targets and base.",
    .declare = declare_inspect,
    .run = run_inspect,
};

}  // namespace trestle::cli
