// trestle train: the parallel trainer's command line. With --nproc-per-node N it starts N local workers of itself
// (torchrun's variables) and forwards their output; as a worker (started by it, torchrun or Slurm) it joins the c10d
// rendezvous, sets up Megatron's parallel state and runs the training loop (train/loop) with Megatron's argument names.
#include <ATen/Context.h>
#include <ATen/ops/full.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <cxxopts.hpp>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#ifdef TRESTLE_HAVE_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "ckpt/checkpoint_dir.h"
#include "ckpt/checkpoint_path.h"
#include "ckpt/file_lock.h"
#include "ckpt/json_file.h"
#include "ckpt/load.h"
#include "ckpt/manifest.h"
#include "ckpt/printable_text.h"
#include "ckpt/process_memory.h"
#include "convert/bridge/architectures.h"
#include "convert/bridge/bridge_model_json.h"
#include "convert/bridge/hf_config.h"
#include "parallel/launch_environment.h"
#include "parallel/launcher.h"
#include "parallel/layout/lora_spec.h"
#include "parallel/layout/pipeline_layout_string.h"
#include "parallel/parallel_state.h"
#include "parallel/process_group_collective.h"
#include "tools/command.h"
#include "tools/list_flag_words.h"
#include "tools/megatron_flags.h"
#include "tools/train.h"
#include "tools/train_torch_dist.h"
#include "train/data/gpt_data_builder.h"
#include "train/data/tokenizer_eod.h"
#include "train/loop/trainer.h"

extern char** environ;

namespace trestle::cli {
namespace {

using parallel::GroupKind;
using parallel::ParallelState;

std::string join(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

// The layout of a world: dp is what tp x pp x cp leave.
Result<ParallelLayout> layout_for(const cxxopts::ParseResult& args, int world_size) {
  ParallelLayout layout;
  layout.tp = args["tensor-model-parallel-size"].as<int>();
  layout.pp = args["pipeline-model-parallel-size"].as<int>();
  layout.cp = args["context-parallel-size"].as<int>();
  layout.ep = args["expert-model-parallel-size"].as<int>();
  if (args.count("expert-tensor-parallel-size")) {
    const int etp = args["expert-tensor-parallel-size"].as<int>();
    if (etp < 1) return Status::Error("--expert-tensor-parallel-size must be at least 1");
    layout.etp = etp == layout.tp ? 0 : etp;
  }
  layout.make_vocab_size_divisible_by = args["make-vocab-size-divisible-by"].as<std::int64_t>();
  if (layout.make_vocab_size_divisible_by < 1)
    return Status::Error("--make-vocab-size-divisible-by must be at least 1");
  if (args.count("padded-vocab-size")) {
    // Megatron then holds exactly these rows, split over tp. Padding the vocabulary to a multiple of padded / tp x tp
    // gives that many for any vocabulary up to it (check_megatron_model_flags refuses a larger one). The rows past
    // the vocabulary take no part in the loss here either way.
    const std::int64_t padded = args["padded-vocab-size"].as<std::int64_t>();
    if (padded < 1 || padded % layout.tp != 0)
      return Status::Error("--padded-vocab-size " + std::to_string(padded) +
                           " must be a positive multiple of the tensor-parallel size " + std::to_string(layout.tp) +
                           " (the output layer's rows are split over it)");
    layout.make_vocab_size_divisible_by = padded / layout.tp;
  }
  const int model = layout.tp * layout.pp * layout.cp;
  if (model < 1 || world_size % model != 0)
    return Status::Error("world size " + std::to_string(world_size) +
                         " is not divisible by tensor x pipeline x context " + "parallel size " +
                         std::to_string(model));
  layout.data_parallel = world_size / model;
  return layout;
}

// Every group of every kind as JSON {"tp": [[0,1],...], ...} (compared with megatron-core's rank generator).
int print_groups(const cxxopts::ParseResult& args, int world_size) {
  auto layout = layout_for(args, world_size);
  nlohmann::json out;
  for (GroupKind kind : parallel::kAllGroupKinds) {
    auto groups =
        layout.ok() ? parallel::group_ranks(*layout, kind) : Result<std::vector<std::vector<int>>>(layout.status());
    if (!groups.ok()) {
      std::fprintf(stderr, "trestle train: %s\n", printable_text(groups.status().message()).c_str());
      return 1;
    }
    out[std::string(parallel::group_name(kind))] = *groups;
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

// Test mode: an all-reduce of (global rank + 1) in the world and every group this rank belongs to; the sum must be
// the sum over the group's ranks. `kill_rank` SIGKILLs itself before its collectives (a worker dying mid-run).
int check_collectives(const ParallelState& state, int sleep_seconds, int kill_rank) {
  std::this_thread::sleep_for(std::chrono::seconds(sleep_seconds));
  if (state.rank() == kill_rank) std::raise(SIGKILL);
  std::vector<std::pair<std::string, const parallel::ProcessGroup*>> groups = {{"world", &state.world_group()}};
  for (GroupKind kind : parallel::kAllGroupKinds)
    groups.emplace_back(std::string(parallel::group_name(kind)), &state.group(kind));
  int failures = 0;
  for (const auto& [name, group] : groups) {
    if (!group->member()) continue;
    std::vector<at::Tensor> tensors{at::full({1}, static_cast<double>(state.rank() + 1), at::kDouble)};
    try {
      group->backend->allreduce(tensors)->wait();
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "rank %d: all-reduce in group %s failed: %s\n", state.rank(), name.c_str(),
                   e.what_without_backtrace());
      return 1;
    }
    double expected = 0;
    for (int r : group->ranks) expected += r + 1;
    const double sum = tensors[0].item<double>();
    failures += sum != expected;
    std::printf("%s: group %s [%s] (rank %d of %d) all-reduce sum %g expected %g\n", sum == expected ? "ok" : "FAILED",
                name.c_str(), join(group->ranks).c_str(), group->rank, group->size(), sum, expected);
  }
  std::fflush(stdout);
  return failures ? 1 : 0;
}

namespace fs = std::filesystem;

// The iteration directory --load names: <root>/iter_N (the tracker's N, or --ckpt-step's) or the directory itself.
std::string iteration_directory(const std::string& root, std::optional<std::int64_t> step) {
  if (!step) {
    const auto tracker = read_tracker(root);  // a bad one is reported when the root is read as a Trestle checkpoint
    if (!tracker.ok() || !tracker->present || tracker->release) return root;
    return tracked_iteration_dir(root, *tracker);
  }
  return (fs::path(root) / iteration_dir_name(*step)).string();
}

// A Megatron torch_dist checkpoint (not a Trestle one): DCP's .metadata and Megatron's metadata.json.
bool is_torch_dist(const std::string& directory) {
  std::error_code error;
  return fs::exists(fs::path(directory) / ".metadata", error) &&
         fs::exists(fs::path(directory) / "metadata.json", error) &&
         !fs::exists(fs::path(directory) / "manifest.json", error);
}

// Runs `trestle ARGS...` (the CLI beside this program) and waits for it; its output is ours.
Status run_trestle(const std::vector<std::string>& args) {
  std::error_code error;
  const auto self = fs::read_symlink("/proc/self/exe", error);
  if (error) return Status::Error("cannot find this executable: " + error.message());
  const std::string program = (self.parent_path() / "trestle").string();
  std::vector<std::string> words = {program};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (int e = ::posix_spawn(&pid, program.c_str(), nullptr, nullptr, argv.data(), environ); e != 0)
    return Status::Error(program + ": cannot run: " + std::strerror(e));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return Status::Error("`trestle " + args.front() + " ...` failed (" +
                         (WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status))
                                            : "signal " + std::to_string(WTERMSIG(status))) +
                         ")");
  return OkStatus();
}

// Megatron's load_checkpoint starts from scratch when --load holds no checkpoint yet (no tracker: the idiom of a job
// whose --load and --save are one directory), and --exit-on-missing-checkpoint ends the job instead. A root holds none
// when it does not exist, or has no tracker, no committed iteration and nothing else of a checkpoint (a manifest,
// torch_dist metadata, Megatron's common.pt, release/, iter_*/ or mp_rank_*/); the run then starts from
// --model-config. Returns the note to print, or nothing when --load stands.
Result<std::optional<std::string>> drop_missing_load(const cxxopts::ParseResult& args, train::TrainConfig& config) {
  if (!config.load || args.count("ckpt-step")) return std::optional<std::string>();
  const std::string root = *config.load;
  std::error_code ec;
  if (fs::exists(root, ec)) {
    if (!fs::is_directory(root, ec)) return std::optional<std::string>();
    TRESTLE_ASSIGN_OR_RETURN(const Tracker tracker, read_tracker(root));
    if (tracker.present || !list_iterations(root).empty()) return std::optional<std::string>();
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      const std::string name = entry.path().filename().string();
      for (const char* held : {kManifestFile, "metadata.json", ".metadata", "common.pt", "release"})
        if (name == held) return std::optional<std::string>();
      if (name.starts_with("iter_") || name.starts_with("mp_rank_")) return std::optional<std::string>();
    }
    if (ec) return Status::Error("--load " + root + ": " + ec.message());
  }
  if (args.count("exit-on-missing-checkpoint"))
    return Status::Error("--load " + root + " holds no checkpoint (--exit-on-missing-checkpoint)");
  if (!args.count("model-config") && !args.count("lora-rank"))
    return Status::Error("--load " + root +
                         " holds no checkpoint yet: give --model-config CONFIG.json to start "
                         "from scratch there (as Megatron does when --load and --save are one directory)");
  config.load.reset();
  return std::optional<std::string>(" note: --load " + root +
                                    " holds no checkpoint yet: training from scratch, as "
                                    "Megatron does (--exit-on-missing-checkpoint ends the job instead)");
}

// The converted copy of a torch_dist --load lives as long as its job: the node's local rank 0 holds <copy>.lock (the
// kernel lets go of it when the process dies, however it ends).
std::optional<FileLock> converted_load_lock;

// Copies (trestle_load_* in `dir`) whose job is gone, killed before it could remove them: their lock is free.
void remove_abandoned_loads(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with("trestle_load_") || !name.ends_with(".lock")) continue;
    auto lock = FileLock::try_acquire(it->path().string());
    if (!lock.ok() || !*lock) continue;
    std::error_code ignored;
    fs::remove_all(dir / name.substr(0, name.size() - 5), ignored);
    (*lock)->release();
  }
}

// --load of a Megatron torch_dist checkpoint: the node's local rank 0 converts it (`trestle convert --from
// megatron-dist`, model and optimizer state, or the model alone with --no-load-optim) into a Trestle checkpoint in a
// temporary directory named for the job and the node (two "nodes" may share a machine), every rank waits for it, and
// the run loads that. Returns the directory (the caller removes it) or nothing when --load is a Trestle checkpoint.
Result<std::optional<std::string>> convert_megatron_load(const cxxopts::ParseResult& args, train::TrainConfig& config,
                                                         const parallel::ParallelState& state,
                                                         const parallel::Rendezvous& rendezvous) {
  if (!config.load) return std::optional<std::string>();
  const std::string source = iteration_directory(*config.load, config.load_iteration);
  if (!is_torch_dist(source)) return std::optional<std::string>();
  std::string job = rendezvous.store_address.empty() ? std::to_string(::getpid()) : rendezvous.store_address;
  std::replace(job.begin(), job.end(), ':', '_');
  const std::string converted =
      (fs::temp_directory_path() / ("trestle_load_" + job + "_node" + std::to_string(rendezvous.node))).string();
  Status converted_status = OkStatus();
  if (rendezvous.local_rank == 0) {
    remove_abandoned_loads(fs::path(converted).parent_path());
    auto lock = FileLock::try_acquire(converted + ".lock");
    if (!lock.ok()) converted_status = lock.status();
    else if (!*lock) converted_status = Status::Error(converted + ": another job converts its --load here");
    else converted_load_lock = std::move(**lock);
  }
  if (rendezvous.local_rank == 0 && converted_status.ok()) {
    std::error_code ignored;
    fs::remove_all(converted, ignored);
    std::printf(" converting the Megatron torch_dist checkpoint %s for loading (into %s)\n", source.c_str(),
                converted.c_str());
    std::fflush(stdout);
    std::vector<std::string> convert = {"convert", "--from",  "megatron-dist", source,
                                        "--to",    "trestle", converted,       "--quiet"};
    if (args.count("hf-config")) {
      convert.push_back("--hf-config");
      convert.push_back(args["hf-config"].as<std::string>());
    }
    if (!config.load_optimizer)
      convert.push_back("--model-only");  // --no-load-optim: its state is neither read nor kept
    converted_status = run_trestle(convert);
  }
  parallel::ProcessGroupCollective world(state.world_group().backend);
  auto gathered = world.all_gather(converted_status.ok() ? "" : converted_status.message());
  if (!gathered.ok()) return gathered.status();
  for (std::size_t r = 0; r < gathered->size(); ++r)
    if (!(*gathered)[r].empty())
      return Status::Error("rank " + std::to_string(r) + ": converting " + source + ": " + (*gathered)[r]);
  config.load = converted;
  config.load_iteration.reset();
  return std::optional<std::string>(converted);
}

