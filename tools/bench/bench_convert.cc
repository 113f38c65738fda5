// trestle bench convert: a generated Llama-shaped bf16 Hugging Face model converted to a Megatron TP/PP layout (a
// Trestle checkpoint or Megatron-Core's torch_dist) and back, by Trestle and, for Trestle checkpoints, by a
// straightforward Python script with safetensors + torch (tools/bench/peers/megatron_convert_peer.py), in alternating
// rounds, beside the disk floor measured with fio in the same run. Each conversion runs as a child process so its wall
// time and peak RSS are its own; sources are read cold unless --warm-sources (then read into the page cache first).
#include <algorithm>
#include <cstring>
#include <cxxopts.hpp>
#include <iostream>
#include <nlohmann/json.hpp>

#include "ckpt/byte_size.h"
#include "convert/formats/safetensors/safetensors_checkpoint.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_files.h"
#include "tools/bench/bench_fio.h"
#include "tools/bench/bench_main.h"
#include "tools/bench/bench_model.h"
#include "tools/bench/bench_options.h"
#include "tools/bench/bench_peer.h"
#include "tools/bench/bench_process.h"
#include "tools/bench/bench_report.h"
#include "tools/bench/bench_state_dict.h"
#include "tools/table.h"

namespace trestle::cli {
namespace {

using json = nlohmann::json;

constexpr BenchOptionSet kOptionSet{
    .size = "2GB", .size_help = "model size", .repeat = 1, .peer_help = "the Python peer"};

struct Options : BenchOptions {
  int tp = 2;
  int pp = 2;
  int ep = 1;
  // or "deepseek", "glm4_moe", "qwen3_next", "nemotron_h", "gemma4", "qwen3_vl", "gemma3_vl"
  std::string arch = "llama";
  std::string to = "trestle";  // or "megatron-dist"
  bool warm_sources = false;   // each conversion's source read into the page cache first: the write path alone
};

// Every tensor of b equals a's, byte for byte.
Status check_identical(const std::string& a_dir, const std::string& b_dir) {
  TRESTLE_ASSIGN_OR_RETURN(auto a, SafetensorsCheckpoint::open(a_dir));
  TRESTLE_ASSIGN_OR_RETURN(auto b, SafetensorsCheckpoint::open(b_dir));
  if (a.names() != b.names()) return Status::Error(b_dir + ": holds other tensors than " + a_dir);
  for (const auto& name : a.names()) {
    TRESTLE_ASSIGN_OR_RETURN(auto x, a.view(name));
    TRESTLE_ASSIGN_OR_RETURN(auto y, b.view(name));
    if (x.dtype != y.dtype || x.shape != y.shape || std::memcmp(x.data, y.data, x.nbytes()) != 0)
      return Status::Error(b_dir + ": '" + name + "' differs from the source");
  }
  return OkStatus();
}

struct Contender {
  Samples to_megatron, to_hf;
  std::uint64_t rss_to_megatron = 0, rss_to_hf = 0;
  std::uint64_t bytes_megatron = 0;
  double script_to_megatron = 1e300, script_to_hf = 1e300;  // python: best seconds inside the script (no start-up)
};

Status run_bench(const Options& o) {
  TRESTLE_ASSIGN_OR_RETURN(ScratchDir scratch, ScratchDir::create(o.dir));
  TRESTLE_ASSIGN_OR_RETURN(const std::string trestle_cli, trestle_exe());
  LlamaShape shape;
  DeepSeekShape ds;
  GlmShape glm;
  Qwen3NextShape next;
  NemotronHShape nemotron;
  Gemma4Shape gemma4;
  Qwen3VlShape vl;
  Gemma3VlShape g3vl;
  std::string model_name;
  if (o.arch == "deepseek") {
    TRESTLE_ASSIGN_OR_RETURN(ds, deepseek_shape_for_layout(o.size, o.tp, o.pp, o.ep));
    model_name = "DeepSeek-V3-shaped (hidden " + std::to_string(ds.hidden) + ", " + std::to_string(ds.layers) +
                 " layers, " + std::to_string(ds.experts) + " experts of ffn " + std::to_string(ds.expert_ffn) +
                 ", MLA)";
  } else if (o.arch == "glm4_moe") {
    TRESTLE_ASSIGN_OR_RETURN(glm, glm_shape_for_layout(o.size, o.tp, o.pp, o.ep));
    model_name = "GLM-4.5-shaped (hidden " + std::to_string(glm.hidden) + ", " + std::to_string(glm.layers) +
                 " layers, " + std::to_string(glm.experts) + " experts of ffn " + std::to_string(glm.expert_ffn) +
                 ", partial RoPE)";
  } else if (o.arch == "qwen3_next") {
    TRESTLE_ASSIGN_OR_RETURN(next, qwen3_next_shape_for_layout(o.size, o.tp, o.pp, o.ep));
    model_name = "Qwen3-Next-shaped (hidden " + std::to_string(next.hidden) + ", " + std::to_string(next.layers) +
                 " layers of Gated DeltaNet / gated attention, " + std::to_string(next.experts) + " experts of ffn " +
                 std::to_string(next.expert_ffn) + ")";
  } else if (o.arch == "nemotron_h") {
    TRESTLE_ASSIGN_OR_RETURN(nemotron, nemotron_h_shape_for_layout(o.size, o.tp, o.pp));
    model_name = "Nemotron-H-shaped (hidden " + std::to_string(nemotron.hidden) + ", " +
                 std::to_string(nemotron.layers) + " layers " + nemotron.pattern() + ": Mamba-2, MLP, attention)";
  } else if (o.arch == "gemma4") {
    TRESTLE_ASSIGN_OR_RETURN(gemma4, gemma4_shape_for_layout(o.size, o.tp, o.pp));
    model_name = "Gemma-4-shaped (hidden " + std::to_string(gemma4.hidden) + ", " + std::to_string(gemma4.layers) +
                 " layers, the last " + std::to_string(gemma4.kv_shared) +
                 " sharing keys and values, per-layer inputs, keys as values in the full-attention layers)";
  } else if (o.arch == "qwen3_vl") {
    TRESTLE_ASSIGN_OR_RETURN(vl, qwen3_vl_shape_for_layout(o.size, o.tp, o.pp));
    model_name = "Qwen3-VL-shaped (hidden " + std::to_string(vl.hidden) + ", " + std::to_string(vl.layers) +
                 " layers, a vision tower of " + std::to_string(vl.depth) + " blocks of hidden " +
                 std::to_string(vl.vision_hidden) + " with its mergers)";
  } else if (o.arch == "gemma3_vl") {
    TRESTLE_ASSIGN_OR_RETURN(g3vl, gemma3_vl_shape_for_layout(o.size, o.tp, o.pp));
    model_name = "Gemma-3-with-vision-shaped (hidden " + std::to_string(g3vl.hidden) + ", " +
                 std::to_string(g3vl.layers) + " layers, a SigLIP vision tower of " + std::to_string(g3vl.depth) +
                 " layers of hidden " + std::to_string(g3vl.vision_hidden) + " and the projector)";
  } else {
    TRESTLE_ASSIGN_OR_RETURN(shape, llama_shape_for_layout(o.size, o.tp, o.pp));
    model_name = "Llama (hidden " + std::to_string(shape.hidden) + ", " + std::to_string(shape.layers) + " layers)";
  }
  // The Python peer converts Llama checkpoints to its own Trestle-layout files only.
  const bool python_peer = o.python && o.arch == "llama" && o.to == "trestle";
  std::string python, script;
  if (python_peer) {
    TRESTLE_ASSIGN_OR_RETURN(python, find_python(o.python_path));
    TRESTLE_ASSIGN_OR_RETURN(script, peer_script(o.peers_dir, "megatron_convert_peer.py"));
  }
  std::string fio_name;
  if (o.fio) {
    TRESTLE_ASSIGN_OR_RETURN(fio_name, fio_version());
  }
  const std::string source = scratch.fresh("hf");
  progress("generating a " + model_name + " bf16 model in " + source);
  TRESTLE_RETURN_IF_ERROR(o.arch == "deepseek"   ? write_deepseek_hf_model(source, ds)
                          : o.arch == "glm4_moe"   ? write_glm_hf_model(source, glm)
                          : o.arch == "qwen3_next" ? write_qwen3_next_hf_model(source, next)
                          : o.arch == "nemotron_h" ? write_nemotron_h_hf_model(source, nemotron)
                          : o.arch == "gemma4"     ? write_gemma4_hf_model(source, gemma4)
                          : o.arch == "qwen3_vl"   ? write_qwen3_vl_hf_model(source, vl)
                          : o.arch == "gemma3_vl"  ? write_gemma3_vl_hf_model(source, g3vl)
                                                   : write_llama_hf_model(source, shape));
  const std::uint64_t model_bytes = bytes_on_disk(source);
  const std::uint64_t copies = 3 + (python_peer ? 2 : 0) + (o.fio ? 1 : 0);
  TRESTLE_ASSIGN_OR_RETURN(const std::uint64_t available, free_bytes(scratch.path()));
  if (available < copies * model_bytes)
    return Status::Error(scratch.path() + ": " + format_bytes(available) + " free, the benchmark needs about " +
                         format_bytes(copies * model_bytes) + "; use --dir on a larger disk or a smaller --size");
  FioCeiling ceiling;
  if (o.fio) {
    progress("fio ceiling (" + fio_name + ") on " + format_bytes(model_bytes));
    TRESTLE_ASSIGN_OR_RETURN(ceiling, measure_fio_ceiling(scratch.fresh("fio.dat"), model_bytes));
  }

  const std::string tp = std::to_string(o.tp), pp = std::to_string(o.pp), ep = std::to_string(o.ep);
  Contender trestle, peer;
  for (unsigned round = 0; round < o.repeat; ++round) {
    const std::string ckpt = scratch.fresh(o.to), back = scratch.fresh(o.to + "-hf");
    TRESTLE_RETURN_IF_ERROR(o.warm_sources ? load_into_page_cache(source) : evict_from_page_cache(source));
    progress("round " + std::to_string(round + 1) + ": trestle hf -> " + o.to + " tp" + tp + "/pp" + pp);
    TRESTLE_ASSIGN_OR_RETURN(auto a, run_child_ok({trestle_cli, "convert", "--from", "hf", source, "--to", o.to,
                                                   ckpt, "--tp", tp, "--pp", pp, "--ep", ep, "--quiet"}));
    trestle.to_megatron.add(a.seconds, model_bytes);
    trestle.rss_to_megatron = std::max(trestle.rss_to_megatron, a.peak_rss);
    trestle.bytes_megatron = bytes_on_disk(ckpt);
    TRESTLE_RETURN_IF_ERROR(o.warm_sources ? load_into_page_cache(ckpt) : evict_from_page_cache(ckpt));
    progress("round " + std::to_string(round + 1) + ": trestle " + o.to + " tp" + tp + "/pp" + pp + " -> hf");
    TRESTLE_ASSIGN_OR_RETURN(
        auto b, run_child_ok({trestle_cli, "convert", "--from", o.to, ckpt, "--to", "hf", back, "--quiet"}));
    trestle.to_hf.add(b.seconds, model_bytes);
    trestle.rss_to_hf = std::max(trestle.rss_to_hf, b.peak_rss);
    TRESTLE_RETURN_IF_ERROR(check_identical(source, back));
    if (!python_peer) continue;
    const std::string pdir = scratch.fresh("python"), pback = scratch.fresh("python-hf");
    TRESTLE_RETURN_IF_ERROR(o.warm_sources ? load_into_page_cache(source) : evict_from_page_cache(source));
    progress("round " + std::to_string(round + 1) + ": python hf -> tp" + tp + "/pp" + pp);
    TRESTLE_ASSIGN_OR_RETURN(auto c,
                             run_child_ok({python, script, "to-megatron", source, pdir, "--tp", tp, "--pp", pp}));
    peer.to_megatron.add(c.seconds, model_bytes);
    peer.rss_to_megatron = std::max(peer.rss_to_megatron, c.peak_rss);
    peer.script_to_megatron = std::min(peer.script_to_megatron, json::parse(c.out)["seconds"].get<double>());
    peer.bytes_megatron = bytes_on_disk(pdir);
    TRESTLE_RETURN_IF_ERROR(o.warm_sources ? load_into_page_cache(pdir) : evict_from_page_cache(pdir));
    progress("round " + std::to_string(round + 1) + ": python tp" + tp + "/pp" + pp + " -> hf");
    TRESTLE_ASSIGN_OR_RETURN(auto d, run_child_ok({python, script, "to-hf", pdir, pback}));
    peer.to_hf.add(d.seconds, model_bytes);
    peer.rss_to_hf = std::max(peer.rss_to_hf, d.peak_rss);
    peer.script_to_hf = std::min(peer.script_to_hf, json::parse(d.out)["seconds"].get<double>());
    TRESTLE_RETURN_IF_ERROR(check_identical(source, pback));
  }

  // The disk floor of each direction: bytes read at fio's read rate (none when the sources are warm) plus bytes
  // written at its write rate.
  auto floor_s = [&](std::uint64_t read, std::uint64_t written) {
    return o.fio ? (o.warm_sources ? 0.0 : static_cast<double>(read) / ceiling.read_bytes_per_s) +
                       static_cast<double>(written) / ceiling.write_bytes_per_s
                 : 0.0;
  };
  // The share of fio's write rate a direction sustains: bytes written per second over fio's (1.0: disk speed).
  auto of_write_rate = [&](std::uint64_t written, double t) {
    return o.fio && t > 0 ? format_ratio(static_cast<double>(written) / t, ceiling.write_bytes_per_s)
                          : std::string("-");
  };
  const double floor_to_megatron = floor_s(model_bytes, trestle.bytes_megatron);
  const double floor_to_hf = floor_s(trestle.bytes_megatron, model_bytes);
  auto seconds = [](const Samples& s) { return s.empty() ? 0.0 : 1.0 / s.best(); };  // per GB of model (best round)
  const double gb = static_cast<double>(model_bytes) / 1e9;
  std::printf("\nmodel: %s bf16 %s, hf <-> %s tp%s/pp%s/ep%s; best of %u round(s); sources %s\n",
              format_bytes(model_bytes).c_str(), model_name.c_str(), o.to.c_str(), tp.c_str(), pp.c_str(), ep.c_str(),
              o.repeat, o.warm_sources ? "warm (in the page cache)" : "cold");
  if (o.python && !python_peer)
    std::printf("python peer: not run (it converts Llama checkpoints only, to Trestle's layout)\n");
  if (o.fio)
    std::printf("disk (fio): write %.2f GB/s, read %.2f GB/s\n", ceiling.write_bytes_per_s / 1e9,
                ceiling.read_bytes_per_s / 1e9);
  Table table({"direction", "contender", "seconds", "GB/s", "peak RSS", "floor s", "x floor", "of fio write",
               "python / trestle"});
  auto add_row = [&](const std::string& dir, const std::string& who, double t, const std::string& rate,
                     std::uint64_t rss, double floor, std::uint64_t written, double python_t) {
    table.add({dir, who, std::to_string(t).substr(0, 6), rate, format_bytes(rss),
               o.fio ? std::to_string(floor).substr(0, 6) : "-", o.fio ? format_ratio(t, floor) : "-",
               of_write_rate(written, t), python_t > 0 ? format_ratio(python_t, t) : "-"});
  };
  const std::string layout = "tp" + tp + "/pp" + pp + (o.ep > 1 ? "/ep" + ep : "");
  const double t_megatron = seconds(trestle.to_megatron) * gb, t_hf = seconds(trestle.to_hf) * gb;
  const double p_megatron = python_peer ? seconds(peer.to_megatron) * gb : 0,
               p_hf = python_peer ? seconds(peer.to_hf) * gb : 0;
  auto rate = [&](double t) { return std::to_string(gb / t).substr(0, 4); };
  add_row("hf -> " + layout, "trestle", t_megatron, format_rate(trestle.to_megatron, false), trestle.rss_to_megatron,
          floor_to_megatron, trestle.bytes_megatron, p_megatron);
  if (python_peer)
    add_row("hf -> " + layout, "python (safetensors+torch)", p_megatron, format_rate(peer.to_megatron, false),
            peer.rss_to_megatron, floor_to_megatron, peer.bytes_megatron, 0);
  add_row(layout + " -> hf", "trestle", t_hf, format_rate(trestle.to_hf, false), trestle.rss_to_hf, floor_to_hf,
          model_bytes, p_hf);
  if (python_peer)
    add_row(layout + " -> hf", "python (safetensors+torch)", p_hf, format_rate(peer.to_hf, false), peer.rss_to_hf,
            floor_to_hf, model_bytes, 0);
  // The round trip: both directions' best times added (the model is read and written twice).
  add_row("round trip", "trestle", t_megatron + t_hf, rate((t_megatron + t_hf) / 2),
          std::max(trestle.rss_to_megatron, trestle.rss_to_hf), floor_to_megatron + floor_to_hf,
          trestle.bytes_megatron + model_bytes, p_megatron + p_hf);
  if (python_peer)
    add_row("round trip", "python (safetensors+torch)", p_megatron + p_hf, rate((p_megatron + p_hf) / 2),
            std::max(peer.rss_to_megatron, peer.rss_to_hf), floor_to_megatron + floor_to_hf,
            peer.bytes_megatron + model_bytes, 0);
  table.print(stdout, {false, false, true, true, true, true, true, true, true});
  if (python_peer)
    std::printf("python, best seconds inside the script (without interpreter start-up and imports): %.2f and %.2f\n",
                peer.script_to_megatron, peer.script_to_hf);
  std::printf("round trips byte-identical to the source: yes (checked every round)\n");
  // The memory target: peak RSS within twice the largest tensor plus 256 MiB.
  std::uint64_t largest = 0;
  {
    TRESTLE_ASSIGN_OR_RETURN(auto files, SafetensorsCheckpoint::open(source));
    for (const auto& name : files.names()) {
      TRESTLE_ASSIGN_OR_RETURN(const auto view, files.view(name));
      largest = std::max<std::uint64_t>(largest, view.nbytes());
    }
  }
  const std::uint64_t rss_bound = 2 * largest + (std::uint64_t{256} << 20);
  const std::uint64_t rss = std::max(trestle.rss_to_megatron, trestle.rss_to_hf);
  std::printf("trestle peak RSS %s; bound 2 x largest tensor (%s) + 256 MiB = %s: %s\n", format_bytes(rss).c_str(),
              format_bytes(largest).c_str(), format_bytes(rss_bound).c_str(), rss <= rss_bound ? "met" : "NOT met");
  if (o.fio)
    std::printf(
        "floor = bytes read / fio read rate (0 with --warm-sources) + bytes written / fio write rate; a converter\n"
        "that overlaps its reads and writes can beat that sum (its hard floor is the larger of the two terms);\n"
        "of fio write = bytes written per second / fio's write rate\n");

  if (!o.json_out.empty()) {
    json report = {{"benchmark", "convert"},
                   {"arch", o.arch},
                   {"to", o.to},
                   {"warm_sources", o.warm_sources},
                   {"model", model_name},
                   {"ep", o.ep},
                   {"model_bytes", model_bytes},
                   {"largest_tensor_bytes", largest},
                   {"peak_rss_bound", rss_bound},
                   {"tp", o.tp},
                   {"pp", o.pp},
                   {"machine", machine_facts()},
                   {"trestle",
                    {{"to_megatron", trestle.to_megatron.to_json()},
                     {"to_hf", trestle.to_hf.to_json()},
                     {"peak_rss_to_megatron", trestle.rss_to_megatron},
                     {"peak_rss_to_hf", trestle.rss_to_hf}}}};
    if (python_peer)
      report["python"] = {{"to_megatron", peer.to_megatron.to_json()},
                          {"to_hf", peer.to_hf.to_json()},
                          {"peak_rss_to_megatron", peer.rss_to_megatron},
                          {"peak_rss_to_hf", peer.rss_to_hf},
                          {"script_seconds", {peer.script_to_megatron, peer.script_to_hf}},
                          {"python_over_trestle",
                           {{"to_megatron", p_megatron / t_megatron},
                            {"to_hf", p_hf / t_hf},
                            {"round_trip", (p_megatron + p_hf) / (t_megatron + t_hf)}}}};
    if (o.fio)
      report["fio"] = {{"version", fio_name},
                       {"write_gb_per_s", ceiling.write_bytes_per_s / 1e9},
                       {"read_gb_per_s", ceiling.read_bytes_per_s / 1e9},
                       {"floor_seconds", {floor_to_megatron, floor_to_hf}},
                       {"share_of_write_rate",
                        {static_cast<double>(trestle.bytes_megatron) / t_megatron / ceiling.write_bytes_per_s,
                         static_cast<double>(model_bytes) / t_hf / ceiling.write_bytes_per_s}}};
    TRESTLE_RETURN_IF_ERROR(write_json_file(o.json_out, report));
  }
  return OkStatus();
}

Result<Options> parse_options(const cxxopts::ParseResult& args) {
  Options o;
  TRESTLE_ASSIGN_OR_RETURN(static_cast<BenchOptions&>(o), parse_bench_options(args, kOptionSet));
  o.tp = args["tp"].as<int>();
  o.pp = args["pp"].as<int>();
  o.ep = args["ep"].as<int>();
  o.arch = args["arch"].as<std::string>();
  o.to = args["to"].as<std::string>();
  o.warm_sources = args["warm-sources"].as<bool>();
  if (o.to != "trestle" && o.to != "megatron-dist")
    return Status::Error("--to " + o.to + ": trestle or megatron-dist");
  if (o.tp < 1 || o.pp < 1 || o.ep < 1) return Status::Error("--tp, --pp and --ep must be at least 1");
  if (o.arch != "llama" && o.arch != "deepseek" && o.arch != "glm4_moe" && o.arch != "qwen3_next" &&
      o.arch != "nemotron_h" && o.arch != "gemma4" && o.arch != "qwen3_vl" && o.arch != "gemma3_vl")
    return Status::Error("--arch " + o.arch +
                         ": llama, deepseek, glm4_moe, qwen3_next, nemotron_h, gemma4, qwen3_vl or gemma3_vl");
  if (o.arch == "gemma4" && o.to != "trestle")
    return Status::Error("--arch gemma4 --to " + o.to + ": Gemma 4 converts to Trestle checkpoints only (torch_dist "
                         "cannot hold its layers)");
  return o;
}

}  // namespace

int bench_convert_main(int argc, char** argv) {
  cxxopts::Options spec(
      "trestle bench convert",
      "Convert a generated Llama- (or DeepSeek-V3-, GLM-4.5-, Qwen3-Next-, Nemotron-H-, Gemma-4-, Qwen3-VL- or\n"
      "Gemma-3-with-vision-) shaped bf16\n"
      "Hugging Face "
      "model to a Megatron TP/PP(/EP) layout (a Trestle checkpoint, or torch_dist with --to megatron-dist) and\n"
      "back:\n"
      "Trestle against a straightforward Python conversion with safetensors + torch (Trestle checkpoints),\n"
      "beside the disk floor (bytes read / fio read rate + bytes written / fio write rate) and the share of\n"
      "fio's write rate each direction sustains. Each conversion runs as its own process (wall time, peak\n"
      "RSS); sources are evicted from the page cache, or with --warm-sources read into it first.");
  spec.add_options()("tp", "tensor parallel size", cxxopts::value<int>()->default_value("2"))(
      "pp", "pipeline parallel size", cxxopts::value<int>()->default_value("2"))(
      "ep", "expert parallel size (MoE models)", cxxopts::value<int>()->default_value("1"))(
      "arch",
      "the generated model: llama; deepseek (DeepSeek-V3-shaped: multi-latent attention, one dense layer, MoE "
      "layers of 64 small experts plus a shared one); or glm4_moe (GLM-4.5-shaped: grouped-query attention with "
      "biases, q/k norms and RoPE over half of each head, the same MoE layers); or qwen3_next (Qwen3-Next-shaped: "
      "Gated DeltaNet layers at the real widths, every 4th layer gated full attention, MoE of 32 small experts and a "
      "gated shared one); or nemotron_h (Nemotron-H-shaped: Mamba-2 layers at Nemotron-H's widths, squared-ReLU "
      "MLP layers, attention every 7th layer); or gemma4 (Gemma-4-shaped at the E4B's widths: per-layer inputs, "
      "KV sharing with a double-wide MLP, keys as values in the full-attention layers); or qwen3_vl (Qwen3-VL-shaped "
      "at the 4B's widths: Qwen3 language layers beside the vision tower's blocks and mergers, carried whole on the "
      "first stage); or gemma3_vl (Gemma-3-with-vision-shaped at the 4B's widths: Gemma 3 language layers beside a "
      "SigLIP vision tower and the multi-modal projector). The Python peer converts Llama only",
      cxxopts::value<std::string>()->default_value("llama"))(
      "to",
      "the Megatron side: trestle (a Trestle checkpoint) or megatron-dist (Megatron-Core's torch_dist, the "
      "Python peer not run)",
      cxxopts::value<std::string>()->default_value("trestle"))(
      "warm-sources",
      "read each conversion's source into the page cache first (the write path alone; the floor counts writes only)",
      cxxopts::value<bool>()->default_value("false"));
  add_bench_options(spec, kOptionSet);
  return run_bench_main<Options>("trestle bench convert", spec, parse_options, run_bench, argc, argv);
}

}  // namespace trestle::cli
