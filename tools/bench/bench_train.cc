// bench train: tokens/s of `trestle train` (trestle-train, tp1/dp1 on --threads threads) training a Llama of about 100M
// parameters from scratch beside the same model (transformers' LlamaForCausalLM built from the same config.json),
// batch sizes and optimizer (AdamW, clipping at 1.0) trained by PyTorch eager in Python on the same threads
// (tools/bench/peers/train_peer.py), alternating, in the same run. Both read the shipped corpus tokenized into an
// indexed dataset. The figure of each side is its median iteration after --warmup iterations; prints the table, writes
// JSON. --device cuda runs both sides on the GPU instead; the device is always passed to trestle-train, whose own
// default (cuda when a GPU is visible) would otherwise set a GPU trainer beside a CPU peer.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cxxopts.hpp>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/byte_size.h"
#include "ckpt/status.h"
#include "tools/bench/bench.h"
#include "tools/bench/bench_families.h"
#include "tools/bench/bench_options.h"
#include "tools/bench/bench_peer.h"
#include "tools/bench/bench_process.h"
#include "tools/bench/bench_report.h"
#include "tools/parse_error.h"
#include "tools/self_exe.h"

namespace trestle::cli {
namespace {

namespace fs = std::filesystem;

std::string family_list() {
  std::string list;
  for (const auto& f : bench_families()) list += (list.empty() ? "" : ", ") + f;
  return list;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// `trestle-train train` on the bench's model and corpus: constant lr, a log line per iteration into `log`; with
// --no-fused-kernels in `args`, ATen's composites instead of the fused kernels.
std::vector<std::string> train_command(const cxxopts::ParseResult& args, const std::string& trainer,
                                       const fs::path& dir, const std::string& data, const std::string& seq,
                                       const std::string& mbs, const std::string& gbs, int iters,
                                       const std::string& log, const std::string& device,
                                       const std::vector<std::string>& extra = {}) {
  std::vector<std::string> command{trainer,
                                   "train",
                                   "--model-config",
                                   (dir / "config.json").string(),
                                   "--data-path",
                                   data,
                                   "--split",
                                   "98,2,0",
                                   "--seq-length",
                                   seq,
                                   "--micro-batch-size",
                                   mbs,
                                   "--global-batch-size",
                                   gbs,
                                   "--train-iters",
                                   std::to_string(iters),
                                   "--lr",
                                   "1e-4",
                                   "--lr-decay-style",
                                   "constant",
                                   "--log-interval",
                                   "1",
                                   "--eval-iters",
                                   "0",
                                   "--log-json",
                                   log,
                                   "--device",
                                   device};
  if (args.count("no-fused-kernels")) command.push_back("--no-fused-kernels");
  command.insert(command.end(), extra.begin(), extra.end());
  return command;
}

// One `trestle train` run's figures: median seconds per iteration after warmup, the first loss, and per pipeline stage
// the median share of the iteration spent waiting on other stages.
struct TrainRun {
  double seconds = 0;
  double first_loss = 0;
  std::vector<double> idle;
};

Result<TrainRun> read_train_log(const std::string& log, int warmup) {
  std::ifstream lines(log);
  std::string line;
  int i = 0;
  std::vector<double> seconds;
  std::vector<std::vector<double>> idle;
  TrainRun run;
  while (std::getline(lines, line)) {
    const auto record = nlohmann::json::parse(line);
    if (!record.contains("iteration") || record.contains("validation")) continue;
    if (i == 0) run.first_loss = record["lm_loss"].get<double>();
    if (++i <= warmup) continue;
    seconds.push_back(record["elapsed_time_per_iteration_ms"].get<double>() / 1000.0);
    if (record.contains("pipeline_idle_share")) {
      const auto shares = record["pipeline_idle_share"].get<std::vector<double>>();
      idle.resize(shares.size());
      for (std::size_t s = 0; s < shares.size(); ++s) idle[s].push_back(shares[s]);
    }
  }
  if (seconds.empty()) return Status::Error(log + ": no iteration after the warmup");
  run.seconds = median(seconds);
  for (auto& stage : idle) run.idle.push_back(median(stage));
  return run;
}

// bench train --pp N: the same model trained with N pipeline stages (1F1B, and interleaved with 2 chunks per stage
// when the layers divide), and unpipelined, on this machine's CPUs; per stage the measured idle share beside the
// bubble model, and each layout's tokens/s.
int bench_train_pipeline(const cxxopts::ParseResult& args, const std::string& trainer, const fs::path& dir,
                         const std::string& data) {
  const int pp = args["pp"].as<int>(), micro_batches = args["micro-batches"].as<int>();
  const int threads = args["threads"].as<int>(), iters = args["iters"].as<int>(), warmup = args["warmup"].as<int>();
  const int layers = args["layers"].as<int>(), mbs = args["micro-batch-size"].as<int>();
  const std::string device = args["device"].as<std::string>();
  if (micro_batches < 1) {
    std::cerr << "bench train: --micro-batches must be at least 1\n";
    return 2;
  }
  struct Layout {
    std::string name;
    int stages = 1;
    int chunks = 1;
  };
  std::vector<Layout> layouts{{"pp1", 1, 1}, {"pp" + std::to_string(pp) + " 1F1B", pp, 1}};
  if (layers % (2 * pp) == 0 && micro_batches % pp == 0)
    layouts.push_back({"pp" + std::to_string(pp) + " interleaved (2 chunks)", pp, 2});
  const std::string gbs = std::to_string(micro_batches * mbs);
  std::vector<TrainRun> runs;
  for (const Layout& layout : layouts) {
    progress("trestle train, " + layout.name);
    const std::string log = (dir / ("pipeline_" + std::to_string(runs.size()) + ".jsonl")).string();
    // Each worker gets its share of the threads.
    ::setenv("OMP_NUM_THREADS", std::to_string(std::max(1, threads / layout.stages)).c_str(), 1);
    std::vector<std::string> command =
        train_command(args, trainer, dir, data, std::to_string(args["seq-length"].as<int>()), std::to_string(mbs), gbs,
                      iters, log, device);
    for (const char* flag : {"--nproc-per-node", "--pipeline-model-parallel-size"}) {
      command.push_back(flag);
      command.push_back(std::to_string(layout.stages));
    }
    if (layout.chunks > 1) {
      command.push_back("--num-virtual-stages-per-pipeline-rank");
      command.push_back(std::to_string(layout.chunks));
    }
    auto run = run_child_ok(command);
    if (!run.ok()) {
      std::cerr << "bench train: trestle train (" << layout.name << "): " << run.status().message() << "\n";
      return 1;
    }
    auto figures = read_train_log(log, warmup);
    if (!figures.ok()) {
      std::cerr << "bench train: " << figures.status().message() << "\n";
      return 1;
    }
    runs.push_back(*figures);
  }
  const double tokens = std::stod(gbs) * args["seq-length"].as<int>();
  std::printf("bench train --pp %d: Llama (hidden %d, %d layers, ffn %d), seq %d, %d micro-batches of %d, fp32, %s\n",
              pp, args["hidden"].as<int>(), layers, args["ffn"].as<int>(), args["seq-length"].as<int>(), micro_batches,
              mbs, device == "cpu" ? (std::to_string(threads) + " threads").c_str() : "cuda");
  std::printf("  %-32s %12s %12s %12s\n", "layout", "s/iteration", "tokens/s", "first loss");
  for (std::size_t i = 0; i < layouts.size(); ++i)
    std::printf("  %-32s %12.3f %12.1f %12.4f\n", layouts[i].name.c_str(), runs[i].seconds, tokens / runs[i].seconds,
                runs[i].first_loss);
  nlohmann::ordered_json layouts_json = nlohmann::json::array();
  for (std::size_t i = 0; i < layouts.size(); ++i) {
    const Layout& l = layouts[i];
    // Megatron's bubble: (p - 1) / (v·m) of the ideal time, i.e. (p - 1) / (v·m + p - 1) of the iteration.
    const double m = micro_batches, p = l.stages, v = l.chunks;
    const double bubble = (p - 1) / (v * m), bubble_share = (p - 1) / (v * m + p - 1);
    nlohmann::ordered_json entry = {{"layout", l.name},
                                    {"pp", l.stages},
                                    {"chunks", l.chunks},
                                    {"iteration_seconds", runs[i].seconds},
                                    {"tokens_per_s", tokens / runs[i].seconds},
                                    {"bubble_model", bubble},
                                    {"bubble_model_share", bubble_share},
                                    {"idle_share_per_stage", runs[i].idle}};
    layouts_json.push_back(entry);
    if (l.stages == 1) continue;
    std::printf("  %s: bubble model (p-1)/(v*m) = %.3f of the ideal time = %.1f%% of the iteration\n", l.name.c_str(),
                bubble, bubble_share * 100);
    std::printf("    %-8s %12s %14s %16s\n", "stage", "busy s/iter", "idle (measured)", "idle (model)");
    for (std::size_t s = 0; s < runs[i].idle.size(); ++s)
      std::printf("    %-8zu %12.3f %13.1f%% %15.1f%%\n", s, runs[i].seconds * (1 - runs[i].idle[s]),
                  runs[i].idle[s] * 100, bubble_share * 100);
  }
  if (threads < pp && device == "cpu")
    std::printf("  note: %d stages share %d threads, so stages also wait for a CPU, not only for each other\n", pp,
                threads);
  nlohmann::ordered_json out = {{"bench", "train-pipeline"},
                                {"machine", machine_facts()},
                                {"threads", threads},
                                {"device", device},
                                {"pp", pp},
                                {"micro_batches", micro_batches},
                                {"micro_batch_size", mbs},
                                {"seq_length", args["seq-length"].as<int>()},
                                {"layers", layers},
                                {"warmup", warmup},
                                {"layouts", layouts_json}};
  if (auto s = write_json_file(report_path(args), out); !s.ok()) {
    std::cerr << "bench train: " << s.message() << "\n";
    return 1;
  }
  return 0;
}

// --preset: the shapes the GPU figures are quoted for. Options given on the command line win over the preset's.
struct TrainPreset {
  std::string arch;
  int hidden, layers, ffn, heads, kv_heads, vocab, seq, micro, global, experts, topk;
};
const std::map<std::string, TrainPreset>& train_presets() {
  static const std::map<std::string, TrainPreset> presets = {
      // TinyLlama 1.1B's shape, and its batch per GPU and optimizer step: 64 sequences of 2048 tokens (its pretraining
      // script: a global batch of 512 over 8 GPUs, micro-batches of 8 accumulated 8 times), here as 16 micro-batches of
      // 4. (Until 2026-12-05 the preset's global batch was 8: `--global-batch-size 8` gives that.)
      {"llama-1b", {"llama", 2048, 22, 5632, 32, 4, 32000, 2048, 4, 64, 8, 2}},
      // A small Mixtral: 8 experts of ffn 2816, top-2, ~0.9B parameters (~0.3B active).
      {"mixtral-small", {"mixtral", 1024, 12, 2816, 16, 8, 32000, 2048, 4, 8, 8, 2}},
  };
  return presets;
}

// Dense bf16 peak TFLOP/s of the GPU models MFU is quoted against (NVIDIA's data sheets, without sparsity); 0 when the
// name is not one of them.
double gpu_bf16_peak_tflops(const std::string& name) {
  const auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("H100") || has("H200") || has("H800") || has("GH200"))
    return has("PCIe") ? 756.0 : has("NVL") ? 835.0 : 989.4;
  if (has("B200")) return 2250.0;
  if (has("B100")) return 1750.0;
  if (has("A100") || has("A800")) return 312.0;
  if (has("L40S")) return 362.1;
  if (has("A10G")) return 70.0;
  return 0.0;
}

// The GPU's name as PyTorch reports it.
Result<std::string> cuda_device_name(const std::string& python) {
  TRESTLE_ASSIGN_OR_RETURN(auto run, run_child_ok({python, "-c", "import torch; print(torch.cuda.get_device_name())"}));
  std::string name = run.out;
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (const auto nl = name.rfind('\n'); nl != std::string::npos) name = name.substr(nl + 1);
  return name;
}

}  // namespace

int bench_train_main(int argc, char** argv) {
  cxxopts::Options spec(
      "bench train",
      "tokens/s of `trestle train` beside PyTorch eager (transformers' model, torch.optim.AdamW) training\n"
      "the same model (a ~100M-parameter Llama by default; --arch picks the family) from scratch with the\n"
      "same batch sizes on the same threads, alternating, in the same run; the median iteration after\n"
      "warmup of each side, and the ratio.\n"
      "With --pp N: the model trained unpipelined, with N stages (1F1B) and interleaved, each stage's\n"
      "measured idle share beside Megatron's bubble model (p-1)/(v*m), and each layout's tokens/s.\n"
      "With --preset llama-1b (TinyLlama's shape: hidden 2048, 22 layers, ffn 5632, 32 heads, 4 KV heads,\n"
      "vocab 32000, seq 2048, bf16) or mixtral-small (8 experts, top-2, grouped GEMM, bf16): the GPU\n"
      "benchmark, e.g. `trestle bench train --device cuda --preset llama-1b`; MFU by Megatron's FLOP\n"
      "formula against the GPU's dense bf16 peak (named in the output; --peak-tflops overrides), and each\n"
      "side's peak memory. With the grouped GEMM (the MoE preset on a GPU, or --moe-grouped-gemm), Trestle\n"
      "is timed with one GEMM per expert too: the grouped GEMM's gain.");
  spec.add_options()("threads", "CPU threads for both sides", cxxopts::value<int>()->default_value("2"))(
      "device", "where both sides train: cpu or cuda", cxxopts::value<std::string>()->default_value("cpu"))(
      "iters", "iterations per run", cxxopts::value<int>()->default_value("6"))(
      "warmup", "iterations left out of the figures", cxxopts::value<int>()->default_value("2"))(
      "rounds", "alternating rounds (trestle, python)", cxxopts::value<int>()->default_value("1"))(
      "seq-length", "tokens per sample", cxxopts::value<int>()->default_value("256"))(
      "micro-batch-size", "samples per micro-batch", cxxopts::value<int>()->default_value("1"))(
      "global-batch-size", "samples per iteration (gradient accumulation)", cxxopts::value<int>()->default_value("2"))(
      "hidden", "hidden size", cxxopts::value<int>()->default_value("768"))(
      "layers", "layers", cxxopts::value<int>()->default_value("12"))("ffn", "MLP hidden size",
                                                                      cxxopts::value<int>()->default_value("2048"))(
      "heads", "attention heads", cxxopts::value<int>()->default_value("12"))(
      "kv-heads", "key/value heads", cxxopts::value<int>()->default_value("12"))(
      "arch", "the model family: " + family_list() + " (each with its own options, trained from scratch)",
      cxxopts::value<std::string>()->default_value("llama"))(
      "experts", "MoE families: experts per layer (--ffn is each expert's)", cxxopts::value<int>()->default_value("8"))(
      "topk", "MoE families: experts per token", cxxopts::value<int>()->default_value("2"))(
      "vocab", "vocabulary size", cxxopts::value<int>()->default_value("4096"))(
      "preset", "llama-1b or mixtral-small: the shapes, batch and bf16 of the GPU figures (flags given win)",
      cxxopts::value<std::string>()->default_value(""))(
      "bf16",
      "both sides train in bfloat16 (Trestle: --bf16 with fp32 master weights; PyTorch: a bf16 model, "
      "AdamW fused on a GPU)")("moe-grouped-gemm", "MoE families: Trestle's experts as one grouped GEMM")(
      "peak-tflops", "peak TFLOP/s of the device for MFU (default on a GPU: its dense bf16 peak)",
      cxxopts::value<double>())(
      "no-fused-kernels",
      "Trestle's side trains with `trestle train --no-fused-kernels`: ATen's composites for its fused kernels (the "
      "fused kernels' end-to-end gain: run with and without)")(
      "with-composites",
      "Trestle's side also runs with --no-fused-kernels in each round: a row beside the fused run, and the fused "
      "kernels' end-to-end gain")("python", "the venv's python for the peer (default: the project's venv)",
                                  cxxopts::value<std::string>()->default_value(""))(
      "peers-dir", "where the Python peers are (default: bench/peers beside this program)",
      cxxopts::value<std::string>()->default_value(""))(
      "pp", "pipeline mode: compare N pipeline stages with the unpipelined run (no Python peer)",
      cxxopts::value<int>()->default_value("1"))("micro-batches", "pipeline mode: micro-batches per iteration (m)",
                                                 cxxopts::value<int>()->default_value("8"))(
      "profile",
      "after the timed runs, one more of the trainer under PyTorch's profiler over the first two timed iterations: "
      "its Chrome trace (with each operator's input shapes) into this folder and its GPU kernels (CPU operators) by "
      "time printed, and on a GPU the kernels' time by the operation and inputs that launched them",
      cxxopts::value<std::string>())(
      "data-path",
      "an indexed dataset (`trestle preprocess`'s prefix, ids below --vocab) to train both sides on, instead of the "
      "bundled corpus tokenized here (for a machine whose trestle cannot run the Hugging Face tokenizer)",
      cxxopts::value<std::string>()->default_value(""))(
      "json", "write the results here", cxxopts::value<std::string>()->default_value("bench_train.json"))(
      "json-out", "the same as --json", cxxopts::value<std::string>())("h,help", "show this help");
  try {
    const auto args = spec.parse(argc, argv);
    if (args.count("help")) {
      std::cout << spec.help() << "\n";
      return 0;
    }
    if (!args.unmatched().empty()) {
      std::cerr << "bench train: unexpected argument '" << args.unmatched().front() << "'\n";
      return 2;
    }
    const int threads = args["threads"].as<int>(), iters = args["iters"].as<int>(), warmup = args["warmup"].as<int>();
    const int rounds = args["rounds"].as<int>();
    const std::string device = args["device"].as<std::string>();
    if (device != "cpu" && device != "cuda") {
      std::cerr << "bench train: --device " << device << ": cpu or cuda\n";
      return 2;
    }
    if (threads < 1 || iters <= warmup || warmup < 0 || rounds < 1) {
      std::cerr << "bench train: --threads and --rounds must be at least 1, --iters above --warmup\n";
      return 2;
    }
    if (const Status s = check_report_writable(report_path(args)); !s.ok()) {
      std::cerr << "bench train: " << s.message() << "\n";
      return 2;
    }
    const std::string preset_name = args["preset"].as<std::string>();
    const TrainPreset* preset = nullptr;
    if (!preset_name.empty()) {
      const auto it = train_presets().find(preset_name);
      if (it == train_presets().end()) {
        std::cerr << "bench train: --preset " << preset_name << ": llama-1b or mixtral-small\n";
        return 2;
      }
      preset = &it->second;
    }
    // An option's value: given on the command line, else the preset's, else its default.
    auto pick = [&](const char* option, int TrainPreset::*field) {
      return preset && !args.count(option) ? preset->*field : args[option].as<int>();
    };
    BenchModelSizes sizes;
    sizes.hidden = pick("hidden", &TrainPreset::hidden);
    sizes.layers = pick("layers", &TrainPreset::layers);
    sizes.ffn = pick("ffn", &TrainPreset::ffn);
    sizes.heads = pick("heads", &TrainPreset::heads);
    sizes.kv_heads = pick("kv-heads", &TrainPreset::kv_heads);
    sizes.vocab = pick("vocab", &TrainPreset::vocab);
    sizes.experts = pick("experts", &TrainPreset::experts);
    sizes.topk = pick("topk", &TrainPreset::topk);
    if (sizes.hidden < 1 || sizes.layers < 1 || sizes.ffn < 1 || sizes.heads < 1 || sizes.kv_heads < 1 ||
        sizes.vocab < 1 || sizes.hidden % sizes.heads != 0 || sizes.heads % sizes.kv_heads != 0) {
      std::cerr << "bench train: --hidden, --layers, --ffn, --heads, --kv-heads and --vocab must be positive, --heads "
                   "dividing --hidden and --kv-heads dividing --heads\n";
      return 2;
    }
    if (args["pp"].as<int>() < 1 || (args.count("peak-tflops") && !(args["peak-tflops"].as<double>() > 0))) {
      std::cerr << "bench train: --pp must be 1 or more and --peak-tflops above 0\n";
      return 2;
    }
    const int seq_length = pick("seq-length", &TrainPreset::seq);
    const int micro_batch = pick("micro-batch-size", &TrainPreset::micro);
    const int global_batch = pick("global-batch-size", &TrainPreset::global);
    const bool bf16 = preset || args.count("bf16");
    const std::string arch = preset && !args.count("arch") ? preset->arch : args["arch"].as<std::string>();
    const bool moe = arch == "mixtral" || arch == "qwen3_moe" || arch == "qwen2_moe" || arch == "gpt_oss" ||
                     arch == "deepseek_v3" || arch == "glm4_moe" || arch == "qwen3_next";
    // The presets' grouped GEMM is CUDA's (PyTorch has no CPU backward for it).
    const bool grouped_gemm = moe && (args.count("moe-grouped-gemm") || (preset && device == "cuda"));
    if (moe && (sizes.experts < 1 || sizes.topk < 1 || sizes.topk > sizes.experts)) {
      std::cerr << "bench train: --experts must be positive and --topk from 1 to --experts\n";
      return 2;
    }
    if (args["data-path"].as<std::string>().empty() && sizes.vocab < BenchModelSizes{}.vocab) {
      std::cerr << "bench train: --vocab " << sizes.vocab << " is below the corpus tokenizer's "
                << BenchModelSizes{}.vocab << " ids\n";
      return 2;
    }
    if (args.count("with-composites") && args.count("no-fused-kernels")) {
      std::cerr << "bench train: --with-composites adds a --no-fused-kernels run beside the fused one: give one of "
                   "them\n";
      return 2;
    }
    if (seq_length < 1 || micro_batch < 1 || global_batch < micro_batch || global_batch % micro_batch) {
      std::cerr << "bench train: --seq-length and --micro-batch-size must be positive, --global-batch-size a "
                   "multiple of the micro batch\n";
      return 2;
    }
    auto family = family_config(arch, sizes);
    if (!family.ok()) {
      std::cerr << "bench train: " << family.status().message() << "\n";
      return 2;
    }
    if (args["pp"].as<int>() > 1 && arch != "llama") {
      std::cerr << "bench train: --pp compares pipeline layouts of the Llama model only (no --arch)\n";
      return 2;
    }
    auto here = self_exe_dir();
    auto python = find_python(args["python"].as<std::string>());
    auto script = peer_script(args["peers-dir"].as<std::string>(), "train_peer.py");
    for (const Status& s : {here.status(), python.status(), script.status()})
      if (!s.ok()) {
        std::cerr << "bench train: " << s.message() << "\n";
        return 1;
      }
    const std::string trainer = (fs::path(*here) / "trestle-train").string();
    const std::string trestle = (fs::path(*here) / "trestle").string();
    const fs::path dir = fs::temp_directory_path() / ("trestle_bench_train_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    struct Cleanup {
      fs::path dir;
      ~Cleanup() {
        std::error_code ignored;
        fs::remove_all(dir, ignored);
      }
    } cleanup{dir};

    const nlohmann::json& config = *family;
    std::ofstream(dir / "config.json") << config.dump(2) << "\n";
    std::string data = args["data-path"].as<std::string>();
    if (data.empty()) {
      progress("tokenizing the corpus");
      auto prep = run_child_ok({trestle, "preprocess", "--input", corpus_file("kjv.jsonl"), "--output-prefix",
                                (dir / "kjv").string(), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                corpus_file("tokenizer.json"), "--append-eod", "--quiet"});
      if (!prep.ok()) {
        std::cerr << "bench train: preprocess: " << prep.status().message() << "\n";
        return 1;
      }
      data = (dir / "kjv_text_document").string();
    } else if (!fs::is_regular_file(data + ".bin") || !fs::is_regular_file(data + ".idx")) {
      std::cerr << "bench train: --data-path " << data << ": no " << data << ".bin and .idx (trestle preprocess's "
                << "output prefix)\n";
      return 2;
    }
    if (args["pp"].as<int>() > 1) return bench_train_pipeline(args, trainer, dir, data);
    const std::string seq = std::to_string(seq_length);
    const std::string mbs = std::to_string(micro_batch);
    const std::string gbs = std::to_string(global_batch);
    ::setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
    // MFU's denominator: given, or the GPU's dense bf16 peak.
    std::string gpu;
    double peak_tflops = args.count("peak-tflops") ? args["peak-tflops"].as<double>() : 0.0;
    if (device == "cuda") {
      auto name = cuda_device_name(*python);
      if (!name.ok()) {
        std::cerr << "bench train: no GPU for --device cuda: " << name.status().message() << "\n";
        return 1;
      }
      gpu = *name;
      if (!args.count("peak-tflops")) peak_tflops = gpu_bf16_peak_tflops(gpu);
    }
    std::vector<std::string> trestle_extra, peer_extra;
    if (bf16) {
      trestle_extra.push_back("--bf16");
      peer_extra.push_back("--bf16");
    }
    if (grouped_gemm) trestle_extra.push_back("--moe-grouped-gemm");
    if (peak_tflops > 0) {
      trestle_extra.push_back("--peak-tflops");
      trestle_extra.push_back(std::to_string(peak_tflops));
    }

    // The timed iterations of Trestle's runs with `extra` flags, over the rounds.
    struct TrainerRuns {
      std::vector<double> seconds, losses;  // losses: the first round's
      double flops_per_iteration = 0, peak_memory = 0;
    };
    int trestle_run = 0;  // each run its own log (the trainer appends to a JSON log)
    auto run_trestle = [&](const std::vector<std::string>& extra, const std::string& name, int round,
                           TrainerRuns& runs) -> Status {
      progress("round " + std::to_string(round + 1) + ": " + name);
      const std::string log = (dir / ("trestle_" + std::to_string(trestle_run++) + ".jsonl")).string();
      auto run = run_child_ok(train_command(args, trainer, dir, data, seq, mbs, gbs, iters, log, device, extra));
      if (!run.ok()) return Status::Error(name + ": " + run.status().message());
      std::ifstream lines(log);
      std::string line;
      int i = 0;
      while (std::getline(lines, line)) {
        const auto record = nlohmann::json::parse(line);
        if (++i > warmup) {
          runs.seconds.push_back(record["elapsed_time_per_iteration_ms"].get<double>() / 1000.0);
          // The trainer's MFU is Megatron's FLOPs per iteration over its time: the FLOPs back from it.
          if (record.contains("mfu"))
            runs.flops_per_iteration = record["mfu"].get<double>() * peak_tflops * 1e12 * runs.seconds.back();
        }
        if (round == 0) runs.losses.push_back(record["lm_loss"].get<double>());
        if (record.contains("peak_memory_bytes"))
          runs.peak_memory = std::max(runs.peak_memory, record["peak_memory_bytes"].get<double>());
      }
      return OkStatus();
    };
    // With the grouped GEMM, the same trainer with one GEMM per expert too: the grouped GEMM's gain, in the same run.
    std::vector<std::string> per_expert_extra;
    for (const std::string& a : trestle_extra)
      if (a != "--moe-grouped-gemm") per_expert_extra.push_back(a);
    // With --with-composites, the same trainer with ATen's composites too: the fused kernels' gain, in the same run.
    std::vector<std::string> composite_extra = trestle_extra;
    composite_extra.push_back("--no-fused-kernels");
    const bool with_composites = args.count("with-composites") > 0;
    TrainerRuns trestle_runs, per_expert_runs, composite_runs;
    std::vector<double> theirs, their_losses;
    double their_peak_memory = 0;
    std::int64_t parameters = 0;
    nlohmann::json peer_facts;
    for (int round = 0; round < rounds; ++round) {
      if (Status s = run_trestle(trestle_extra, "trestle train", round, trestle_runs); !s.ok()) {
        std::cerr << "bench train: " << s.message() << "\n";
        return 1;
      }
      if (grouped_gemm)
        if (Status s = run_trestle(per_expert_extra, "trestle train (one GEMM per expert)", round, per_expert_runs);
            !s.ok()) {
          std::cerr << "bench train: " << s.message() << "\n";
          return 1;
        }
      if (with_composites)
        if (Status s = run_trestle(composite_extra, "trestle train (--no-fused-kernels)", round, composite_runs);
            !s.ok()) {
          std::cerr << "bench train: " << s.message() << "\n";
          return 1;
        }
      progress("round " + std::to_string(round + 1) + ": PyTorch eager");
      auto peer = run_child_ok({*python, *script, "--config", (dir / "config.json").string(), "--data-prefix", data,
                                "--seq-length", seq, "--micro-batch-size", mbs, "--global-batch-size", gbs, "--iters",
                                std::to_string(iters), "--threads", std::to_string(threads), "--device", device,
                                bf16 ? "--bf16" : "--no-bf16"});
      if (!peer.ok()) {
        std::cerr << "bench train: the Python peer failed: " << peer.status().message() << "\n";
        return 1;
      }
      peer_facts = nlohmann::json::parse(
          peer->out.substr(peer->out.rfind("\n{") == std::string::npos ? 0 : peer->out.rfind("\n{") + 1));
      const auto seconds = peer_facts["seconds"].get<std::vector<double>>();
      for (std::size_t k = static_cast<std::size_t>(warmup); k < seconds.size(); ++k) theirs.push_back(seconds[k]);
      if (round == 0) their_losses = peer_facts["losses"].get<std::vector<double>>();
      parameters = peer_facts["parameters"].get<std::int64_t>();
      their_peak_memory = std::max(their_peak_memory, peer_facts.value("peak_memory_bytes", 0.0));
    }
    const std::vector<double>& ours = trestle_runs.seconds;
    const std::vector<double>& our_losses = trestle_runs.losses;
    const double flops_per_iteration = trestle_runs.flops_per_iteration, our_peak_memory = trestle_runs.peak_memory;
    const double tokens = global_batch * static_cast<double>(seq_length);
    const double our_rate = tokens / median(ours), their_rate = tokens / median(theirs);
    // Both sides do the same FLOPs per iteration.
    const double peak = peak_tflops * 1e12;
    const double mfu = peak > 0 ? flops_per_iteration / median(ours) / peak : 0.0;
    const double their_mfu = peak > 0 ? flops_per_iteration / median(theirs) / peak : 0.0;
    const std::string where = device == "cpu" ? std::to_string(threads) + " threads" : "cuda (" + gpu + ")";
    std::printf(
        "bench train: %s%s %.1fM parameters (hidden %d, %d layers, ffn %d, %d heads / %d KV, vocab %d), seq %s, "
        "global batch %s (micro %s), %s, %s\n",
        arch.c_str(), preset ? (" (--preset " + preset_name + ")").c_str() : "", static_cast<double>(parameters) / 1e6,
        sizes.hidden, sizes.layers, sizes.ffn, sizes.heads, sizes.kv_heads, sizes.vocab, seq.c_str(), gbs.c_str(),
        mbs.c_str(), bf16 ? "bf16" : "fp32", where.c_str());
    if (peak_tflops > 0)
      std::printf("  MFU against %.1f dense bf16 TFLOP/s%s\n", peak_tflops,
                  args.count("peak-tflops") ? " (--peak-tflops)" : (" (" + gpu + ")").c_str());
    std::printf("  %-44s %12s %14s %8s %12s %12s\n", "trainer", "s/iteration", "tokens/s", "MFU", "peak memory",
                "first loss");
    auto row = [&](const char* name, double seconds, double rate, double m, double memory, double loss) {
      const std::string mfu_text = m > 0 ? std::to_string(m * 100.0).substr(0, 5) + "%" : "-";
      std::printf("  %-44s %12.3f %14.1f %8s %12s %12.4f\n", name, seconds, rate, mfu_text.c_str(),
                  memory > 0 ? format_bytes(static_cast<std::uint64_t>(memory)).c_str() : "-", loss);
    };
    row(args.count("no-fused-kernels") ? "trestle train (tp1, dp1, --no-fused-kernels)" : "trestle train (tp1, dp1)",
        median(ours), our_rate, mfu, our_peak_memory, our_losses.empty() ? 0.0 : our_losses.front());
    const double per_expert_rate = grouped_gemm ? tokens / median(per_expert_runs.seconds) : 0.0;
    if (grouped_gemm)
      row("trestle train (one GEMM per expert)", median(per_expert_runs.seconds), per_expert_rate,
          peak > 0 ? flops_per_iteration / median(per_expert_runs.seconds) / peak : 0.0, per_expert_runs.peak_memory,
          per_expert_runs.losses.empty() ? 0.0 : per_expert_runs.losses.front());
    const double composite_rate = with_composites ? tokens / median(composite_runs.seconds) : 0.0;
    if (with_composites)
      row("trestle train (--no-fused-kernels)", median(composite_runs.seconds), composite_rate,
          peak > 0 ? flops_per_iteration / median(composite_runs.seconds) / peak : 0.0, composite_runs.peak_memory,
          composite_runs.losses.empty() ? 0.0 : composite_runs.losses.front());
    row("PyTorch eager (transformers + AdamW)", median(theirs), their_rate, their_mfu, their_peak_memory,
        their_losses.empty() ? 0.0 : their_losses.front());
    std::printf("  ratio (trestle / PyTorch): %.2fx\n", our_rate / their_rate);
    if (grouped_gemm)
      std::printf("  grouped GEMM's gain (grouped / one GEMM per expert): %.2fx\n", our_rate / per_expert_rate);
    if (with_composites)
      std::printf("  fused kernels' gain (fused / --no-fused-kernels): %.2fx\n", our_rate / composite_rate);
    nlohmann::ordered_json out = {{"bench", "train"},
                                  {"machine", machine_facts()},
                                  {"arch", arch},
                                  {"parameters", parameters},
                                  {"threads", threads},
                                  {"device", device},
                                  {"fused_kernels", args.count("no-fused-kernels") == 0},
                                  {"preset", preset_name},
                                  {"sizes",
                                   {{"hidden", sizes.hidden},
                                    {"layers", sizes.layers},
                                    {"ffn", sizes.ffn},
                                    {"heads", sizes.heads},
                                    {"kv_heads", sizes.kv_heads},
                                    {"vocab", sizes.vocab},
                                    {"experts", moe ? sizes.experts : 0},
                                    {"topk", moe ? sizes.topk : 0}}},
                                  {"dtype", bf16 ? "bf16" : "fp32"},
                                  {"moe_grouped_gemm", grouped_gemm},
                                  {"gpu", gpu},
                                  {"peak_tflops", peak_tflops},
                                  {"seq_length", seq_length},
                                  {"global_batch_size", global_batch},
                                  {"micro_batch_size", micro_batch},
                                  {"warmup", warmup},
                                  {"trestle",
                                   {{"iteration_seconds", ours},
                                    {"tokens_per_s", our_rate},
                                    {"mfu", mfu},
                                    {"flops_per_iteration", flops_per_iteration},
                                    {"peak_memory_bytes", our_peak_memory},
                                    {"losses", our_losses}}},
                                  {"pytorch",
                                   {{"iteration_seconds", theirs},
                                    {"tokens_per_s", their_rate},
                                    {"mfu", their_mfu},
                                    {"peak_memory_bytes", their_peak_memory},
                                    {"losses", their_losses},
                                    {"torch", peer_facts.value("torch", "")},
                                    {"transformers", peer_facts.value("transformers", "")}}},
                                  {"ratio", our_rate / their_rate}};
    if (grouped_gemm)
      out["trestle_one_gemm_per_expert"] = {{"iteration_seconds", per_expert_runs.seconds},
                                            {"tokens_per_s", per_expert_rate},
                                            {"peak_memory_bytes", per_expert_runs.peak_memory},
                                            {"losses", per_expert_runs.losses},
                                            {"grouped_gemm_gain", our_rate / per_expert_rate}};
    if (with_composites)
      out["trestle_no_fused_kernels"] = {{"iteration_seconds", composite_runs.seconds},
                                         {"tokens_per_s", composite_rate},
                                         {"peak_memory_bytes", composite_runs.peak_memory},
                                         {"losses", composite_runs.losses},
                                         {"fused_kernels_gain", our_rate / composite_rate}};
    if (auto s = write_json_file(report_path(args), out); !s.ok()) {
      std::cerr << "bench train: " << s.message() << "\n";
      return 1;
    }
    if (args.count("profile")) {  // one more trainer run, apart from the timed ones, under PyTorch's profiler
      const std::string profile_dir = args["profile"].as<std::string>();
      // Two iterations are enough for the table, and keep the trace small at many micro-batches an iteration.
      const int profiled_end = std::min(iters, warmup + 2);
      progress("trestle train under the profiler (iterations " + std::to_string(warmup + 1) + "-" +
               std::to_string(profiled_end) + ")");
      std::vector<std::string> extra = trestle_extra;
      for (const std::string& a :
           {std::string("--profile"), std::string("--use-pytorch-profiler"),
            std::string("--pytorch-profiler-collect-shapes"), std::string("--profile-step-start"),
            std::to_string(warmup), std::string("--profile-step-end"), std::to_string(profiled_end),
            std::string("--tensorboard-dir"), profile_dir})
        extra.push_back(a);
      const std::string log = (dir / "trestle_profiled.jsonl").string();
      auto run = run_child_ok(train_command(args, trainer, dir, data, seq, mbs, gbs, iters, log, device, extra));
      if (!run.ok()) {
        std::cerr << "bench train: trestle train --profile: " << run.status().message() << "\n";
        return 1;
      }
      // The profile's lines, up to the trainer's next log line (" [date] iteration ...").
      std::size_t at = run->out.find(" profile of rank");
      if (at == std::string::npos) std::printf("  (the trainer printed no profile)\n");
      while (at != std::string::npos && at < run->out.size() && run->out.compare(at, 2, " [") != 0) {
        const std::size_t end = run->out.find('\n', at);
        std::printf(" %s\n", run->out.substr(at, end == std::string::npos ? std::string::npos : end - at).c_str());
        at = end == std::string::npos ? end : end + 1;
      }
    }
    return 0;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "bench train: " << describe_parse_error(e, argc, argv) << "\n";
    return 2;
  } catch (const nlohmann::json::exception& e) {
    std::cerr << "bench train: unreadable output: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace trestle::cli