// Refuses, before anything is allocated, a model whose weights alone cannot fit in this machine's memory: a rank's
// share of them (every parameter over the world's ranks, in the training dtype) is the least it holds, gradients and
// optimizer state aside. (A GPU's allocator reports what does not fit there.)
Status check_weights_fit_in_memory(const GptModelSpec& spec, const ParallelLayout& layout,
                                   const train::TrainConfig& config, const std::string& source) {
  if (config.device.is_cuda()) return OkStatus();
  TRESTLE_ASSIGN_OR_RETURN(const auto tensors, canonical_tensors(spec));
  double parameters = 0;
  for (const auto& t : tensors) {
    double n = 1;
    for (const auto d : t.shape) n *= static_cast<double>(d);
    parameters += n;
  }
  const double element = config.bf16 || config.fp16 ? 2.0 : 4.0;
  const double share = parameters * element / static_cast<double>(std::max(1, layout.world_size()));
  const auto memory = static_cast<double>(physical_memory_bytes());
  if (memory <= 0 || share <= memory) return OkStatus();
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  char text[512];
  std::snprintf(text, sizeof text,
                "%s describes a model of %.4g parameters (hidden_size %lld, %lld layers, vocabulary %lld): each of "
                "the %d ranks would hold at least %.1f GiB of its weights alone, and this machine has %.1f GiB of "
                "memory",
                source.c_str(), parameters, static_cast<long long>(spec.hidden_size),
                static_cast<long long>(spec.num_layers), static_cast<long long>(spec.vocab_size), layout.world_size(),
                share / kGiB, memory / kGiB);
  return Status::Error(text);
}

// The model of the run: from the checkpoint given to --load (its manifest's model description), else from a Hugging
// Face config.json (--model-config, initialised from scratch). The description saved with each checkpoint is the
// loaded one with this run's layout and dtype, so `trestle convert` turns the run's checkpoints into Hugging Face
// models.
// The model's layout: the world's sizes with Megatron's virtual pipeline and uneven first/last stages.
Result<ParallelLayout> pipeline_layout(const cxxopts::ParseResult& args, const ParallelLayout& sizes,
                                       const GptModelSpec& spec) {
  const std::int64_t num_layers = spec.num_layers;
  ParallelLayout layout = sizes;
  if (args.count("pipeline-model-parallel-layout")) {
    for (const char* other : {"num-layers-per-virtual-pipeline-stage", "num-virtual-stages-per-pipeline-rank",
                              "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers",
                              "account-for-embedding-in-pipeline-split", "account-for-loss-in-pipeline-split"})
      if (args.count(other))
        return Status::Error(std::string("--pipeline-model-parallel-layout and --") + other +
                             " exclude each other (the layout gives every stage's layers)");
    if (spec.hybrid())
      return Status::Error(
          "--pipeline-model-parallel-layout: a hybrid model's stages are split by its layer pattern "
          "(Megatron refuses the layout beside --hybrid-layer-pattern)");
    TRESTLE_ASSIGN_OR_RETURN(const PipelineLayoutString parsed,
                             parse_pipeline_layout(args["pipeline-model-parallel-layout"].as<std::string>(), layout.pp,
                                                   num_layers, spec.mtp_num_layers));
    layout.vpp = parsed.vpp;
    layout.chunk_layers = parsed.chunk_layers;
    return layout;
  }
  if (args.count("decoder-first-pipeline-num-layers"))
    layout.first_stage_layers = args["decoder-first-pipeline-num-layers"].as<std::int64_t>();
  if (args.count("decoder-last-pipeline-num-layers"))
    layout.last_stage_layers = args["decoder-last-pipeline-num-layers"].as<std::int64_t>();
  if (args.count("num-layers-per-virtual-pipeline-stage") && args.count("num-virtual-stages-per-pipeline-rank"))
    return Status::Error(
        "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank exclude each other");
  if (args.count("num-virtual-stages-per-pipeline-rank"))
    layout.vpp = args["num-virtual-stages-per-pipeline-rank"].as<int>();
  // Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding and the loss count as layers of the split.
  const bool account_embedding = args.count("account-for-embedding-in-pipeline-split") > 0;
  const bool account_loss = args.count("account-for-loss-in-pipeline-split") > 0;
  const std::int64_t counted = num_layers + (account_embedding ? 1 : 0) + (account_loss ? 1 : 0);
  if (args.count("num-layers-per-virtual-pipeline-stage")) {
    const std::int64_t per_chunk = args["num-layers-per-virtual-pipeline-stage"].as<std::int64_t>();
    if (per_chunk < 1 || counted % (per_chunk * layout.pp) != 0)
      return Status::Error(
          "--num-layers-per-virtual-pipeline-stage " + std::to_string(per_chunk) + ": the model's " +
          std::to_string(num_layers) + " layers" +
          (counted != num_layers ? " (" + std::to_string(counted) + " with the embedding or loss)" : std::string()) +
          " are not a multiple of it times the pipeline parallel size " + std::to_string(layout.pp));
    layout.vpp = static_cast<int>(counted / (per_chunk * layout.pp));
  }
  if (account_embedding || account_loss) {
    if (layout.first_stage_layers > 0 || layout.last_stage_layers > 0)
      return Status::Error(
          "--account-for-embedding/loss-in-pipeline-split and --decoder-first/last-pipeline-num-layers exclude each "
          "other (as in Megatron)");
    if (spec.hybrid())
      return Status::Error(
          "--account-for-embedding/loss-in-pipeline-split: a hybrid model's stages are split by its "
          "layer pattern (Megatron refuses them beside --hybrid-layer-pattern)");
    TRESTLE_ASSIGN_OR_RETURN(layout.chunk_layers, accounted_chunk_layers(num_layers, layout.pp, layout.vpp,
                                                                         account_embedding, account_loss));
  }
  if (layout.vpp > 1 && (layout.first_stage_layers > 0 || layout.last_stage_layers > 0) &&
      args.count("num-layers-per-virtual-pipeline-stage"))
    return Status::Error(
        "uneven pipeline stages (--decoder-first/last-pipeline-num-layers) take the virtual pipeline size as "
        "--num-virtual-stages-per-pipeline-rank (as Megatron-LM): chunks of different stages differ in size");
  if (layout.pp == 1 && (layout.first_stage_layers > 0 || layout.last_stage_layers > 0))
    return Status::Error("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1");
  return layout;
}

// Resuming an adapter checkpoint takes its LoRA configuration. A restart repeats the first run's command line (a
// requeued Slurm job, torchrun's restarts), so LoRA flags that say the same are accepted; one that differs is an error
// naming it, the checkpoint's value and what to do.
Status check_lora_flags_match(const cxxopts::ParseResult& args, const LoraConfig& recorded,
                              const std::string& adapter_source, const LoraBase& base) {
  auto differs = [&](const char* flag, const std::string& given, const std::string& saved) {
    return Status::Error(std::string("--") + flag + " " + given + ": the adapter checkpoint " + adapter_source +
                         " was trained with " + saved + " and sets the LoRA configuration (" +
                         lora_to_json(recorded, base).dump() + "); drop the flag or give the same value");
  };
  auto number = [](double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  if (args.count("lora-rank") && args["lora-rank"].as<std::int64_t>() != recorded.rank)
    return differs("lora-rank", std::to_string(args["lora-rank"].as<std::int64_t>()), std::to_string(recorded.rank));
  if (args.count("lora-alpha") && args["lora-alpha"].as<double>() != recorded.alpha)
    return differs("lora-alpha", number(args["lora-alpha"].as<double>()), number(recorded.alpha));
  if (args.count("lora-dropout") && args["lora-dropout"].as<double>() != recorded.dropout)
    return differs("lora-dropout", number(args["lora-dropout"].as<double>()), number(recorded.dropout));
  if (args.count("lora-type")) {
    TRESTLE_ASSIGN_OR_RETURN(const LoraType type, parse_lora_type(args["lora-type"].as<std::string>()));
    if (type != recorded.type)
      return differs("lora-type", std::string(lora_type_name(type)), std::string(lora_type_name(recorded.type)));
  }
  if (args.count("lora-target-modules")) {
    const auto given = args["lora-target-modules"].as<std::vector<std::string>>();
    auto joined = [](const std::vector<std::string>& names) {
      std::string out;
      for (const auto& name : names) out += (out.empty() ? "" : ",") + name;
      return out;
    };
    if (std::set<std::string>(given.begin(), given.end()) !=
        std::set<std::string>(recorded.targets.begin(), recorded.targets.end()))
      return differs("lora-target-modules", joined(given), joined(recorded.targets));
  }
  return OkStatus();
}

// LoRA: the adapters' configuration (from the adapter checkpoint --load names, else the --lora-* flags) and the frozen
// base (--pretrained-checkpoint), whose digest an adapter checkpoint must have recorded. Reads the base's model
// description into `model`; returns false when the run has no adapters.
Result<bool> describe_lora(const cxxopts::ParseResult& args, train::TrainConfig& config, nlohmann::json& model,
                           std::string& source) {
  std::optional<LoraConfig> recorded;
  std::optional<LoraBase> recorded_base;
  std::string adapter_source;
  if (config.load) {
    auto reader = CheckpointReader::open(*config.load, config.load_iteration);
    if (!reader.ok()) return reader.status();
    adapter_source = reader->directory() + "/manifest.json";
    if (const auto it = reader->manifest().model.find("lora"); it != reader->manifest().model.end()) {
      TRESTLE_ASSIGN_OR_RETURN(recorded, lora_config_from_json(*it, adapter_source));
      TRESTLE_ASSIGN_OR_RETURN(recorded_base, lora_base_from_json(*it, adapter_source));
    }
  }
  const bool flags = args.count("lora-rank") > 0;
  if (!recorded && !flags) {
    for (const char* flag : {"pretrained-checkpoint", "lora-alpha", "lora-dropout", "lora-target-modules", "lora-type"})
      if (args.count(flag))
        return Status::Error(std::string("--") + flag + " needs LoRA: give --lora-rank (or --load an adapter checkpoint)");
    return false;
  }
  if (!args.count("pretrained-checkpoint"))
    return Status::Error(recorded ? "--load " + *config.load + " is a LoRA adapter checkpoint: give its base with "
                                        "--pretrained-checkpoint (it was trained on " + recorded_base->path + ")"
                                  : std::string("LoRA (--lora-rank) trains adapters on a frozen base: give the base "
                                                "with --pretrained-checkpoint CKPT (--load is for resuming an "
                                                "adapter checkpoint)"));
  // A root (its tracker's iteration) or an iteration directory.
  auto base = open_checkpoint_path(args["pretrained-checkpoint"].as<std::string>(), std::nullopt);
  if (!base.ok()) return Status::Error("--pretrained-checkpoint: " + base.status().message());
  if (base->manifest().model.contains("lora"))
    return Status::Error("--pretrained-checkpoint " + base->directory() + " is itself an adapter checkpoint; give the "
                         "full model it was trained on");
  const std::string base_dir = std::filesystem::absolute(base->directory()).lexically_normal().string();
  TRESTLE_ASSIGN_OR_RETURN(const std::string digest, manifest_file_digest(base_dir + "/manifest.json"));
  if (config.save) {
    const auto save = std::filesystem::weakly_canonical(*config.save);
    const auto base_canonical = std::filesystem::weakly_canonical(base_dir);
    if (save == base_canonical || save == base_canonical.parent_path())
      return Status::Error("--save " + *config.save + " is the base checkpoint's directory: adapter checkpoints go "
                           "elsewhere, so the base is never rewritten");
  }
  LoraConfig lora;
  if (recorded) {
    if (recorded_base->manifest_digest != digest)
      return Status::Error("--pretrained-checkpoint " + base_dir + " is not the base the adapters of " +
                           adapter_source + " were trained on: its manifest's digest is " + digest + ", the adapters "
                           "recorded " + recorded_base->manifest_digest + " (" + recorded_base->path + ")");
    lora = *recorded;
    TRESTLE_RETURN_IF_ERROR(check_lora_flags_match(args, lora, adapter_source, *recorded_base));
  } else {
    lora.rank = args["lora-rank"].as<std::int64_t>();
    lora.alpha = args.count("lora-alpha") ? args["lora-alpha"].as<double>() : static_cast<double>(lora.rank);
    lora.dropout = args["lora-dropout"].as<double>();
    TRESTLE_ASSIGN_OR_RETURN(lora.type, parse_lora_type(args["lora-type"].as<std::string>()));
    lora.targets = args["lora-target-modules"].as<std::vector<std::string>>();
    if (config.load)
      return Status::Error("--load " + *config.load + " is not an adapter checkpoint: with --lora-rank the base is "
                           "--pretrained-checkpoint, and --load resumes adapters");
  }
  model = base->manifest().model;
  source = base_dir + "/manifest.json";
  TRESTLE_RETURN_IF_ERROR(base->verify_files());  // carried into every save: checked against their records first
  for (const auto& [name, file] : base->manifest().files)
    config.carried_files.push_back({name, base->directory() + "/" + name});
  config.lora = lora;
  config.pretrained_checkpoint = fs::path(base->directory()).parent_path().string();
  config.pretrained_iteration = base->manifest().iteration;
  config.lora_base = LoraBase{base_dir, digest};
  return true;
}

// The model to train (--load, --model-config, LoRA's base) checked against the Megatron flags given; `reporting`:
// this rank prints the notes.
Status describe_model(const cxxopts::ParseResult& args, const ParallelLayout& sizes, train::TrainConfig& config,
                      bool reporting) {
  nlohmann::json model;
  std::string source;
  TRESTLE_ASSIGN_OR_RETURN(const bool lora, describe_lora(args, config, model, source));
  if (lora) {
  } else if (config.load) {
    auto reader = CheckpointReader::open(*config.load, config.load_iteration);
    if (!reader.ok()) return reader.status();
    model = reader->manifest().model;
    source = reader->directory() + "/manifest.json";
    TRESTLE_RETURN_IF_ERROR(reader->verify_files());
    for (const auto& [name, file] : reader->manifest().files)
      config.carried_files.push_back({name, reader->directory() + "/" + name});
  } else if (args.count("model-config")) {
    source = args["model-config"].as<std::string>();
    auto hf = read_hf_config(source);
    if (!hf.ok()) return hf.status();
    auto bridged = bridge_model_from_config(*hf);
    if (!bridged.ok()) return bridged.status();
    if (carries_towers_as_found(*bridged))
      return Status::Error(source + ": " + bridged->architecture +
                           "'s vision and audio towers are carried as a checkpoint holds them, and config.json does "
                           "not size them: convert the Hugging Face checkpoint and --load it, or train the text "
                           "model from scratch with a Gemma4ForCausalLM config (its text_config)");
    BridgedModel b;
    b.model = *bridged;
    model = bridged_model_to_json(b);
  } else {
    return Status::Error(
        "no model: give --load CHECKPOINT (a Trestle checkpoint, e.g. from `trestle convert`) or "
        "--model-config CONFIG.json (a Hugging Face config, trained from scratch)");
  }
  if (args.count("mtp-num-layers")) {
    // From scratch the flag adds the layers (Megatron's default has none); a checkpoint's layers train unless 0 drops
    // them, and a checkpoint cannot grow layers it lacks.
    const std::int64_t wanted = args["mtp-num-layers"].as<std::int64_t>();
    const auto held = model.contains("megatron") ? model["megatron"].find("mtp_num_layers") : model.end();
    const std::int64_t have =
        model.contains("megatron") && held != model["megatron"].end() && held->is_number_integer() ? held->get<std::int64_t>()
                                                                                                 : 0;
    if (wanted < 0) return Status::Error("--mtp-num-layers must not be negative");
    if (config.load && wanted != 0 && wanted != have)
      return Status::Error("--mtp-num-layers " + std::to_string(wanted) + ": the checkpoint (" + source + ") has " +
                           std::to_string(have) + " multi-token-prediction layers; give " + std::to_string(have) +
                           " or 0 (train without them)");
    model["megatron"]["mtp_num_layers"] = wanted;
  }
  if (model.contains("hf")) {
    // A converted model is described anew from its Hugging Face config, so a checkpoint written before the
    // description held some option (Gemma 3's RoPE per kind of layer, its window pattern) trains as its config says.
    auto bridged = bridged_model_from_json(model, source);
    if (!bridged.ok()) return bridged.status();
    model = bridged_model_to_json(*bridged);
  }
  auto spec = gpt_spec_from_json(model, source);
  if (!spec.ok()) return spec.status();
  config.spec = *spec;
  if (args.count("mtp-num-layers") && args["mtp-num-layers"].as<std::int64_t>() != spec->mtp_num_layers)
    return Status::Error("--mtp-num-layers " + std::to_string(args["mtp-num-layers"].as<std::int64_t>()) +
                         ": Trestle trains multi-token-prediction layers in the families that have them (DeepSeek-V3, "
                         "GLM-4.5, Qwen3-Next and Qwen3.5), and the model of " +
                         source + " is not one of them");
  if (config.lora) {
    // Megatron-Bridge's default targets match the modules a model has: multi-latent attention has no linear_qkv.
    auto& targets = config.lora->targets;
    if (!args.count("lora-target-modules") && spec->multi_latent_attention())
      targets.erase(std::remove(targets.begin(), targets.end(), "linear_qkv"), targets.end());
    if (Status checked = check_lora_config(*config.lora, *spec); !checked.ok())
      return Status::Error("LoRA on " + source + ": " + checked.message());
  }
  for (const auto& [flag, value] : {std::pair{"num-experts", spec->num_experts},
                                    std::pair{"moe-router-topk", spec->is_moe() ? spec->moe_router_topk : 0}})
    if (args.count(flag) && args[flag].as<std::int64_t>() != value)
      return Status::Error(std::string("--") + flag + " " + std::to_string(args[flag].as<std::int64_t>()) +
                           " differs from the model's " + std::to_string(value) + " (" + source + ")");
  TRESTLE_RETURN_IF_ERROR(check_megatron_model_flags(args, *spec, source));
  if (const auto unlike = megatron_defaults_unlike(args, *spec); !unlike.empty() && reporting) {
    std::string listed;
    for (const auto& flag : unlike) listed += (listed.empty() ? "" : "; ") + flag;
    std::printf(
        " note: these Megatron-LM flags are not given, and Megatron's defaults would build another model "
        "than %s's (trained here as it is): %s\n",
        source.c_str(), listed.c_str());
    std::fflush(stdout);
  }
  TRESTLE_ASSIGN_OR_RETURN(ParallelLayout layout, pipeline_layout(args, sizes, *spec));
  TRESTLE_RETURN_IF_ERROR(check_layout(layout, spec->num_layers, spec->num_query_groups, spec->num_experts));
  TRESTLE_RETURN_IF_ERROR(check_weights_fit_in_memory(*spec, layout, config, source));
  config.layout = layout;
  if (model.contains("hf")) {
    auto bridged = bridged_model_from_json(model, source);
    if (!bridged.ok()) return bridged.status();
    bridged->layout = layout;
    bridged->norms = spec->norms;
    model = bridged_model_to_json(*bridged);
    if (model.contains("hf") && model["hf"].contains("config"))
      set_config_dtype(model["hf"]["config"], config.bf16 ? DType::kBF16 : config.fp16 ? DType::kF16 : DType::kF32);
  } else {
    model["parallel"] = layout_to_json(layout);
  }
  if (config.lora) model["lora"] = lora_to_json(*config.lora, *config.lora_base);
  config.model_json = std::move(model);
  return OkStatus();
}

// cuda when this is a CUDA build and a GPU is visible, else cpu.
std::string default_device() {
#ifdef TRESTLE_HAVE_TORCH_CUDA
  if (torch::cuda::is_available()) return "cuda";
#endif
  return "cpu";
}

template <typename T>
std::optional<T> optional_arg(const cxxopts::ParseResult& args, const std::string& name) {
  if (!args.count(name)) return std::nullopt;
  return args[name].as<T>();
}

// The data to train on, as Megatron's get_blend_and_blend_per_split reads it: --data-path (or the words of the file
// --data-args-path names) split by --split, or each split's own blend from --train-data-path, --valid-data-path and
// --test-data-path (or the JSON file --per-split-data-args-path names, its "train", "valid" and "test" each a list of
// words or one string of them).
Status read_data_flags(const cxxopts::ParseResult& args, data::GptDataOptions& data) {
  const char* split_flags[3] = {"train-data-path", "valid-data-path", "test-data-path"};
  const bool one = args.count("data-path") || args.count("data-args-path");
  const bool per_split = args.count("train-data-path") || args.count("valid-data-path") ||
                         args.count("test-data-path") || args.count("per-split-data-args-path");
  if (args.count("mock-data")) {
    if (one || per_split) return Status::Error("--mock-data and the data paths exclude each other");
    // The tokenizer's vocabulary is the model's, known once it is read (the trainer fills it in); the end of document
    // is --eod-token-id or the vocabulary's last id.
    data.mock = data::MockDataTokenizer{0, args["eod-token-id"].as<std::int64_t>()};
    return OkStatus();
  }
  if (!one && !per_split)
    return Status::Error(
        "--data-path (or --train-data-path, --valid-data-path, --test-data-path, or --mock-data) is required");
  if (one && per_split)
    return Status::Error(
        "--data-path / --data-args-path and the per-split data flags (--train-data-path, --valid-data-path, "
        "--test-data-path, --per-split-data-args-path) exclude each other");
  if (args.count("data-path") && args.count("data-args-path"))
    return Status::Error("--data-path and --data-args-path exclude each other");
  if (args.count("per-split-data-args-path") &&
      (args.count("train-data-path") || args.count("valid-data-path") || args.count("test-data-path")))
    return Status::Error(
        "--per-split-data-args-path and --train-data-path / --valid-data-path / --test-data-path "
        "exclude each other");
  // A small file of dataset words (ckpt/json_file's size-checked readers; errors name the file).
  constexpr std::uint64_t kMaxArgsFile = std::uint64_t{64} << 20;
  auto words_of = [](const std::string& text) {
    std::vector<std::string> words;
    std::istringstream in(text);
    for (std::string w; in >> w;) words.push_back(w);
    return words;
  };
  auto blend_of = [](const std::string& flag, const std::vector<std::string>& words) -> Result<data::DataBlend> {
    auto blend = data::parse_data_path(words);
    if (!blend.ok()) return Status::Error("--" + flag + ": " + blend.status().message());
    return *blend;
  };
  if (one) {
    std::vector<std::string> words;
    if (args.count("data-path")) {
      words = args["data-path"].as<std::vector<std::string>>();
    } else {
      const auto text = read_text_file(args["data-args-path"].as<std::string>(), kMaxArgsFile);
      if (!text.ok()) return text.status().with_context("--data-args-path");
      words = words_of(*text);
    }
    TRESTLE_ASSIGN_OR_RETURN(data.blend, blend_of(args.count("data-path") ? "data-path" : "data-args-path", words));
    data.split = args["split"].as<std::string>();
    return OkStatus();
  }
  if (args.count("split"))  // megatron-core: "split and blend_per_split are incompatible"
    return Status::Error(
        "--split does not apply to --train-data-path / --valid-data-path / --test-data-path: each "
        "split takes every document of its own datasets");
  if (args.count("per-split-data-args-path")) {
    const std::string flag = "per-split-data-args-path";
    const std::string where = "--" + flag + " " + args[flag].as<std::string>();
    const auto read = read_json_file(args[flag].as<std::string>(), kMaxArgsFile);
    if (!read.ok()) return read.status().with_context(where);
    const nlohmann::json& json = *read;
    if (!json.is_object()) return Status::Error(where + ": not a JSON object with \"train\", \"valid\" and \"test\"");
    for (std::size_t s = 0; s < 3; ++s) {
      const char* name = data::split_name(static_cast<data::Split>(s));
      if (!json.contains(name))
        return Status::Error(where + ": no \"" + std::string(name) + "\" (Megatron reads all three)");
      const auto& value = json[name];
      if (value.is_null()) continue;
      std::vector<std::string> words;
      if (value.is_string()) {
        words = words_of(value.get<std::string>());
      } else if (value.is_array()) {
        for (const auto& w : value) {
          if (!w.is_string()) return Status::Error(where + ": \"" + std::string(name) + "\" holds a non-string");
          words.push_back(w.get<std::string>());
        }
      } else {
        return Status::Error(where + ": \"" + std::string(name) + "\" is neither a list of words nor a string");
      }
      TRESTLE_ASSIGN_OR_RETURN(data.blend_per_split[s], blend_of(flag + " (" + name + ")", words));
    }
  } else {
    for (std::size_t s = 0; s < 3; ++s) {
      if (!args.count(split_flags[s])) continue;
      TRESTLE_ASSIGN_OR_RETURN(data.blend_per_split[s],
                               blend_of(split_flags[s], args[split_flags[s]].as<std::vector<std::string>>()));
    }
  }
  if (!data.blend_per_split[0])
    return Status::Error("the per-split data flags give no training data (--train-data-path)");
  return OkStatus();
}

// How long to train and over what the schedule runs, in iterations or in samples, checked as Megatron's
// validate_args does: one unit or the other, a warmup fraction instead of a warmup length.
// Megatron's --exit-signal: a signal's name as Python's signal.Signals spells it, of those a job can be asked to stop
// with (the others are the system's or cannot be caught).
Result<int> exit_signal(const cxxopts::ParseResult& args) {
  if (!args.count("exit-signal")) return SIGTERM;
  const std::string name = args["exit-signal"].as<std::string>();
  for (const auto& [known, sig] :
       {std::pair{"SIGTERM", SIGTERM}, std::pair{"SIGINT", SIGINT}, std::pair{"SIGUSR1", SIGUSR1},
        std::pair{"SIGUSR2", SIGUSR2}, std::pair{"SIGHUP", SIGHUP}, std::pair{"SIGQUIT", SIGQUIT},
        std::pair{"SIGALRM", SIGALRM}, std::pair{"SIGXCPU", SIGXCPU}, std::pair{"SIGPWR", SIGPWR}})
    if (name == known) return sig;
  return Status::Error("--exit-signal " + name +
                       ": not one of SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT, SIGALRM, SIGXCPU, SIGPWR");
}

Status check_training_length_flags(const cxxopts::ParseResult& args) {
  const bool iters = args.count("train-iters") > 0, samples = args.count("train-samples") > 0;
  if (!iters && !samples) return Status::Error("--train-iters or --train-samples is required");
  if (iters && samples) return Status::Error("--train-iters and --train-samples exclude each other");
  // Megatron tells a length given from its default, None for the decay and the fraction, 0 for the others.
  auto given = [&](const std::string& flag) {
    if (!args.count(flag)) return false;
    if (flag == "lr-warmup-fraction" || flag.starts_with("lr-decay-")) return true;
    return args[flag].as<std::int64_t>() != 0;
  };
  // The decay, warmup and WSD lengths in iterations and in samples.
  const char* lengths[2][3] = {{"lr-decay-iters", "lr-warmup-iters", "lr-wsd-decay-iters"},
                               {"lr-decay-samples", "lr-warmup-samples", "lr-wsd-decay-samples"}};
  const int unit = iters ? 0 : 1;
  for (int k = 0; k < 3; ++k)
    if (given(lengths[1 - unit][k]))
      return Status::Error(std::string("--") + lengths[1 - unit][k] + " is for " +
                           (iters ? "--train-samples" : "--train-iters") + "; with " +
                           (iters ? "--train-iters" : "--train-samples") + " give --" + lengths[unit][k]);
  const char* warmup = lengths[unit][1];
  if (given("lr-warmup-fraction") && given(warmup))
    return Status::Error(std::string("--lr-warmup-fraction and --") + warmup + " exclude each other");
  if (given("lr-warmup-fraction")) {
    const double fraction = args["lr-warmup-fraction"].as<double>();
    if (!(fraction >= 0.0 && fraction < 1.0))
      return Status::Error("--lr-warmup-fraction must be at least 0 and below 1");
  }
  for (const char* flag : {"train-samples", "lr-decay-samples", "lr-warmup-samples", "lr-wsd-decay-samples"})
    if (args.count(flag) && args[flag].as<std::int64_t>() < 0)
      return Status::Error(std::string("--") + flag + " must not be negative");
  return OkStatus();
}

// Megatron's arguments (and Trestle's few of its own) as a TrainConfig; usage errors name the flag.
Result<train::TrainConfig> train_config(const cxxopts::ParseResult& args, const ParallelLayout& layout) {
  train::TrainConfig c;
  auto need = [&](const char* name) -> Status {
    if (!args.count(name)) return Status::Error(std::string("--") + name + " is required");
    return OkStatus();
  };
  for (const char* name : {"micro-batch-size", "lr"}) TRESTLE_RETURN_IF_ERROR(need(name));
  // Megatron's --encoder-seq-length is the same length under its older name.
  if (args.count("seq-length") && args.count("encoder-seq-length"))
    return Status::Error("--seq-length and --encoder-seq-length exclude each other (the same length)");
  const char* seq_flag = args.count("encoder-seq-length") ? "encoder-seq-length" : "seq-length";
  if (!args.count(seq_flag)) return Status::Error("--seq-length is required");
  TRESTLE_RETURN_IF_ERROR(check_training_length_flags(args));
  if (args.count("step-batch-size-schedule") && args.count("global-batch-size"))  // Megatron-LM 0.19's check
    return Status::Error("Cannot specify both --step-batch-size-schedule and --global-batch-size");
  if (args.count("step-batch-size-schedule") && args.count("rampup-batch-size"))
    return Status::Error("--step-batch-size-schedule and --rampup-batch-size exclude each other");
  if (args.count("fp16") && args.count("bf16")) return Status::Error("--fp16 and --bf16 exclude each other");
  TRESTLE_RETURN_IF_ERROR(check_megatron_flag_values(args));
  if (args["optimizer"].as<std::string>() != "adam")
    return Status::Error("--optimizer " + args["optimizer"].as<std::string>() + ": only adam (AdamW) is supported");
  const std::string recompute =
      args.count("recompute-granularity") ? args["recompute-granularity"].as<std::string>() : "";
  if (!recompute.empty() && recompute != "full" && recompute != "selective")
    return Status::Error("--recompute-granularity " + recompute + ": full or selective");
  c.load = optional_arg<std::string>(args, "load");
  c.load_iteration = optional_arg<std::int64_t>(args, "ckpt-step");
  c.finetune = args.count("finetune") > 0;
  c.skip_train = args.count("skip-train") > 0;
  c.load_optimizer = !args.count("no-load-optim") && !c.skip_train;  // Megatron's --skip-train sets --no-load-optim
  c.save_optimizer = !args.count("no-save-optim");
  c.load_rng = !args.count("no-load-rng");
  c.save_rng = !args.count("no-save-rng");
  c.override_ckpt_iteration = optional_arg<std::int64_t>(args, "override-ckpt-iteration");
  if (c.override_ckpt_iteration && *c.override_ckpt_iteration < 0)
    return Status::Error("--override-ckpt-iteration must not be negative");
  if (c.override_ckpt_iteration && c.finetune)  // Megatron's check
    return Status::Error("--override-ckpt-iteration: cannot override checkpoint iteration together with --finetune");
  // Megatron-LM 0.19 spells these with dashes too.
  const bool override_schedule =
      args.count("override-opt_param-scheduler") || args.count("override-opt-param-scheduler");
  const bool checkpoint_schedule =
      args.count("use-checkpoint-opt_param-scheduler") || args.count("use-checkpoint-opt-param-scheduler");
  if (override_schedule && checkpoint_schedule)
    return Status::Error("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other");
  c.saved_schedule = checkpoint_schedule ? LrSchedule::Saved::kUseCheckpoint : LrSchedule::Saved::kOverride;
  c.sequence_parallel = args.count("sequence-parallel") > 0 && layout.tp > 1;
  c.recompute = recompute == "full";
  c.bf16 = args.count("bf16") > 0;
  c.fp16 = args.count("fp16") > 0;
  c.grads_in_fp32 =
      args.count("accumulate-allreduce-grads-in-fp32") > 0 || (c.bf16 && !args.count("grad-reduce-in-bf16"));
  c.gradient_accumulation_fusion = !args.count("no-gradient-accumulation-fusion");
  c.use_distributed_optimizer = args.count("use-distributed-optimizer") > 0;
  // Each type with its coefficient (check_megatron_flag_values: as many coefficients as types, none twice); none
  // weighs no loss by its coefficient.
  const auto types = args.count("moe-router-load-balancing-type")
                         ? args["moe-router-load-balancing-type"].as<std::vector<std::string>>()
                         : std::vector<std::string>{"aux_loss"};
  const auto coefficients = args["moe-aux-loss-coeff"].as<std::vector<double>>();
  for (std::size_t i = 0; i < types.size() && i < coefficients.size(); ++i) {
    if (types[i] == "aux_loss") c.moe_load_balancing.micro_batch = coefficients[i];
    if (types[i] == "seq_aux_loss") c.moe_load_balancing.sequence = coefficients[i];
    if (types[i] == "global_aux_loss") c.moe_load_balancing.global_batch = coefficients[i];
  }
  c.moe_router_bias_update_rate = args["moe-router-bias-update-rate"].as<double>();
  c.mtp_loss_scaling_factor = args["mtp-loss-scaling-factor"].as<double>();
  if (c.mtp_loss_scaling_factor < 0) return Status::Error("--mtp-loss-scaling-factor must not be negative");
  if (c.moe_router_bias_update_rate < 0) return Status::Error("--moe-router-bias-update-rate must not be negative");
  c.moe_z_loss_coeff = args["moe-z-loss-coeff"].as<double>();
  // Megatron's token dropping: a negative factor is none, as megatron-core's config makes it.
  if (args.count("moe-expert-capacity-factor") && args["moe-expert-capacity-factor"].as<double>() >= 0) {
    const double factor = args["moe-expert-capacity-factor"].as<double>();
    if (!std::isfinite(factor) || factor == 0)
      return Status::Error("--moe-expert-capacity-factor " + shortest_decimal(factor) +
                           ": give a finite factor above 0 (each expert takes ceil(tokens x topk / experts x factor) "
                           "tokens; 0 would drop them all), or a negative one for no capacity");
    c.moe_capacity.factor = factor;
  }
  const std::string drop_policy = args["moe-token-drop-policy"].as<std::string>();
  if (drop_policy != "probs" && drop_policy != "position")
    return Status::Error("--moe-token-drop-policy " + drop_policy + ": probs or position");
  c.moe_capacity.drop_by_position = drop_policy == "position";
  c.moe_capacity.pad = args.count("moe-pad-expert-input-to-capacity") > 0;
  if (c.moe_capacity.pad && !c.moe_capacity.factor)
    return Status::Error("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (as in Megatron)");
  if (args.count("moe-router-dtype"))  // fp32 or fp64 (check_megatron_flag_values)
    c.moe_router_dtype = args["moe-router-dtype"].as<std::string>() == "fp64" ? at::kDouble : at::kFloat;
  c.moe_grouped_gemm = args.count("moe-grouped-gemm") > 0;
  c.fused_kernels = !args.count("no-fused-kernels");
  if (args.count("microbatch-group-size-per-virtual-pipeline-stage"))
    c.microbatch_group_size_per_vp_stage = args["microbatch-group-size-per-virtual-pipeline-stage"].as<int>();
  const std::string device = args.count("device") ? args["device"].as<std::string>() : default_device();
  if (device != "cpu" && device != "cuda") return Status::Error("--device " + device + ": cpu or cuda");
  c.device = device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  if (c.moe_grouped_gemm && !c.device.is_cuda())
    return Status::Error("--moe-grouped-gemm needs --device cuda: PyTorch's grouped GEMM has no CPU backward");
  if (args.count("loss-scale")) {
    c.loss_scaler.dynamic = false;
    c.loss_scaler.initial_scale = args["loss-scale"].as<double>();
  } else {
    c.loss_scaler.initial_scale = args["initial-loss-scale"].as<double>();
  }
  c.loss_scaler.min_scale = args["min-loss-scale"].as<double>();
  c.loss_scaler.growth_interval = args["loss-scale-window"].as<std::int64_t>();
  c.loss_scaler.hysteresis = args["hysteresis"].as<std::int64_t>();
  c.seed = args["seed"].as<std::uint64_t>();
  c.init_method_std = args["init-method-std"].as<double>();
  c.embedding_init_method_std = optional_arg<double>(args, "embedding-init-method-std");
  for (const auto& [flag, value] : {std::pair{"init-method-std", std::optional<double>(c.init_method_std)},
                                    std::pair{"embedding-init-method-std", c.embedding_init_method_std}})
    if (value && !(*value >= 0 && std::isfinite(*value)))
      return Status::Error(std::string("--") + flag + " must be a finite number, 0 or more");
  c.micro_batch_size = args["micro-batch-size"].as<std::int64_t>();
  // Without --global-batch-size (or with a step schedule) Megatron sets it to one micro-batch per data-parallel rank
  // (with a schedule: evaluation's batch, and the samples of an iteration wherever lengths are given in iterations).
  c.global_batch_size = args.count("global-batch-size") ? args["global-batch-size"].as<std::int64_t>()
                                                        : args["micro-batch-size"].as<std::int64_t>() * layout.dp();
  c.seq_length = args[seq_flag].as<std::int64_t>();
  if (c.micro_batch_size < 1 || c.seq_length < 1 || c.global_batch_size < 1)
    return Status::Error("--micro-batch-size, --global-batch-size and --seq-length must be positive");
  c.decrease_batch_size_if_needed = args.count("decrease-batch-size-if-needed") > 0;
  TRESTLE_RETURN_IF_ERROR(
      train::make_batch_shape(c.micro_batch_size, c.global_batch_size, layout.dp(), c.decrease_batch_size_if_needed)
          .status());
  c.eval_micro_batch_size = optional_arg<std::int64_t>(args, "eval-micro-batch-size");
  c.eval_global_batch_size = optional_arg<std::int64_t>(args, "eval-global-batch-size");
  if (c.eval_micro_batch_size || c.eval_global_batch_size) {  // Megatron-LM 0.19's check
    const std::int64_t micro = c.eval_micro_batch_size.value_or(c.micro_batch_size);
    const std::int64_t global = c.eval_global_batch_size.value_or(c.global_batch_size);
    if (micro < 1 || global < 1 || global % (micro * layout.dp()) != 0)
      return Status::Error("eval_global_batch_size (" + std::to_string(global) +
                           ") must be divisible by eval_micro_batch_size (" + std::to_string(micro) +
                           ") * data_parallel_size (" + std::to_string(layout.dp()) + "), both positive");
  }
  const bool by_samples = args.count("train-samples") > 0;
  if (args.count("rampup-batch-size")) {
    const auto words = args["rampup-batch-size"].as<std::vector<std::int64_t>>();
    if (words.size() != 3)
      return Status::Error(
          "--rampup-batch-size takes three numbers: the start batch size, the increment and the "
          "ramp-up samples");
    if (!by_samples)  // Megatron's check
      return Status::Error(
          "--rampup-batch-size: expected no batch-size rampup for iteration-based training (give "
          "--train-samples)");
    c.rampup = train::BatchRampup{words[0], words[1], words[2]};
    TRESTLE_RETURN_IF_ERROR(train::check_batch_rampup(*c.rampup, c.global_batch_size));
  }
  if (args.count("step-batch-size-schedule")) {
    if (!by_samples)
      return Status::Error(
          "--step-batch-size-schedule: give --train-samples (Trestle sizes the training split by "
          "them; with --train-iters Megatron's split holds iterations x micro-batch x data-parallel "
          "samples, fewer than the schedule reads)");
    TRESTLE_ASSIGN_OR_RETURN(c.batch_steps, train::parse_step_batch_size_schedule(
                                                args["step-batch-size-schedule"].as<std::string>(), c.seq_length));
  }
  if (by_samples) {  // Megatron's update_train_iters: whole global batches (the last, partial one is not trained)
    c.train_samples = args["train-samples"].as<std::int64_t>();
    if (c.rampup) {
      TRESTLE_ASSIGN_OR_RETURN(c.train_iters,
                               train::rampup_train_iterations(*c.rampup, c.global_batch_size, *c.train_samples));
    } else if (c.batch_steps) {
      TRESTLE_ASSIGN_OR_RETURN(c.train_iters, train::step_schedule_train_iterations(*c.batch_steps, *c.train_samples));
    } else {
      c.train_iters = *c.train_samples / c.global_batch_size;
    }
    if (c.train_iters < 1)
      return Status::Error("--train-samples " + std::to_string(*c.train_samples) +
                           " is less than one global batch (--global-batch-size " +
                           std::to_string(c.global_batch_size) + ")");
  } else {
    c.train_iters = args["train-iters"].as<std::int64_t>();
    if (c.train_iters < 1) return Status::Error("--train-iters must be positive");
  }
  TRESTLE_RETURN_IF_ERROR(read_data_flags(args, c.data));
  c.data.mid_level_dataset_surplus = args["mid-level-dataset-surplus"].as<double>();
  if (!(c.data.mid_level_dataset_surplus >= 0) || !std::isfinite(c.data.mid_level_dataset_surplus))
    return Status::Error("--mid-level-dataset-surplus must be a number, 0 or more");
  if (args.count("data-cache-path")) c.data.config.path_to_cache = args["data-cache-path"].as<std::string>();
  c.eod_mask_loss = args.count("eod-mask-loss") > 0;
  c.eod_token_id = args["eod-token-id"].as<std::int64_t>();
  const bool wants_eod = c.eod_mask_loss || (args.count("reset-attention-mask") > 0 && !args.count("mock-data"));
  if (wants_eod && c.eod_token_id < 0 && args.count("tokenizer-type")) {
    // Megatron takes the end of document from its tokenizer (pretrain_gpt's tokenizer.eod).
    data::TokenizerFiles tokenizer;
    tokenizer.type = args["tokenizer-type"].as<std::string>();
    if (args.count("tokenizer-model")) tokenizer.model = args["tokenizer-model"].as<std::string>();
    if (args.count("vocab-file")) tokenizer.vocab_file = args["vocab-file"].as<std::string>();
    if (args.count("vocab-size")) tokenizer.vocab_size = args["vocab-size"].as<std::int64_t>();
    auto eod = data::tokenizer_eod_id(tokenizer);
    if (!eod.ok())
      return Status::Error("the end-of-document token (for --eod-mask-loss or --reset-attention-mask): " +
                           eod.status().message());
    c.eod_token_id = *eod;
  }
  if (c.eod_mask_loss && c.eod_token_id < 0)
    return Status::Error("--eod-mask-loss needs --eod-token-id (or the tokenizer: --tokenizer-type and its files)");
  // Megatron builds the document mask in its data loader: with --no-create-attention-mask-in-dataloader it makes none,
  // and every token attends to every earlier one.
  // With --dataloader-inter-document-masking it makes none either: the dataset's documents mask attention instead.
  c.inter_document_masking = args.count("dataloader-inter-document-masking") > 0;
  c.reset_attention_mask = args.count("reset-attention-mask") > 0 &&
                           args.count("no-create-attention-mask-in-dataloader") == 0 && !c.inter_document_masking;
  if (c.reset_attention_mask && c.eod_token_id < 0 && !c.data.mock)
    return Status::Error(
        "--reset-attention-mask needs --eod-token-id (the token that ends each document), or the tokenizer "
        "(--tokenizer-type and its files)");
  c.calculate_per_token_loss = args.count("calculate-per-token-loss") > 0;
  c.adam.beta1 = args["adam-beta1"].as<double>();
  c.adam.beta2 = args["adam-beta2"].as<double>();
  c.adam.eps = args["adam-eps"].as<double>();
  // As torch's Adam refuses them (megatron-core's optimizer is built on it): a beta of 1 or more never forgets, a
  // negative one or epsilon diverges.
  auto shown = [](double value) {
    std::ostringstream out;
    out << value;
    return out.str();
  };
  for (const auto& [flag, beta] : {std::pair{"--adam-beta1", c.adam.beta1}, std::pair{"--adam-beta2", c.adam.beta2}})
    if (!(beta >= 0 && beta < 1)) return Status::Error(std::string(flag) + " must be in [0, 1), not " + shown(beta));
  if (!(c.adam.eps >= 0)) return Status::Error("--adam-eps must be 0 or more, not " + shown(c.adam.eps));
  c.clip_grad = args["clip-grad"].as<double>();
  c.ddp_bucket_elements = args.count("ddp-bucket-size") ? args["ddp-bucket-size"].as<std::int64_t>() : 0;
  if (args.count("ddp-bucket-size") && c.ddp_bucket_elements < 1)
    return Status::Error("--ddp-bucket-size must be at least 1, not " + std::to_string(c.ddp_bucket_elements));
  if (args.count("ddp-num-buckets")) {
    if (args.count("ddp-bucket-size"))
      return Status::Error("--ddp-num-buckets and --ddp-bucket-size both size the gradient buckets: give one");
    c.ddp_num_buckets = args["ddp-num-buckets"].as<std::int64_t>();
    if (c.ddp_num_buckets < 1)
      return Status::Error("--ddp-num-buckets must be at least 1, not " + std::to_string(c.ddp_num_buckets));
  }
  auto& s = c.schedule;
  const std::int64_t gbs = c.global_batch_size;
  s.max_lr = args["lr"].as<double>();
  s.min_lr = args["min-lr"].as<double>();
  s.init_lr = args["lr-warmup-init"].as<double>();
  // Megatron's get_optimizer_param_scheduler: steps are samples, given as iterations (times the global batch) or as
  // samples; a warmup fraction is of the decay's steps.
  if (by_samples) {
    s.decay_steps = args.count("lr-decay-samples") ? args["lr-decay-samples"].as<std::int64_t>() : *c.train_samples;
    s.warmup_steps = static_cast<double>(args["lr-warmup-samples"].as<std::int64_t>());
    s.wsd_decay_steps = args["lr-wsd-decay-samples"].as<std::int64_t>();
    s.wd_increment_steps = *c.train_samples;
  } else {
    s.decay_steps = (args.count("lr-decay-iters") ? args["lr-decay-iters"].as<std::int64_t>() : c.train_iters) * gbs;
    s.warmup_steps = static_cast<double>(args["lr-warmup-iters"].as<std::int64_t>() * gbs);
    s.wsd_decay_steps = args["lr-wsd-decay-iters"].as<std::int64_t>() * gbs;
    s.wd_increment_steps = c.train_iters * gbs;
  }
  if (args.count("lr-warmup-fraction"))
    s.warmup_steps = args["lr-warmup-fraction"].as<double>() * static_cast<double>(s.decay_steps);
  // --no-weight-decay-cond-type apply_wd_to_qk_layernorm: Megatron-LM's older spelling of the same rule.
  if (args.count("no-weight-decay-cond-type") &&
      args["no-weight-decay-cond-type"].as<std::string>() != "apply_wd_to_qk_layernorm")
    return Status::Error("--no-weight-decay-cond-type " + args["no-weight-decay-cond-type"].as<std::string>() +
                         ": not one of apply_wd_to_qk_layernorm");
  c.apply_wd_to_qk_layernorm =
      args.count("apply-wd-to-qk-layernorm") > 0 || args.count("no-weight-decay-cond-type") > 0;
  s.decoupled_max_lr = optional_arg<double>(args, "decoupled-lr");
  if (s.decoupled_max_lr) s.decoupled_min_lr = optional_arg<double>(args, "decoupled-min-lr");
  auto style = parse_lr_decay_style(args["lr-decay-style"].as<std::string>());
  if (!style.ok()) return Status::Error("--lr-decay-style: " + style.status().message());
  s.decay_style = *style;
  auto wsd = parse_wsd_decay_style(args["lr-wsd-decay-style"].as<std::string>());
  if (!wsd.ok()) return Status::Error("--lr-wsd-decay-style: " + wsd.status().message());
  s.wsd_decay_style = *wsd;
  const double wd = args["weight-decay"].as<double>();
  s.start_wd = args.count("start-weight-decay") ? args["start-weight-decay"].as<double>() : wd;
  s.end_wd = args.count("end-weight-decay") ? args["end-weight-decay"].as<double>() : wd;
  auto incr = parse_wd_increment_style(args["weight-decay-incr-style"].as<std::string>());
  if (!incr.ok()) return Status::Error("--weight-decay-incr-style: " + incr.status().message());
  if (args["weight-decay-incr-style"].as<std::string>() != "constant" &&
      (!args.count("start-weight-decay") || !args.count("end-weight-decay")))  // Megatron's validate_args asserts both
    return Status::Error("--weight-decay-incr-style " + args["weight-decay-incr-style"].as<std::string>() +
                         " needs --start-weight-decay and --end-weight-decay (the decay it goes from and to)");
  if (args["weight-decay-incr-style"].as<std::string>() == "constant" &&
      (args.count("start-weight-decay") || args.count("end-weight-decay")))  // and asserts neither with constant
    return Status::Error(
        "--start-weight-decay and --end-weight-decay need --weight-decay-incr-style linear or cosine (with the "
        "default, constant, the decay is --weight-decay; Megatron's validate_args refuses them too)");
  s.wd_increment_style = *incr;
  // What the flags alone must satisfy (Megatron's OptimizerParamScheduler asserts them): a usage error. The warmup
  // against the decay's length is checked when the run starts, with the length it trains.
  LrScheduleConfig flags_only = s;
  if (flags_only.warmup_steps >= 0)
    flags_only.decay_steps =
        std::max(flags_only.decay_steps, static_cast<std::int64_t>(std::ceil(flags_only.warmup_steps)) + 1);
  TRESTLE_RETURN_IF_ERROR(LrSchedule::create(flags_only).status());
  c.save = optional_arg<std::string>(args, "save");
  c.save_interval = args["save-interval"].as<std::int64_t>();
  c.exit_interval = args.count("exit-interval") ? args["exit-interval"].as<std::int64_t>() : 0;
  if (args.count("iterations-to-skip"))
    for (const std::int64_t i : args["iterations-to-skip"].as<std::vector<std::int64_t>>()) {
      // Megatron's check `iteration in args.iterations_to_skip` comes before the step, with the iterations done so
      // far: N passes over the batch after N iterations, the one that becomes iteration N + 1.
      if (i < 0) return Status::Error("--iterations-to-skip " + std::to_string(i) + ": negative");
      c.iterations_to_skip.insert(i + 1);
    }
  c.exit_duration_minutes = args.count("exit-duration-in-mins") ? args["exit-duration-in-mins"].as<double>() : 0.0;
  c.log_params_norm = args.count("log-params-norm") > 0;
  c.moe_per_layer_logging = args.count("moe-per-layer-logging") > 0;
  c.log_num_zeros_in_grad = args.count("log-num-zeros-in-grad") > 0;
  if (!(c.exit_duration_minutes >= 0) || !std::isfinite(c.exit_duration_minutes))
    return Status::Error("--exit-duration-in-mins must be a number of minutes, 0 or more");
  if (args.count("ckpt-format") && args["ckpt-format"].as<std::string>() != "trestle" &&
      args["ckpt-format"].as<std::string>() != "torch_dist")
    return Status::Error("--ckpt-format " + args["ckpt-format"].as<std::string>() +
                         ": the trainer saves Trestle checkpoints, with Megatron-Core's torch_dist form beside them "
                         "under --ckpt-format torch_dist; convert them with `trestle convert` for other formats");
  c.eval_interval = args["eval-interval"].as<std::int64_t>();
  c.start_eval_at_iter = args.count("start-eval-at-iter") ? args["start-eval-at-iter"].as<std::int64_t>() : 0;
  if (c.start_eval_at_iter < 0) return Status::Error("--start-eval-at-iter must not be negative");
  c.eval_iters = args["eval-iters"].as<std::int64_t>();
  c.log_interval = args["log-interval"].as<std::int64_t>();
  if (c.log_interval < 1 || c.eval_interval < 1 || c.eval_iters < 0 || c.save_interval < 0)
    return Status::Error(
        "--log-interval and --eval-interval must be positive, --eval-iters and --save-interval not "
        "negative");
  c.tensorboard_dir = optional_arg<std::string>(args, "tensorboard-dir");
  c.tensorboard_log_interval = args["tensorboard-log-interval"].as<std::int64_t>();
  if (c.tensorboard_log_interval < 1) return Status::Error("--tensorboard-log-interval must be positive");
  if (args.count("profile")) {
    if (!args.count("use-pytorch-profiler"))
      return Status::Error(
          "--profile records with PyTorch's profiler here: add --use-pytorch-profiler (Nsight "
          "Systems' capture ranges are not supported)");
    c.profile.enabled = true;
    c.profile.step_start = args["profile-step-start"].as<std::int64_t>();
    c.profile.step_end = args["profile-step-end"].as<std::int64_t>();
    if (c.profile.step_start < 0 || c.profile.step_end <= c.profile.step_start)
      return Status::Error("--profile-step-end (" + std::to_string(c.profile.step_end) +
                           ") must be above --profile-step-start (" + std::to_string(c.profile.step_start) +
                           "), which must not be negative");
    c.profile.ranks = args["profile-ranks"].as<std::vector<int>>();
    c.profile.dir = c.tensorboard_dir.value_or(".");
  }
  c.json_log = optional_arg<std::string>(args, "log-json");
  c.peak_tflops = optional_arg<double>(args, "peak-tflops");
  c.exit_on_save_failure = args["exit-on-save-failure"].as<bool>() && !args.count("no-exit-on-save-failure");
  c.check_for_nan_in_loss_and_grad =
      args["check-for-nan-in-loss-and-grad"].as<bool>() && !args.count("no-check-for-nan-in-loss-and-grad");
  c.exit_signal_handler = args.count("exit-signal-handler") > 0;
  TRESTLE_ASSIGN_OR_RETURN(c.exit_signal, exit_signal(args));
  c.test_kill_rank = args["test-kill-rank"].as<int>();
  c.test_kill_iteration = args["test-kill-iteration"].as<std::int64_t>();
  if (args.count("test-hang")) {  // RANK:ITERATION
    const std::string v = args["test-hang"].as<std::string>();
    long long iteration = 0;
    if (std::sscanf(v.c_str(), "%d:%lld", &c.test_hang_rank, &iteration) != 2)
      return Status::Error("--test-hang takes RANK:ITERATION, not " + v);
    c.test_hang_iteration = iteration;
  }
  if (args.count("test-nan")) {  // RANK:ITERATION:loss|grad
    const std::string v = args["test-nan"].as<std::string>();
    char where[8] = {};
    long long iteration = 0;
    if (std::sscanf(v.c_str(), "%d:%lld:%7s", &c.test_nan_rank, &iteration, where) != 3)
      return Status::Error("--test-nan takes RANK:ITERATION:loss|grad, not " + v);
    c.test_nan_iteration = iteration;
    c.test_nan_in = where;
  }
  return c;
}

// Makes `device` this process's current GPU (NCCL groups and kernels use it), or says why it cannot.
Status use_gpu([[maybe_unused]] const at::Device& device) {
#ifdef TRESTLE_HAVE_TORCH_CUDA
  if (!torch::cuda::is_available()) return Status::Error("--device cuda: no CUDA device is visible");
  if (device.index() >= static_cast<int>(torch::cuda::device_count()))
    return Status::Error("--device cuda: local rank " + std::to_string(device.index()) + " has no GPU (" +
                         std::to_string(torch::cuda::device_count()) + " visible)");
  c10::cuda::set_device(device.index());
  return OkStatus();
#else
  return Status::Error("--device cuda needs a CUDA build of Trestle (this one was built without CUDA)");
#endif
}

// The arguments as given, recorded with each checkpoint (Megatron keeps its args namespace there).
nlohmann::json recorded_arguments(int argc, char** argv) {
  nlohmann::json out = nlohmann::json::array();
  for (int i = 1; i < argc; ++i) out.push_back(argv[i]);
  return out;
}

int run_worker(const cxxopts::ParseResult& args, std::chrono::milliseconds timeout, int argc, char** argv) {
  if (Status tied = parallel::die_with_launcher(); !tied.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", printable_text(tied.message()).c_str());
    return 1;
  }
  auto rendezvous = parallel::rendezvous_from_environment(timeout);
  if (!rendezvous.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", printable_text(rendezvous.status().message()).c_str());
    return 1;
  }
  auto layout = layout_for(args, rendezvous->world_size);
  if (!layout.ok()) {
    std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous->rank,
                 printable_text(layout.status().message()).c_str());
    return 2;
  }
  std::optional<train::TrainConfig> config;
  if (!args.count("test-collectives")) {
    auto c = train_config(args, *layout);
    if (!c.ok()) {
      std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous->rank,
                   printable_text(c.status().message()).c_str());
      return 2;
    }
    c->args = recorded_arguments(argc, argv);
    auto missing = drop_missing_load(args, *c);
    if (!missing.ok()) {
      std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous->rank,
                   printable_text(missing.status().message()).c_str());
      return 1;
    }
    if (*missing && rendezvous->rank == rendezvous->world_size - 1) std::printf("%s\n", (*missing)->c_str());
    config.emplace(std::move(*c));
    auto ignored = given_flags_without_effect(args);
    // (The torch_dist form of a distributed optimizer's state is laid out for a Megatron-LM run with these.)
    if (args.count("ckpt-format") && args["ckpt-format"].as<std::string>() == "torch_dist" &&
        config->use_distributed_optimizer)
      std::erase_if(ignored, [](const std::string& flag) {
        return flag == "--overlap-grad-reduce" || flag.starts_with("--transformer-impl");
      });
    if (args.count("decoupled-min-lr") && !args.count("decoupled-lr"))  // Megatron reads it only with --decoupled-lr
      ignored.push_back("--decoupled-min-lr (without --decoupled-lr)");
    if (args.count("recompute-granularity") && args["recompute-granularity"].as<std::string>() == "selective")
      ignored.push_back("--recompute-granularity selective");
    if (args.count("moe-token-drop-policy") && !config->moe_capacity.factor)
      ignored.push_back("--moe-token-drop-policy " + args["moe-token-drop-policy"].as<std::string>() +
                        " (without --moe-expert-capacity-factor)");
    if (args.count("dataloader-inter-document-masking")) {
      for (const char* flag : {"reset-attention-mask", "no-create-attention-mask-in-dataloader"})
        if (args.count(flag))
          ignored.push_back(std::string("--") + flag +
                            " (with --dataloader-inter-document-masking, the dataset's documents mask attention)");
    } else if (args.count("no-create-attention-mask-in-dataloader")) {
      ignored.push_back(args.count("reset-attention-mask")
                            ? "--reset-attention-mask (with --no-create-attention-mask-in-dataloader, Megatron's data "
                              "loader makes no mask)"
                            : "--no-create-attention-mask-in-dataloader");
    }
    if (!ignored.empty() && rendezvous->rank == rendezvous->world_size - 1) {
      std::string listed;
      for (const auto& flag : ignored) listed += (listed.empty() ? "" : ", ") + flag;
      std::printf(" note: Megatron-LM flags without effect here (trestle train --help says why): %s\n", listed.c_str());
      std::fflush(stdout);
    }
    // A Megatron-LM script (its model described by flags) that leaves dropout out trains with Megatron's 0.1 there.
    const bool megatron_model = args.count("num-layers") || args.count("hidden-size");
    if (megatron_model && (!args.count("hidden-dropout") || !args.count("attention-dropout")) &&
        rendezvous->rank == rendezvous->world_size - 1) {
      std::printf(
          " note: Megatron-LM's default --hidden-dropout and --attention-dropout are 0.1; Trestle trains "
          "without dropout (give both as 0 to match Megatron)\n");
      std::fflush(stdout);
    }
  }
  parallel::ParallelStateOptions options;
  options.timeout = timeout;
  if (config && config->device.is_cuda()) {
    // One GPU per local rank, NCCL between them (Megatron's placement).
    config->device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(rendezvous->local_rank));
    if (auto s = use_gpu(config->device); !s.ok()) {
      std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous->rank, printable_text(s.message()).c_str());
      return 1;
    }
    // Megatron's TransformerConfig: bf16 GEMMs on the GPU without cuBLAS's reduced-precision reductions.
    if (config->bf16 && args.count("disable-bf16-reduced-precision-matmul"))
      at::globalContext().setAllowBF16ReductionCuBLAS(false);
    options.backend = parallel::BackendKind::kNccl;
  }
  auto state = ParallelState::create(*layout, *rendezvous, options);
  if (!state.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", printable_text(state.status().message()).c_str());
    return 1;
  }
  if (args.count("test-collectives"))
    return check_collectives(*state, args["test-sleep-seconds"].as<int>(), args["test-kill-rank"].as<int>());
  auto converted = convert_megatron_load(args, *config, *state, *rendezvous);
  Status status = converted.ok()
                      ? describe_model(args, *layout, *config, rendezvous->rank == rendezvous->world_size - 1)
                      : converted.status();
  if (status.ok()) status = use_torch_dist_checkpoints(args, *config);
  if (status.ok()) {
    // What LibTorch throws past the loop's own guards (an allocation that fails while the model is built) ends this
    // rank with its message, not an abort.
    try {
      status = train::train(*state, *config);
    } catch (const c10::Error& e) {
      status = Status::Error(e.what_without_backtrace());
    } catch (const std::bad_alloc&) {
      status = Status::Error("out of memory");
    } catch (const std::exception& e) {
      status = Status::Error(e.what());
    }
  }
  state->shutdown(/*abort=*/!status.ok());
  if (converted.ok() && *converted && rendezvous->local_rank == 0) {
    std::error_code ignored;
    fs::remove_all(**converted, ignored);
  }
  if (converted_load_lock) converted_load_lock->release();
  if (!status.ok()) {
    std::fprintf(stderr, "trestle train: rank %d: %s\n", state->rank(), printable_text(status.message()).c_str());
    return 1;
  }
  return 0;
}

// Megatron's list flags of the trainer: the data blends' and megatron_list_flags().
std::vector<std::string> trainer_list_flags() {
  std::vector<std::string> lists = {"--data-path",      "--train-data-path",    "--valid-data-path",
                                    "--test-data-path", "--iterations-to-skip", "--rampup-batch-size"};
  lists.insert(lists.end(), megatron_list_flags().begin(), megatron_list_flags().end());
  return lists;
}

}  // namespace

int train_main(int argc, char** argv) {
  cxxopts::Options spec(
      "trestle train",
      "Train a GPT model (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3/4, OLMo 2; the Mixtral, Qwen2/3-MoE,\n"
      "GPT-OSS, DeepSeek-V3, GLM-4.5 and Gemma 4 mixtures of experts; the Qwen3-Next / Qwen3.5 and\n"
      "Nemotron-H hybrids) with Megatron-style tensor, sequence, pipeline, data,\n"
      "context and expert parallelism over c10d (Gloo on CPU), from a Trestle checkpoint (--load; `trestle convert "
      "--from hf`\n"
      "makes one from a Hugging Face model) or from scratch (--model-config config.json), on Megatron\n"
      "indexed datasets (--data-path; `trestle preprocess` makes them). Flags shared with Megatron-LM\n"
      "take its names and defaults. With --nproc-per-node N, starts N local workers and forwards their\n"
      "output prefixed by rank; when one fails the others are stopped and the job exits with its code.\n"
      "Without it the process is a worker: torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; the store of its c10d rendezvous,\n"
      "keys kept apart per restart) or, without RANK, srun's (SLURM_PROCID, SLURM_NTASKS,\n"
      "SLURM_LOCALID, SLURM_NODEID) give its place; under Slurm the store is\n"
      "MASTER_ADDR:MASTER_PORT, else on the first host of SLURM_STEP_NODELIST (or\n"
      "SLURM_JOB_NODELIST) at port 15000 + the last four digits of SLURM_JOB_ID.\n"
      "Data parallel size = world size /\n"
      "(tensor x pipeline x context parallel size). --load also takes a Megatron torch_dist checkpoint\n"
      "(converted for loading by each node's first worker; --hf-config when it keeps no model\n"
      "description). Checkpoints are saved asynchronously (--save, --save-interval) as Trestle\n"
      "checkpoints that resume on any layout and convert to Hugging Face.\n"
      "Logs like Megatron (the last rank prints), and as JSON lines (--log-json) and TensorBoard events.");
  spec.add_options("launch")("nproc-per-node", "start this many local workers", cxxopts::value<int>())(
      "master-addr", "address the launcher serves the job's c10d store on",
      cxxopts::value<std::string>()->default_value("127.0.0.1"))(
      "master-port", "port of the job's c10d store, served by the launcher (default: one the system chooses)",
      cxxopts::value<int>()->default_value("0"))("distributed-timeout-minutes", "rendezvous and collective timeout",
                                                 cxxopts::value<int>()->default_value("10"))(
      "exit-signal-grace",
      "with --exit-signal-handler: the launcher passes the first SIGTERM or SIGINT on to its workers (a repeat within "
      "2 s is the same request); after a later one, the workers get this many seconds to finish their save before "
      "they are killed",
      cxxopts::value<double>()->default_value("60"));
  spec.add_options("parallel")("tensor-model-parallel-size", "tensor parallel size",
                               cxxopts::value<int>()->default_value("1"))(
      "pipeline-model-parallel-size", "pipeline parallel size (stages; pipeline ranks are the outermost)",
      cxxopts::value<int>()->default_value("1"))("context-parallel-size",
                                                 "context parallel size: each sequence split into 2 x cp chunks, rank "
                                                 "r holding chunks r and 2cp-1-r, attention as ring attention",
                                                 cxxopts::value<int>()->default_value("1"))(
      "expert-model-parallel-size",
      "expert parallel size: each rank of an expert-parallel group (data-parallel ranks) holds num_experts / ep "
      "experts and tokens reach them by all-to-all; with tp > 1 it needs --sequence-parallel",
      cxxopts::value<int>()->default_value("1"))(
      "expert-tensor-parallel-size",
      "MoE models: the routed experts' own tensor-parallel size (default: tp). Megatron's expert groups: each stage's "
      "tp x cp x dp ranks cut into etp x ep x expert-data-parallel; the experts' gradients are averaged over the "
      "expert-data-parallel ranks. With tp > 1 it needs --sequence-parallel",
      cxxopts::value<int>())(
      "make-vocab-size-divisible-by",
      "the vocabulary's rows are padded to a multiple of this x tp (the padding rows take no part in the loss)",
      cxxopts::value<std::int64_t>()->default_value("128"))(
      "sequence-parallel", "split the sequence over the tensor-parallel ranks outside attention and MLP")(
      "moe-aux-loss-coeff",
      "MoE models: Megatron's load-balancing loss coefficient (one for each --moe-router-load-balancing-type)",
      cxxopts::value<std::vector<double>>()->default_value("0"))(
      "moe-router-bias-update-rate",
      "MoE models with a router expert bias (DeepSeek-V3's aux-loss-free balancing): after each global batch every "
      "expert's bias moves by this much towards balance (+ below the mean load, - above it, the loads counted over "
      "the tensor-, data- and context-parallel ranks), as Megatron does",
      cxxopts::value<double>()->default_value("1e-3"))(
      "mtp-num-layers",
      "multi-token prediction (DeepSeek-V3's MTP): depths after the decoder, depth d predicting the token d + 1 "
      "ahead. From scratch: none unless given. With --load: the checkpoint's layers train; 0 trains without them "
      "(they are then not saved)",
      cxxopts::value<std::int64_t>())(
      "mtp-loss-scaling-factor",
      "multi-token prediction: the MTP losses join the lm loss as their mean over the depths times this",
      cxxopts::value<double>()->default_value("0.1"))(
      "moe-z-loss-coeff",
      "MoE models: Megatron's router z-loss coefficient (ST-MoE: mean squared log-sum-exp of the logits)",
      cxxopts::value<double>()->default_value("0"))(
      "moe-expert-capacity-factor",
      "MoE models: Megatron's token dropping: each expert takes at most ceil(tokens x topk / experts x this) of the "
      "tokens each rank's router sees, the rest of its tokens dropped (their weight for it 0; the load-balancing "
      "losses still read every token's scores). Negative or absent: no capacity",
      cxxopts::value<double>())(
      "moe-token-drop-policy",
      "with --moe-expert-capacity-factor: which of an expert's tokens go first, those of the lowest routing "
      "probability (probs) or the latest in the micro-batch (position)",
      cxxopts::value<std::string>()->default_value("probs"))(
      "moe-pad-expert-input-to-capacity",
      "with --moe-expert-capacity-factor: every expert computes exactly its capacity of rows, filled with other "
      "tokens at weight 0 (the same outputs; aux-loss-free balancing then counts each expert's load as its "
      "capacity, as in Megatron)")(
      "no-fused-kernels",
      "compute RMSNorm, SwiGLU / GeGLU and soft-capping with ATen's composite ops instead of Trestle's fused kernels "
      "(vectorised on the CPU, CUDA on the GPU); the same values within fp32 rounding")(
      "moe-grouped-gemm",
      "MoE models: run each projection of the local experts as one grouped GEMM (CUDA only) instead of one GEMM per "
      "expert; the same weights under the same names")(
      "num-experts", "MoE models: checked against the model's number of experts", cxxopts::value<std::int64_t>())(
      "moe-router-topk", "MoE models: checked against the model's experts per token", cxxopts::value<std::int64_t>())(
      "num-layers-per-virtual-pipeline-stage",
      "interleaved pipeline: layers of each model chunk (each stage holds layers / (pp x this) chunks)",
      cxxopts::value<std::int64_t>())("num-virtual-stages-per-pipeline-rank",
                                      "interleaved pipeline: model chunks per stage (instead of the flag above)",
                                      cxxopts::value<int>())(
      "microbatch-group-size-per-virtual-pipeline-stage",
      "interleaved pipeline: micro-batches run through a chunk before the next (default pp)", cxxopts::value<int>())(
      "decoder-first-pipeline-num-layers", "layers of the first pipeline stage (the others share the rest evenly)",
      cxxopts::value<std::int64_t>())("decoder-last-pipeline-num-layers",
                                      "layers of the last pipeline stage (the others share the rest evenly)",
                                      cxxopts::value<std::int64_t>())(
      "pipeline-model-parallel-layout",
      "Megatron's explicit pipeline split: the virtual stages in layer order separated by |, each a run of E "
      "(embedding: the first), t (a decoder layer), m (an MTP layer, with the loss) and L (loss: the last), with x*n "
      "and (...)*n repeats; entry v x pp + s is chunk v of stage s, so the entries / pp give the virtual pipeline "
      "size. A stage may hold no decoder layer. E.g. \"Et*3|(tt|)*2,ttmL\" at pp 4",
      cxxopts::value<std::string>())(
      "account-for-embedding-in-pipeline-split",
      "the embedding counts as one layer of the even pipeline split: the first virtual stage holds one decoder "
      "layer fewer (Megatron's)")(
      "account-for-loss-in-pipeline-split",
      "the loss counts as one layer of the even pipeline split: the last virtual stage holds one decoder layer "
      "fewer (Megatron's)");
  spec.add_options("lora")(
      "lora-rank",
      "train LoRA adapters of this rank (Megatron-Bridge's dim) on the frozen model of --pretrained-checkpoint; saves "
      "hold the adapters, their optimizer state and the training state only",
      cxxopts::value<std::int64_t>())("lora-alpha", "adapter scale alpha / rank (default: alpha = rank)",
                                      cxxopts::value<double>())("lora-dropout", "dropout on each adapter's input",
                                                                cxxopts::value<double>()->default_value("0"))(
      "lora-target-modules",
      "the linears that get adapters (of linear_qkv, linear_proj, linear_fc1, linear_fc2; in "
      "multi-latent attention (DeepSeek) linear_q_proj or linear_q_down_proj, linear_q_up_proj, and "
      "linear_kv_down_proj, linear_kv_up_proj instead of linear_qkv, which the default then skips; in Qwen3-Next / "
      "Qwen3.5's Gated DeltaNet layers and Nemotron-H's Mamba mixers, in_proj, out_proj)",
      cxxopts::value<std::vector<std::string>>()->default_value("linear_qkv,linear_proj,linear_fc1,linear_fc2"))(
      "lora-type",
      "lora: one adapter on each fused linear (linear_qkv, linear_fc1), as Megatron-Bridge's LoRA; canonical: "
      "separate q, k, v and gate, up adapters (and one per Hugging Face projection of a Gated DeltaNet's in_proj), as "
      "its CanonicalLoRA and as Hugging Face PEFT adapters are; peft: canonical, but one adapter on each routed "
      "expert's gate and up, as PEFT adapts transformers 5's fused experts (gate_up_proj)",
      cxxopts::value<std::string>()->default_value("lora"))(
      "pretrained-checkpoint",
      "LoRA: the base model (a Trestle checkpoint root or iteration directory), frozen; an adapter checkpoint given "
      "to --load must have been trained on it",
      cxxopts::value<std::string>());
  spec.add_options("model")("load", "resume or start from this Trestle checkpoint root (any saved layout)",
                            cxxopts::value<std::string>())("ckpt-step", "load this iteration instead of the latest",
                                                           cxxopts::value<std::int64_t>())(
      "finetune", "load the weights only: iteration, data position, optimizer and scheduler start from zero")(
      "no-load-optim",
      "do not load the optimizer state (nor the learning-rate schedule's, as Megatron's); needed to resume a later "
      "iteration that holds none")(
      "exit-on-missing-checkpoint",
      "end the job when --load holds no checkpoint (by default a run with --model-config then starts from scratch, "
      "as Megatron's)")(
      "no-save-optim",
      "save the weights and training state without the optimizer state (a resume takes --no-load-optim and starts "
      "the optimizer fresh)")("no-load-rng", "do not load the RNG states")("no-save-rng", "save no RNG states")(
      "override-ckpt-iteration",
      "resume the loaded checkpoint as if saved at this iteration: consumed samples become iteration x global batch "
      "size, so the data replays (or skips) from there; the optimizer and scheduler state load as saved (Megatron's)",
      cxxopts::value<std::int64_t>())(
      "override-opt_param-scheduler",
      "resume with this run's learning-rate schedule (--lr, --min-lr, warmup, decay iterations and style, weight "
      "decay) where it differs from the checkpoint's (the default here, with a note naming the differences; "
      "Megatron refuses them without this flag)")("use-checkpoint-opt_param-scheduler",
                                                  "resume with the checkpoint's learning-rate schedule")(
      "override-opt-param-scheduler", "Megatron-LM 0.19's spelling of --override-opt_param-scheduler")(
      "use-checkpoint-opt-param-scheduler", "Megatron-LM 0.19's spelling of --use-checkpoint-opt_param-scheduler")(
      "model-config", "Hugging Face config.json of a model to train from scratch (when there is no --load)",
      cxxopts::value<std::string>())(
      "hf-config", "config.json describing a Megatron torch_dist checkpoint given to --load that keeps no description",
      cxxopts::value<std::string>())("init-method-std", "standard deviation of the initial weights (from scratch)",
                                     cxxopts::value<double>()->default_value("0.02"))(
      "embedding-init-method-std",
      "the word embeddings' own standard deviation (from scratch; default: --init-method-std)",
      cxxopts::value<double>())(
      "recompute-granularity",
      "full: recompute each layer's activations in backward; selective (Megatron's recompute of attention's core) has "
      "no effect here (the same values; Trestle recomputes whole layers or nothing)",
      cxxopts::value<std::string>())("recompute-method", "accepted for Megatron compatibility (uniform)",
                                     cxxopts::value<std::string>())(
      "recompute-num-layers", "accepted for Megatron compatibility (1)", cxxopts::value<int>())(
      "device", "cpu (Gloo) or cuda (one GPU per local rank, NCCL); default cuda when a GPU is visible",
      cxxopts::value<std::string>())("bf16",
                                     "bf16 parameters with fp32 master weights; gradients accumulated and all-reduced "
                                     "in fp32 (as Megatron) unless --grad-reduce-in-bf16")(
      "grad-reduce-in-bf16", "with --bf16: accumulate and all-reduce gradients in bf16 (half the buffer, less exact)")(
      "accumulate-allreduce-grads-in-fp32", "accumulate and all-reduce gradients in fp32 (implied by --bf16)")(
      "no-gradient-accumulation-fusion",
      "let autograd make each linear weight's gradient and add it to the gradient buffer (default: the weight-gradient "
      "GEMM accumulates into the buffer itself, as Megatron's gradient accumulation fusion)")(
      "fp16", "fp16 parameters with fp32 master weights and loss scaling")(
      "loss-scale",
      "a constant loss scale (fp16's default: dynamic; also under --bf16 or --use-distributed-optimizer, as "
      "Megatron's optimizer takes it)",
      cxxopts::value<double>())("initial-loss-scale", "the dynamic loss scale's start",
                                cxxopts::value<double>()->default_value("4294967296"))(
      "min-loss-scale", "the dynamic loss scale's floor", cxxopts::value<double>()->default_value("1.0"))(
      "loss-scale-window", "clean iterations before the dynamic loss scale doubles",
      cxxopts::value<std::int64_t>()->default_value("1000"))("hysteresis",
                                                             "inf/NaN iterations before the dynamic loss scale halves",
                                                             cxxopts::value<std::int64_t>()->default_value("2"))(
      "seed", "random seed (initialisation, data shuffling)", cxxopts::value<std::uint64_t>()->default_value("1234"));
  spec.add_options("data")("data-path", "prefix, or weight prefix weight prefix ... of Megatron indexed datasets",
                           cxxopts::value<std::vector<std::string>>())(
      "data-args-path", "a file holding --data-path's words (for a long list)", cxxopts::value<std::string>())(
      "mock-data",
      "instead of data: megatron-core's mock documents (100000 of 1 to 4095 tokens counting up from 1, each ending "
      "in the end-of-document token: --eod-token-id, else the vocabulary's last id), split 1,1,1 as Megatron's")(
      "split", "train,valid,test proportions of --data-path's documents (Megatron's default)",
      cxxopts::value<std::string>()->default_value("969, 30, 1"))(
      "train-data-path", "instead of --data-path and --split: the training split's own datasets, as --data-path",
      cxxopts::value<std::vector<std::string>>())("valid-data-path",
                                                  "the validation split's own datasets (none: no validation)",
                                                  cxxopts::value<std::vector<std::string>>())(
      "test-data-path", "the test split's own datasets", cxxopts::value<std::vector<std::string>>())(
      "per-split-data-args-path",
      "a JSON file of the three: {\"train\": [words], \"valid\": ..., \"test\": ...} (a list of words or one string)",
      cxxopts::value<std::string>())("data-cache-path",
                                     "where the sample indices are cached (default: beside the data)",
                                     cxxopts::value<std::string>())(
      "mid-level-dataset-surplus",
      "a weighted blend builds each dataset's share of the samples times 1 + this, as Megatron's builder does",
      cxxopts::value<double>()->default_value("0.005"))("seq-length", "tokens per sample",
                                                        cxxopts::value<std::int64_t>())(
      "encoder-seq-length", "--seq-length under Megatron's older name", cxxopts::value<std::int64_t>())(
      "disable-bf16-reduced-precision-matmul",
      "with --bf16 on GPUs: matrix products without cuBLAS's reduced-precision reductions, as Megatron's (CPU GEMMs "
      "accumulate in fp32 already)")("micro-batch-size", "samples per micro-batch per data-parallel rank",
                                     cxxopts::value<std::int64_t>())(
      "global-batch-size",
      "samples per iteration over all data-parallel ranks (gradient accumulation fills the rest; default: "
      "micro-batch size x data-parallel size, as Megatron sets it)",
      cxxopts::value<std::int64_t>())("train-iters", "iterations to train to", cxxopts::value<std::int64_t>())(
      "rampup-batch-size",
      "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT in equal shares of the first SAMPLES "
      "samples, then stays --global-batch-size (Megatron's, with --train-samples; megatron-core 0.16's rule)",
      cxxopts::value<std::vector<std::int64_t>>())(
      "decrease-batch-size-if-needed",
      "a global batch (constant or ramped up) that does not divide into micro-batches of every data-parallel rank "
      "runs as the largest multiple of micro-batch x data-parallel size below it (Megatron's)")(
      "eval-micro-batch-size", "samples per evaluation micro-batch (default: --micro-batch-size; Megatron-LM 0.19's)",
      cxxopts::value<std::int64_t>())(
      "eval-global-batch-size",
      "samples per evaluation iteration over all data-parallel ranks (default: --global-batch-size; Megatron-LM "
      "0.19's)",
      cxxopts::value<std::int64_t>())(
      "step-batch-size-schedule",
      "\"THRESHOLD:BATCH ...\": from THRESHOLD tokens consumed on, the global batch is BATCH (K, M, B, T suffixes; "
      "Megatron-LM 0.19's, with --train-samples and without --global-batch-size, which becomes micro-batch x "
      "data-parallel size, evaluation's batch)",
      cxxopts::value<std::string>())(
      "train-samples",
      "samples to train on, instead of --train-iters: whole global batches of them (Megatron's sample-based "
      "training; the schedule's lengths are then given in samples)",
      cxxopts::value<std::int64_t>())("eod-mask-loss", "no loss on the end-of-document tokens")(
      "reset-attention-mask",
      "each token attends only to the tokens of its own document (after the sequence's last end-of-document token "
      "before it), in every softmax attention layer, as Megatron's data loader masks them; positions are not reset")(
      "no-create-attention-mask-in-dataloader",
      "Megatron's data loader then makes no attention mask, so --reset-attention-mask masks nothing (as in Megatron); "
      "without --reset-attention-mask no effect")(
      "dataloader-inter-document-masking",
      "each token attends only to the tokens of the dataset document it was read from (the documents each sample "
      "spans, as megatron-core's GPTDataset gives them in cu_seqlens), and its position counts from that document's "
      "start; --reset-attention-mask then has no effect. Not with Mamba or Gated DeltaNet layers or multi-token "
      "prediction")("eod-token-id", "the end-of-document token (for --eod-mask-loss and --reset-attention-mask)",
                    cxxopts::value<std::int64_t>()->default_value("-1"))(
      "calculate-per-token-loss",
      "train on the mean over the global batch's counted tokens (loss sums, gradients summed over the ranks and "
      "divided by the tokens) instead of the mean of the micro-batches' means");
  spec.add_options("optimizer")("optimizer", "adam (AdamW, decoupled weight decay)",
                                cxxopts::value<std::string>()->default_value("adam"))(
      "lr", "peak learning rate", cxxopts::value<double>())("min-lr", "learning rate at the end of the decay",
                                                            cxxopts::value<double>()->default_value("0"))(
      "lr-warmup-iters", "linear warmup iterations", cxxopts::value<std::int64_t>()->default_value("0"))(
      "lr-warmup-init", "learning rate at the start of the warmup", cxxopts::value<double>()->default_value("0"))(
      "lr-decay-iters", "iterations to decay over (default: --train-iters)", cxxopts::value<std::int64_t>())(
      "lr-warmup-samples", "linear warmup samples (with --train-samples)",
      cxxopts::value<std::int64_t>()->default_value("0"))(
      "lr-decay-samples", "samples to decay over (with --train-samples; default: --train-samples)",
      cxxopts::value<std::int64_t>())(
      "lr-warmup-fraction", "warmup as this fraction of the decay, instead of a warmup length",
      cxxopts::value<double>())("lr-decay-style", "constant, linear, cosine, inverse-square-root or WSD",
                                cxxopts::value<std::string>()->default_value("linear"))(
      "lr-wsd-decay-style", "WSD's decay: linear, cosine, exponential, minus_sqrt",
      cxxopts::value<std::string>()->default_value("exponential"))("lr-wsd-decay-iters", "WSD's decay iterations",
                                                                   cxxopts::value<std::int64_t>()->default_value("0"))(
      "lr-wsd-decay-samples", "WSD's decay samples (with --train-samples)",
      cxxopts::value<std::int64_t>()->default_value("0"))(
      "decoupled-lr",
      "peak learning rate of the word embeddings and the output layer (Megatron's decoupled learning rate; the "
      "same warmup and decay)",
      cxxopts::value<double>())(
      "decoupled-min-lr", "the decoupled learning rate's minimum (default: --min-lr; only with --decoupled-lr)",
      cxxopts::value<double>())("weight-decay", "weight decay (not applied to biases and norms)",
                                cxxopts::value<double>()->default_value("0.01"))(
      "apply-wd-to-qk-layernorm",
      "weight decay on the query and key norms too (Megatron's rule for Qwen3-Next; other norms and biases have none)")(
      "no-weight-decay-cond-type",
      "apply_wd_to_qk_layernorm: Megatron-LM's older spelling of --apply-wd-to-qk-layernorm",
      cxxopts::value<std::string>())("start-weight-decay", "weight decay at the start (incremented styles)",
                                     cxxopts::value<double>())(
      "end-weight-decay", "weight decay at the end (incremented styles)", cxxopts::value<double>())(
      "weight-decay-incr-style", "constant, linear or cosine",
      cxxopts::value<std::string>()->default_value("constant"))(
      "clip-grad", "clip gradients to this global L2 norm (0: off)", cxxopts::value<double>()->default_value("1.0"))(
      "adam-beta1", "Adam beta1", cxxopts::value<double>()->default_value("0.9"))(
      "adam-beta2", "Adam beta2", cxxopts::value<double>()->default_value("0.999"))(
      "adam-eps", "Adam epsilon", cxxopts::value<double>()->default_value("1e-08"))(
      "ddp-bucket-size", "elements per data-parallel gradient bucket (default max(40M, 1M x dp))",
      cxxopts::value<std::int64_t>())(
      "ddp-num-buckets",
      "cut each rank's gradients into about N buckets instead: buckets of (the rank's parameter count / N) elements, "
      "as Megatron-LM",
      cxxopts::value<std::int64_t>())(
      "use-distributed-optimizer",
      "shard the optimizer over the data-parallel ranks (ZeRO-1, Megatron's buffer layout): gradients "
      "reduce-scattered, fp32 masters and Adam moments for this rank's shard only, parameters all-gathered after "
      "each step; saved as flat ranges that load at any layout, with or without it");
  spec.add_options("checkpointing")("save", "save checkpoints under this root", cxxopts::value<std::string>())(
      "save-interval", "save every N iterations (and at the end)", cxxopts::value<std::int64_t>()->default_value("0"))(
      "ckpt-format",
      "trestle (the default), or torch_dist: each checkpoint also holds Megatron-Core's torch_dist form of itself "
      "(.metadata, __<rank>_0.distcp, common.pt, metadata.json) in the same iteration directory, for Megatron-LM to "
      "load (the distributed optimizer's state as its dp_reshardable buffers, laid out by this run's flags; no RNG "
      "state). Rank 0 writes it from the Trestle files before the commit: twice the disk, and the save takes that "
      "long more. Trestle resumes from its own files",
      cxxopts::value<std::string>())(
      "skip-train",
      "train nothing and save nothing: evaluate the loaded model on the validation and test splits (--eval-iters "
      "global batches each) and exit, as Megatron's flag")(
      "iterations-to-skip",
      "as Megatron's: N (one or more numbers, from 0) passes over the global batch read after N iterations, which "
      "becomes iteration N + 1 and does nothing else: no step, no scheduler step, no log line, save or evaluation",
      cxxopts::value<std::vector<std::int64_t>>())(
      "exit-interval", "stop (after saving, with --save) when the iteration is a multiple of N",
      cxxopts::value<std::int64_t>())(
      "exit-duration-in-mins",
      "stop (after saving, with --save) after the first iteration that ends when any rank has trained this many "
      "minutes (from the trainer's start; a job's time limit less the time a save takes)",
      cxxopts::value<double>())(
      "exit-on-save-failure",
      "a save that fails (a write, sync or commit: a full disk, an I/O error) ends the job with the error, naming "
      "the file; the tracker keeps naming the last complete checkpoint (default true)",
      cxxopts::value<bool>()->default_value("true")->implicit_value("true"))(
      "no-exit-on-save-failure",
      "a failed save is a warning: training goes on and saves again at the next --save-interval (the last save of "
      "the run still fails it)")(
      "exit-signal-handler",
      "on SIGTERM or SIGINT (Slurm's signal before preemption), finish the step, save (with --save), wait for the save "
      "to commit and exit 0, as Megatron's flag; the launcher (--nproc-per-node) passes the signal to its workers")(
      "exit-signal",
      "with --exit-signal-handler: one more signal that does the same, by name (SIGUSR1 for sbatch --signal=USR1@120; "
      "Megatron's flag, whose default is SIGTERM)",
      cxxopts::value<std::string>());
  spec.add_options("logging")("log-interval", "print every N iterations",
                              cxxopts::value<std::int64_t>()->default_value("100"))(
      "log-params-norm", "log the L2 norm of the (fp32 master) parameters after each step, as Megatron's")(
      "log-num-zeros-in-grad", "log how many elements of the clipped gradients are zero, as Megatron's")(
      "moe-per-layer-logging",
      "MoE: also write each layer's router losses to TensorBoard (moe/<loss>_layer_<i>), as Megatron's")(
      "eval-interval", "evaluate on the validation split every N iterations",
      cxxopts::value<std::int64_t>()->default_value("1000"))(
      "start-eval-at-iter", "evaluate every --eval-interval iterations from this iteration on (Megatron-LM 0.19's)",
      cxxopts::value<std::int64_t>())(
      "eval-iters",
      "global batches per evaluation (each evaluation reads the split's next ones, as Megatron's one "
      "validation iterator does through a run and its resumes)",
      cxxopts::value<std::int64_t>()->default_value("100"))("tensorboard-dir", "write TensorBoard event files here",
                                                            cxxopts::value<std::string>())(
      "tensorboard-log-interval",
      "write every Nth iteration's own learning rate, loss, loss scale and norms to TensorBoard (Megatron's; the "
      "console line's interval is --log-interval)",
      cxxopts::value<std::int64_t>()->default_value("1"))(
      "log-json", "append each logged iteration and evaluation as a JSON line to this file",
      cxxopts::value<std::string>())("peak-tflops", "peak TFLOP/s of one device, to report MFU",
                                     cxxopts::value<double>())(
      "profile",
      "record iterations with PyTorch's profiler (with --use-pytorch-profiler): a Chrome trace per profiled rank in "
      "--tensorboard-dir (else the working directory) and a table of its GPU kernels (CPU operators on the CPU) by "
      "time")("use-pytorch-profiler", "with --profile: PyTorch's profiler (Kineto), as Megatron's flag")(
      "profile-step-start", "with --profile: start recording once this many iterations are done",
      cxxopts::value<std::int64_t>()->default_value(std::to_string(train::ProfileOptions{}.step_start)))(
      "profile-step-end", "with --profile: stop once this many are done",
      cxxopts::value<std::int64_t>()->default_value(std::to_string(train::ProfileOptions{}.step_end)))(
      "profile-ranks", "with --profile: the global ranks to profile",
      cxxopts::value<std::vector<int>>()->default_value("0"));
  spec.add_options("checkpointing")(
      "check-for-nan-in-loss-and-grad",
      "end the job when any rank's loss or gradients hold a NaN or Inf, naming the iteration and the rank, as "
      "Megatron's check (default true; fp16's loss scaling still skips steps whose gradients overflowed)",
      cxxopts::value<bool>()->default_value("true")->implicit_value("true"))(
      "no-check-for-nan-in-loss-and-grad", "do not check losses and gradients for NaN or Inf");
  // Hidden: used by the tests.
  spec.add_options("test")("distributed-timeout-seconds", "timeout in seconds (overrides the minutes)",
                           cxxopts::value<int>())("test-collectives", "all-reduce in every group and print the sums")(
      "test-sleep-seconds", "sleep before the collectives", cxxopts::value<int>()->default_value("0"))(
      "test-kill-rank", "this rank SIGKILLs itself (before its collectives, or at --test-kill-iteration)",
      cxxopts::value<int>()->default_value("-1"))("test-kill-iteration",
                                                  "the iteration at whose start --test-kill-rank dies",
                                                  cxxopts::value<std::int64_t>()->default_value("-1"))(
      "print-groups", "print every group's ranks for this world size as JSON and exit", cxxopts::value<int>())(
      "test-hang", "RANK:ITERATION: that rank stops answering when it starts that iteration",
      cxxopts::value<std::string>())(
      "test-nan", "RANK:ITERATION:loss|grad: that rank's loss, or a gradient, is NaN at that iteration",
      cxxopts::value<std::string>());
  declare_megatron_flags(spec);
  spec.add_options()("h,help", "show this help");
  try {
    const std::vector<std::string> words = join_list_flag_words(argc, argv, trainer_list_flags());
    std::vector<char*> word_pointers;
    for (const auto& w : words) word_pointers.push_back(const_cast<char*>(w.c_str()));
    const auto args = spec.parse(static_cast<int>(word_pointers.size()), word_pointers.data());
    if (args.count("help")) {
      std::cout << spec.help({"", "launch", "parallel", "model", "lora", "data", "optimizer", "checkpointing",
                              "logging", kMegatronModelGroup, kMegatronNoEffectGroup})
                << "\n";
      return 0;
    }
    if (args.count("print-groups")) return print_groups(args, args["print-groups"].as<int>());
    const auto timeout =
        args.count("distributed-timeout-seconds")
            ? std::chrono::milliseconds(std::chrono::seconds(args["distributed-timeout-seconds"].as<int>()))
            : std::chrono::milliseconds(std::chrono::minutes(args["distributed-timeout-minutes"].as<int>()));
    if (!args.count("nproc-per-node")) return run_worker(args, timeout, argc, argv);

    parallel::LaunchOptions launch;
    launch.nproc = args["nproc-per-node"].as<int>();
    if (launch.nproc < 1) {
      std::fprintf(stderr, "trestle train: --nproc-per-node must be 1 or more, not %d\n", launch.nproc);
      return 2;
    }
    // A process that torchrun or srun started as one of several (as a worker would read its environment): its own
    // job of --nproc-per-node workers would run beside the others' (each a whole job, training the same iterations)
    // instead of being one worker of theirs.
    if (const auto placed = parallel::read_launch_environment(); placed.ok() && placed->world_size > 1) {
      std::fprintf(stderr,
                   "trestle train: --nproc-per-node starts a job of its own, but %s started this process as rank %d "
                   "of %d: leave --nproc-per-node out and each of its processes is a worker of one job\n",
                   placed->launcher.c_str(), placed->rank, placed->world_size);
      return 2;
    }
    launch.master_addr = args["master-addr"].as<std::string>();
    launch.master_port = args["master-port"].as<int>();
    launch.forward_signals = args.count("exit-signal-handler") > 0;
    const auto signal = exit_signal(args);
    if (!signal.ok()) {
      std::fprintf(stderr, "trestle train: %s\n", signal.status().message().c_str());
      return 2;
    }
    launch.exit_signal = *signal;
    const double grace = args["exit-signal-grace"].as<double>();
    if (!(grace >= 0 && grace <= 1e6)) {
      std::fprintf(stderr, "trestle train: --exit-signal-grace must be between 0 and 1e6 seconds, not %g\n", grace);
      return 2;
    }
    launch.exit_signal_grace = std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(grace * 1000)));
    std::error_code error;
    const auto self = std::filesystem::read_symlink("/proc/self/exe", error);
    if (error) {
      std::fprintf(stderr, "trestle train: cannot find this executable: %s\n", error.message().c_str());
      return 1;
    }
    std::vector<std::string> command = {self.string()};
    const std::vector<std::string> given(argv, argv + argc);
    for (const auto& a : parallel::remove_options(given, {"--nproc-per-node", "--master-addr", "--master-port"}))
      command.push_back(a);
    auto outcome = parallel::launch_local_workers(command, launch);
    // Workers ended by a signal leave the converted copy of a torch_dist --load; it goes with them.
    remove_abandoned_loads(fs::temp_directory_path());
    if (!outcome.ok()) {
      std::fprintf(stderr, "trestle train: %s\n", printable_text(outcome.status().message()).c_str());
      return 1;
    }
    if (outcome->exit_code != 0) std::fprintf(stderr, "trestle train: FAILED: %s\n", outcome->failure.c_str());
    return outcome->exit_code;
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle train: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace trestle::cli
