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
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>
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
#include "convert/bridge/megatron_args.h"
#include "convert/lora_convert.h"
#include "convert/reshard.h"
#include "convert/sources/canonical_source.h"
#include "parallel/launcher.h"
#include "parallel/layout/lora_spec.h"
#include "parallel/layout/pipeline_layout_string.h"
#include "parallel/parallel_state.h"
#include "parallel/process_group_collective.h"
#include "tools/command.h"
#include "tools/load_directory.h"
#include "tools/megatron_flags.h"
#include "tools/parse_error.h"
#include "tools/train.h"
#include "tools/train_options.h"
#include "tools/train_torch_dist.h"
#include "train/data/gpt_data_builder.h"
#include "train/data/split.h"
#include "train/data/tokenizer_eod.h"
#include "train/loop/trainer.h"
#include "train/model/rope.h"

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

// The training-time regularisers a Hugging Face config sets that Trestle does not train (dropout, the router's input
// jitter), as "key value, ...", its text_config's included; a dropout the command line sets to 0 is left out.
std::string untrained_regularizers(const nlohmann::json& config, const cxxopts::ParseResult& args) {
  auto zero_flag = [&](const char* flag) { return args.count(flag) && args[flag].as<double>() == 0.0; };
  std::string listed;
  for (const nlohmann::json* c : {&config, config.contains("text_config") ? &config["text_config"] : nullptr}) {
    if (c == nullptr || !c->is_object()) continue;
    for (const auto& [key, flag] : {std::pair{"attention_dropout", "attention-dropout"},
                                    {"attn_pdrop", "attention-dropout"},
                                    {"hidden_dropout", "hidden-dropout"},
                                    {"resid_pdrop", "hidden-dropout"},
                                    {"embd_pdrop", "hidden-dropout"},
                                    {"router_jitter_noise", ""}}) {
      const auto v = c->find(key);
      if (v == c->end() || !v->is_number() || !(v->get<double>() > 0) || (*flag && zero_flag(flag))) continue;
      listed += (listed.empty() ? "" : ", ") + std::string(key) + " " + v->dump();
    }
  }
  return listed;
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
  TRESTLE_RETURN_IF_ERROR(
      check_vocab_size_divisible_by(layout.make_vocab_size_divisible_by, "--make-vocab-size-divisible-by"));
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
    TRESTLE_RETURN_IF_ERROR(check_vocab_size_divisible_by(
        layout.make_vocab_size_divisible_by, "--padded-vocab-size " + std::to_string(padded) +
                                                 " over the tensor-parallel size " + std::to_string(layout.tp)));
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
  // SIGPIPE and SIGXFSZ back to their default actions, which this worker ignores (run_worker): a conversion whose
  // output nobody reads any longer ends as any command does.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  sigaddset(&defaults, SIGXFSZ);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGDEF);
  pid_t pid = 0;
  const int e = ::posix_spawn(&pid, program.c_str(), nullptr, &attributes, argv.data(), environ);
  posix_spawnattr_destroy(&attributes);
  if (e != 0) return Status::Error(program + ": cannot run: " + std::strerror(e));
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

// Whether the root `flag` (--load, --pretrained-checkpoint) names holds a checkpoint to load. It holds none when it
// does not exist, or has no tracker, no committed iteration and nothing else of a checkpoint (a manifest, torch_dist
// metadata, Megatron's common.pt, release/, iter_*/ or mp_rank_*/). A root with committed iterations and no tracker
// loads its newest (`note` says so).
Result<bool> load_holds_checkpoint(const std::string& flag, const std::string& root, train::TrainConfig& config,
                                   std::optional<std::string>& note) {
  std::error_code ec;
  if (!fs::exists(root, ec)) return false;
  if (!fs::is_directory(root, ec)) return true;  // read (and refused) as a checkpoint
  TRESTLE_ASSIGN_OR_RETURN(const Tracker tracker, read_tracker(root));
  if (tracker.present) return true;
  // Committed iterations but no tracker: the first save was killed between its commit's rename and the tracker's
  // write. The newest is complete (a commit renames only what every rank synced): it is loaded, so that a restarted
  // job resumes there rather than failing on the missing tracker at every restart.
  if (const auto committed = list_iterations(root); !committed.empty()) {
    config.load_iteration = committed.back();
    note = " note: " + flag + " " + root + " has no " + kTrackerFile + " but committed " +
           iteration_dir_name(committed.back()) + " (a save ended before it wrote the tracker): loading that iteration";
    return true;
  }
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    for (const char* held : {kManifestFile, "metadata.json", ".metadata", "common.pt", "release"})
      if (name == held) return true;
    if (name.starts_with("iter_") || name.starts_with("mp_rank_")) return true;
  }
  if (ec) return Status::Error(flag + " " + root + ": " + ec.message());
  return false;
}

// Megatron's load_checkpoint starts from scratch when --load holds no checkpoint yet (no tracker: the idiom of a job
// whose --load and --save are one directory), and --exit-on-missing-checkpoint ends the job instead. With
// --pretrained-checkpoint (and no --lora-rank, where it names the frozen base) the run fine-tunes from that checkpoint
// instead: its weights only, from iteration 0, as Megatron's --finetune; once --load holds a checkpoint (the job's
// own saves, --load and --save one directory) it resumes that. Returns the note to print, or nothing when --load
// stands as given.
Result<std::optional<std::string>> drop_missing_load(const cxxopts::ParseResult& args, train::TrainConfig& config) {
  const bool fine_tuning = args.count("pretrained-checkpoint") && !args.count("lora-rank");
  std::optional<std::string> note;
  if (config.load && config.load_iteration) {
    // --ckpt-step names an iteration of the checkpoint loaded: --load's, or --pretrained-checkpoint's where --load
    // holds none yet (Megatron applies it to whichever it loads).
    if (!fine_tuning) return note;
    const auto step = config.load_iteration;
    TRESTLE_ASSIGN_OR_RETURN(const bool held, load_holds_checkpoint("--load", *config.load, config, note));
    config.load_iteration = step;
    note.reset();
    if (held) return note;
  } else if (config.load) {
    TRESTLE_ASSIGN_OR_RETURN(const bool held, load_holds_checkpoint("--load", *config.load, config, note));
    if (held) return note;
  }
  if (fine_tuning) {
    const std::string pretrained = args["pretrained-checkpoint"].as<std::string>();
    const std::string load = config.load ? "--load " + *config.load + " holds no checkpoint yet" : "no --load";
    if (!config.load_iteration) {
      TRESTLE_ASSIGN_OR_RETURN(const bool held,
                               load_holds_checkpoint("--pretrained-checkpoint", pretrained, config, note));
      if (!held)
        return Status::Error("--pretrained-checkpoint " + pretrained + " holds no checkpoint (and " + load + ")");
    }
    if (note) note = *note + "\n";
    config.load = pretrained;
    config.finetune = true;
    config.finetune_reason = "fine-tuning from --pretrained-checkpoint";
    return std::optional<std::string>(note.value_or("") + " note: " + load +
                                      ": fine-tuning from "
                                      "--pretrained-checkpoint " +
                                      pretrained + " (its weights only, from iteration 0, as Megatron does)");
  }
  if (!config.load) return note;
  const std::string root = *config.load;
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

// --load of a Megatron torch_dist checkpoint: the node's local rank 0 converts it (`trestle convert --from
// megatron-dist`, model and optimizer state, or the model alone with --no-load-optim) into a Trestle checkpoint in a
// temporary directory named for the job and the node (two "nodes" may share a machine), every rank waits for it, and
// the run loads that. Returns the directory (the caller removes it) or nothing when --load is a Trestle checkpoint.
Result<std::optional<std::string>> convert_megatron_load(const cxxopts::ParseResult& args, train::TrainConfig& config,
                                                         const parallel::ParallelState& state,
                                                         const parallel::Rendezvous& rendezvous) {
  if (!config.load) return std::optional<std::string>();
  const std::string source = iteration_directory(*config.load, config.load_iteration);
  const bool legacy = !is_torch_dist(source) && is_legacy_megatron(source);
  if (!is_torch_dist(source) && !legacy) return std::optional<std::string>();
  const bool release_dir = fs::path(source).lexically_normal().filename() == "release" ||
                           fs::path(source).lexically_normal().parent_path().filename() == "release";
  if (legacy && config.load_optimizer && !config.finetune && !release_dir)
    return Status::Error("--load " + source +
                         " is a Megatron legacy (torch) checkpoint, whose optimizer state "
                         "Trestle does not read: give --no-load-optim to resume from its weights with a fresh "
                         "optimizer (and schedule), or --finetune to start from them at iteration 0");
  // Megatron loads a release checkpoint's weights, from iteration 0 (load_checkpoint: `if args.finetune or release`),
  // neither its optimizer's and scheduler's state nor its RNG's; its consumed samples stand.
  if (release_dir && !config.finetune) {
    config.release = true;
    config.load_optimizer = false;
    config.load_rng = false;
  }
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
    std::printf(" converting the Megatron %s checkpoint %s for loading (into %s)%s\n",
                legacy ? "legacy (torch)" : "torch_dist", source.c_str(), converted.c_str(),
                legacy ? ": its model alone (a legacy checkpoint's optimizer state does not convert)" : "");
    std::fflush(stdout);
    std::vector<std::string> convert = {"convert", "--from", legacy ? "megatron-legacy" : "megatron-dist",
                                        source,    "--to",   "trestle",
                                        converted, "--quiet"};
    if (args.count("hf-config")) {
      convert.push_back("--hf-config");
      convert.push_back(args["hf-config"].as<std::string>());
    }
    if (!config.load_optimizer || config.finetune || legacy)
      convert.push_back("--model-only");  // --no-load-optim, weights only: its state is neither read nor kept
    converted_status = run_trestle(convert);
  }
  parallel::ProcessGroupCollective world(state.world_group().backend);
  auto gathered = world.all_gather(converted_status.ok() ? "" : converted_status.message());
  if (!gathered.ok()) return gathered.status();
  for (std::size_t r = 0; r < gathered->size(); ++r)
    if (!(*gathered)[r].empty())
      return Status::Error("rank " + std::to_string(r) + ": converting " + source + ": " + (*gathered)[r]);
  config.load = converted;
  config.load_shown = source;
  config.load_iteration.reset();
  return std::optional<std::string>(converted);
}

// Refuses, before anything is allocated, a run that cannot fit in this machine's memory: a rank's share of the
// weights (every parameter, the padded vocabulary's rows included, over the world's ranks, in the training dtype) and
// one micro-batch's hidden states ([seq / cp, micro-batch, hidden] in fp32) are the least it holds, gradients,
// optimizer state and the other activations aside. (A GPU's allocator reports what does not fit there.)
Status check_run_fits_in_memory(const GptModelSpec& spec, const ParallelLayout& layout,
                                const train::TrainConfig& config, const std::string& source) {
  if (config.device.is_cuda()) return OkStatus();
  TRESTLE_ASSIGN_OR_RETURN(const auto tensors, canonical_tensors(spec));
  double parameters = 0;
  for (const auto& t : tensors) {
    double n = 1;
    for (const auto d : t.shape) n *= static_cast<double>(d);
    parameters += n;
  }
  const std::int64_t padded_vocab = padded_vocab_size(spec.vocab_size, layout.make_vocab_size_divisible_by, layout.tp);
  const auto padding_rows = static_cast<double>(padded_vocab - spec.vocab_size);
  parameters += padding_rows * static_cast<double>(spec.hidden_size) * (spec.tied_embeddings ? 1.0 : 2.0);
  const double element = config.bf16 || config.fp16 ? 2.0 : 4.0;
  const double share = parameters * element / static_cast<double>(std::max(1, layout.world_size()));
  const double hidden_states = static_cast<double>(config.seq_length) / layout.cp *
                               static_cast<double>(config.micro_batch_size) * static_cast<double>(spec.hidden_size) *
                               4.0;
  const auto memory = static_cast<double>(physical_memory_bytes());
  if (memory <= 0 || share + hidden_states <= memory) return OkStatus();
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  char text[768];
  if (share > memory) {
    std::snprintf(text, sizeof text,
                  "%s describes a model of %.4g parameters (hidden_size %lld, %lld layers, vocabulary %lld padded to "
                  "%lld): each of the %d ranks would hold at least %.1f GiB of its weights alone, and this machine "
                  "has %.1f GiB of memory",
                  source.c_str(), parameters, static_cast<long long>(spec.hidden_size),
                  static_cast<long long>(spec.num_layers), static_cast<long long>(spec.vocab_size),
                  static_cast<long long>(padded_vocab), layout.world_size(), share / kGiB, memory / kGiB);
  } else {
    std::snprintf(text, sizeof text,
                  "--seq-length %lld x --micro-batch-size %lld at hidden size %lld: one micro-batch's hidden states "
                  "alone take %.1f GiB on each rank, beside %.1f GiB of weights, and this machine has %.1f GiB of "
                  "memory",
                  static_cast<long long>(config.seq_length), static_cast<long long>(config.micro_batch_size),
                  static_cast<long long>(spec.hidden_size), hidden_states / kGiB, share / kGiB, memory / kGiB);
  }
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
// base (--pretrained-checkpoint), which an adapter checkpoint must have recorded (check_lora_base). Reads the base's
// model description into `model`; returns false when the run has no adapters. `reporting`: this rank prints notes.
Result<bool> describe_lora(const cxxopts::ParseResult& args, train::TrainConfig& config, nlohmann::json& model,
                           std::string& source, bool reporting) {
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
    // (Without LoRA, --pretrained-checkpoint is Megatron's fine-tuning start, which drop_missing_load took.)
    for (const char* flag : {"lora-alpha", "lora-dropout", "lora-target-modules", "lora-type"})
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
  const std::string base_path = args["pretrained-checkpoint"].as<std::string>();
  // The base is read piece by piece as the frozen model's pieces: a Trestle checkpoint's. A Megatron or Hugging Face
  // one is converted first (without LoRA, --pretrained-checkpoint converts such a checkpoint itself).
  if (const auto format = detect_format(base_path); format.ok() && *format != CheckpointFormat::kTrestle)
    return Status::Error("--pretrained-checkpoint " + base_path + " is a " + std::string(format_name(*format)) +
                         " checkpoint; LoRA's base is a Trestle checkpoint: convert it first (trestle convert --from " +
                         std::string(format_name(*format)) + " " + base_path + " --to trestle BASE)");
  auto base = open_checkpoint_path(base_path, std::nullopt);
  if (!base.ok()) return Status::Error("--pretrained-checkpoint: " + base.status().message());
  if (base->manifest().model.contains("lora"))
    return Status::Error("--pretrained-checkpoint " + base->directory() + " is itself an adapter checkpoint; give the "
                         "full model it was trained on");
  TRESTLE_ASSIGN_OR_RETURN(LoraBase given_base, lora_base_of(*base));
  const std::string& base_dir = given_base.path;
  if (config.save) {
    const auto save = std::filesystem::weakly_canonical(*config.save);
    const auto base_canonical = std::filesystem::weakly_canonical(base_dir);
    if (save == base_canonical || save == base_canonical.parent_path())
      return Status::Error("--save " + *config.save + " is the base checkpoint's directory: adapter checkpoints go "
                           "elsewhere, so the base is never rewritten");
  }
  LoraConfig lora;
  if (recorded) {
    auto note = check_lora_base(*recorded_base, given_base, adapter_source, /*progress=*/false);
    if (!note.ok()) return Status::Error("--pretrained-checkpoint " + note.status().message());
    if (reporting && !note->empty()) std::fprintf(stderr, "%s\n", printable_text(*note).c_str());
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
  config.lora_base = given_base;
  return true;
}

// The model to train (--load, --model-config, LoRA's base) checked against the Megatron flags given; `reporting`:
// this rank prints the notes.
Status describe_model(const cxxopts::ParseResult& args, const ParallelLayout& sizes, train::TrainConfig& config,
                      bool reporting) {
  nlohmann::json model;
  nlohmann::json megatron_run_args;  // a Megatron-LM checkpoint's dropout (its args'), when --load converted one
  std::string source;
  TRESTLE_ASSIGN_OR_RETURN(const bool lora, describe_lora(args, config, model, source, reporting));
  if (lora) {
  } else if (config.load) {
    auto reader = CheckpointReader::open(*config.load, config.load_iteration);
    if (!reader.ok()) return reader.status();
    model = reader->manifest().model;
    if (const auto kept = reader->manifest().training.find("megatron_args");
        kept != reader->manifest().training.end() && kept->is_object())
      megatron_run_args = *kept;
    // (a converted Megatron --load: named as the user gave it, not by its temporary copy)
    source = config.load_shown ? *config.load_shown : reader->directory() + "/manifest.json";
    // What verify and reshard hold a model's checkpoint to: every weight of the model it describes, floating point
    // with its planned shape, and nothing else but their optimizer state with Adam's step (the loader reads only the
    // boxes it needs, so a larger stored tensor or a stray one would otherwise pass unseen). Opening it as a source
    // checks its carried files too, which any other checkpoint has checked here.
    if (model.is_object() && model.contains("parallel") && !is_adapter_checkpoint(*reader)) {
      SourceOptions options;
      options.model_only = !config.load_optimizer || config.finetune;  // (its optimizer state is not read then)
      auto checked = open_canonical_source(CheckpointFormat::kTrestle, reader->directory(), options);
      if (!checked.ok()) return checked.status();
      TRESTLE_RETURN_IF_ERROR(check_checkpoint_tensors((*checked)->model(), (*checked)->tensors(), source));
    } else {
      TRESTLE_RETURN_IF_ERROR(reader->verify_files());
    }
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
  // Megatron's --use-checkpoint-args: a loaded checkpoint's model flags over the command line's.
  const bool checkpoint_args = args.count("use-checkpoint-args") && (lora || config.load);
  if (args.count("mtp-num-layers") && !checkpoint_args) {
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
  if (args.count("mtp-num-layers") && !checkpoint_args &&
      args["mtp-num-layers"].as<std::int64_t>() != spec->mtp_num_layers)
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
  // The counts checked beside check_megatron_model_flags; under --use-checkpoint-args only named in its note.
  const std::pair<const char*, std::int64_t> counts[] = {
      {"num-experts", spec->num_experts},
      {"moe-router-topk", spec->is_moe() ? spec->moe_router_topk : 0},
      {"mtp-num-layers", spec->mtp_num_layers}};
  auto count_differs = [&](bool with_mtp) {
    for (const auto& [flag, value] : counts)
      if (args.count(flag) && (with_mtp || std::string_view(flag) != "mtp-num-layers") &&
          args[flag].as<std::int64_t>() != value)
        return Status::Error(std::string("--") + flag + " " + std::to_string(args[flag].as<std::int64_t>()) +
                             " differs from the model's " + std::to_string(value) + " (" + source + ")");
    return OkStatus();
  };
  if (!checkpoint_args) TRESTLE_RETURN_IF_ERROR(count_differs(/*with_mtp=*/false));  // (MTP: its own message above)
  TRESTLE_RETURN_IF_ERROR(check_megatron_model_flags(args, *spec, source, checkpoint_args));
  if (reporting && args.count("use-checkpoint-args") && !args.count("seq-length") &&
      !args.count("encoder-seq-length")) {
    std::printf(" note: --use-checkpoint-args: the sequence length is the checkpoint's run's, %lld\n",
                static_cast<long long>(config.seq_length));
    std::fflush(stdout);
  }
  if (checkpoint_args && reporting) {
    // What the checkpoint overrode, as Megatron's "Setting X from checkpoint" lines: the first flag that differs.
    Status overridden = check_megatron_model_flags(args, *spec, source);
    if (overridden.ok()) overridden = count_differs(/*with_mtp=*/true);
    std::printf(" note: --use-checkpoint-args: the model flags Megatron sets from the checkpoint are %s's%s\n",
                source.c_str(), overridden.ok() ? "" : (", over those given (" + overridden.message() + ")").c_str());
    std::fflush(stdout);
    // and its dropout, which Megatron forces from the checkpoint's args
    std::string dropout;
    for (const char* key : kMegatronDropoutArgs)
      if (const auto v = megatron_run_args.find(key);
          v != megatron_run_args.end() && v->is_number() && v->get<double>() > 0)
        dropout += (dropout.empty() ? "" : ", ") + std::string(key) + " " + shortest_decimal(v->get<double>());
    if (!dropout.empty())
      std::printf(
          " note: --use-checkpoint-args: %s's args set %s, which Megatron-LM trains with; Trestle trains "
          "without dropout\n",
          source.c_str(), dropout.c_str());
    std::fflush(stdout);
  }
  if (const auto unlike = megatron_defaults_unlike(args, *spec); !unlike.empty() && reporting && !checkpoint_args) {
    std::string listed;
    for (const auto& flag : unlike) listed += (listed.empty() ? "" : "; ") + flag;
    std::printf(
        " note: these Megatron-LM flags are not given, and Megatron's defaults would build another model "
        "than %s's (trained here as it is): %s\n",
        source.c_str(), listed.c_str());
    std::fflush(stdout);
  }
  if (model.contains("hf") && model["hf"].contains("config") && reporting) {
    if (const std::string untrained = untrained_regularizers(model["hf"]["config"], args); !untrained.empty()) {
      std::printf(" note: %s sets %s: Trestle trains without dropout and router jitter (as with them at 0)\n",
                  source.c_str(), untrained.c_str());
      std::fflush(stdout);
    }
  }
  TRESTLE_ASSIGN_OR_RETURN(ParallelLayout layout, pipeline_layout(args, sizes, *spec));
  TRESTLE_RETURN_IF_ERROR(check_layout(layout, spec->num_layers, spec->num_query_groups, spec->num_experts));
  if (Status mlp = check_mlp_split(*spec, layout.tp, layout.expert_tp()); !mlp.ok())
    return Status::Error(source + ": " + mlp.message());
  if (Status rope = train::check_rotary_dims(*spec); !rope.ok()) return Status::Error(source + ": " + rope.message());
  TRESTLE_RETURN_IF_ERROR(check_run_fits_in_memory(*spec, layout, config, source));
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
    if (auto split = data::parse_split(data.split); !split.ok()) return split.status();
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

// Megatron-LM's --use-checkpoint-args without --seq-length: the length the --pretrained-checkpoint's run trained with,
// else the --load's (load_args_from_checkpoint reads both, in that order, and sets it where the command line did not).
Result<std::int64_t> seq_length_from_checkpoint(const cxxopts::ParseResult& args) {
  std::vector<std::pair<std::string, std::optional<std::int64_t>>> roots;
  if (args.count("pretrained-checkpoint"))
    roots.emplace_back(args["pretrained-checkpoint"].as<std::string>(), std::nullopt);
  if (args.count("load")) {
    std::optional<std::int64_t> step = optional_arg<std::int64_t>(args, "ckpt-step");
    if (step == 0) step.reset();  // (the tracker's, as for the load itself)
    roots.emplace_back(args["load"].as<std::string>(), step);
  }
  std::string searched;
  for (const auto& [root, step] : roots) {
    auto found = checkpoint_seq_length(root, step);
    if (!found.ok()) return found.status().with_context("--use-checkpoint-args: the sequence length of " + root);
    if (*found) return **found;
    searched += (searched.empty() ? "" : " nor ") + root;
  }
  return Status::Error("--seq-length is required: --use-checkpoint-args found no sequence length in " + searched +
                       " (no checkpoint there, or one whose run recorded none: a Hugging Face conversion)");
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
  if (!args.count(seq_flag) && !args.count("use-checkpoint-args")) return Status::Error("--seq-length is required");
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
  if (args.count("use-checkpoint-args") && !c.load && !args.count("pretrained-checkpoint"))  // Megatron's assertion
    return Status::Error("--use-checkpoint-args requires --load or --pretrained-checkpoint argument");
  c.load_iteration = optional_arg<std::int64_t>(args, "ckpt-step");
  // Megatron reads --ckpt-step only when it is not 0 (`if getattr(args, 'ckpt_step', None)`): 0 is the tracker's.
  if (c.load_iteration && *c.load_iteration < 0)
    return Status::Error("--ckpt-step " + std::to_string(*c.load_iteration) + " is not an iteration (0 or more)");
  if (c.load_iteration == 0) c.load_iteration.reset();
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
  // As Megatron-LM's validate_args: under bf16, --grad-reduce-in-bf16 wins over --accumulate-allreduce-grads-in-fp32.
  c.grads_in_fp32 = c.bf16 ? !args.count("grad-reduce-in-bf16") : args.count("accumulate-allreduce-grads-in-fp32") > 0;
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
  if (args.count(seq_flag)) {
    c.seq_length = args[seq_flag].as<std::int64_t>();
  } else {
    TRESTLE_ASSIGN_OR_RETURN(c.seq_length, seq_length_from_checkpoint(args));
  }
  if (c.micro_batch_size < 1 || c.seq_length < 1 || c.global_batch_size < 1)
    return Status::Error("--micro-batch-size, --global-batch-size and --seq-length must be positive");
  if (c.seq_length > std::numeric_limits<std::int32_t>::max() - 1)  // (its samples' seq + 1 tokens)
    return Status::Error("--seq-length " + std::to_string(c.seq_length) +
                         " is more than the 2147483646 tokens a sample can hold (the dataset counts a sample's "
                         "tokens in an int32, as Megatron's)");
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
    // Each batch the ramp-up passes through must divide into micro-batches of every data-parallel rank (megatron-core's
    // calculator asserts it when the ramp-up reaches it): refused before anything is read.
    for (std::int64_t batch = c.rampup->start; batch < c.global_batch_size; batch += c.rampup->increment)
      TRESTLE_RETURN_IF_ERROR(
          train::make_batch_shape(c.micro_batch_size, batch, layout.dp(), c.decrease_batch_size_if_needed)
              .status()
              .with_context("--rampup-batch-size: its global batch " + std::to_string(batch)));
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
  for (const char* flag : {"lr-decay-iters", "lr-decay-samples"})
    if (args.count(flag) && args[flag].as<std::int64_t>() < 1)
      return Status::Error("--" + std::string(flag) + " " + std::to_string(args[flag].as<std::int64_t>()) +
                           ": the decay must last at least one step (Megatron's OptimizerParamScheduler asserts it)");
  LrScheduleConfig flags_only = s;
  if (flags_only.warmup_steps >= 0)
    flags_only.decay_steps =
        std::max(flags_only.decay_steps, static_cast<std::int64_t>(std::ceil(flags_only.warmup_steps)) + 1);
  TRESTLE_RETURN_IF_ERROR(LrSchedule::create(flags_only).status());
  c.save = optional_arg<std::string>(args, "save");
  if (args.count("save-interval") && args.count("persistent-save-interval") &&
      args["save-interval"].as<std::int64_t>() != args["persistent-save-interval"].as<std::int64_t>())
    return Status::Error("--save-interval and --persistent-save-interval (its other name) give two intervals");
  c.save_interval = args.count("persistent-save-interval") ? args["persistent-save-interval"].as<std::int64_t>()
                                                           : args["save-interval"].as<std::int64_t>();
  c.exit_interval = args.count("exit-interval") ? args["exit-interval"].as<std::int64_t>() : 0;
  if (c.exit_interval < 0)  // (0, as Megatron's, exits at no interval)
    return Status::Error("--exit-interval " + std::to_string(c.exit_interval) + " must not be negative");
  if (args.count("iterations-to-skip"))
    for (const std::int64_t i : args["iterations-to-skip"].as<std::vector<std::int64_t>>()) {
      // 1-indexed, as Megatron-LM reads them since core_v0.17 (`(iteration + 1) in args.iterations_to_skip`): N
      // passes over the batch of iteration N. (Up to core_v0.16 it passed over iteration N + 1's.)
      if (i < 1)
        return Status::Error("--iterations-to-skip " + std::to_string(i) +
                             ": iterations are counted from 1 (N passes over iteration N's batch)");
      c.iterations_to_skip.insert(i);
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
  c.tensorboard_choices.loss_scale =
      !args.count("no-log-loss-scale-to-tensorboard") && !args.count("disable-log-loss-scale-to-tensorboard");
  c.tensorboard_choices.timers = args.count("log-timers-to-tensorboard") > 0;
  c.log_throughput = args.count("log-throughput") > 0;
  c.tensorboard_choices.world_size = args.count("log-world-size-to-tensorboard") > 0;
  c.tensorboard_choices.validation_ppl = args.count("log-validation-ppl-to-tensorboard") > 0;
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
    c.profile.record_shapes = args.count("pytorch-profiler-collect-shapes") > 0 || args.count("record-shapes") > 0;
  }
  c.json_log = optional_arg<std::string>(args, "log-json");
  c.peak_tflops = optional_arg<double>(args, "peak-tflops");
  c.exit_on_save_failure = args["exit-on-save-failure"].as<bool>() && !args.count("no-exit-on-save-failure");
  // As Megatron-LM's validate_args: fp16 with a dynamic loss scale (no --loss-scale) leaves an inf or NaN loss to the
  // scaler, which skips the step, rather than stopping.
  c.check_for_nan_in_loss_and_grad = args["check-for-nan-in-loss-and-grad"].as<bool>() &&
                                     !args.count("no-check-for-nan-in-loss-and-grad") &&
                                     !(c.fp16 && !args.count("loss-scale"));
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

// One worker's run from its rendezvous on: its exit code.
int train_worker(const cxxopts::ParseResult& args, const parallel::Rendezvous& rendezvous,
                 std::chrono::milliseconds timeout, int argc, char** argv) {
  auto layout = layout_for(args, rendezvous.world_size);
  if (!layout.ok()) {
    std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous.rank,
                 printable_text(layout.status().message()).c_str());
    return 2;
  }
  std::optional<train::TrainConfig> config;
  if (!args.count("test-collectives")) {
    auto c = train_config(args, *layout);
    if (!c.ok()) {
      std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous.rank,
                   printable_text(c.status().message()).c_str());
      return 2;
    }
    c->args = recorded_arguments(argc, argv);
    auto missing = drop_missing_load(args, *c);
    if (!missing.ok()) {
      std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous.rank,
                   printable_text(missing.status().message()).c_str());
      return 1;
    }
    if (*missing && rendezvous.rank == rendezvous.world_size - 1) std::printf("%s\n", (*missing)->c_str());
    config.emplace(std::move(*c));
    auto ignored = given_flags_without_effect(args);
    // (The torch_dist form of a distributed optimizer's state is laid out for a Megatron-LM run with these.)
    if (args.count("ckpt-format") && args["ckpt-format"].as<std::string>() == "torch_dist" &&
        config->use_distributed_optimizer)
      std::erase_if(ignored, [](const std::string& flag) {
        return flag == "--overlap-grad-reduce" || flag.starts_with("--transformer-impl");
      });
    // The tokenizer's files give the end-of-document token where --eod-mask-loss or --reset-attention-mask needs one
    // and --eod-token-id is not given (config's eod_token_id came from them): they have an effect then.
    if (config->eod_token_id >= 0 && args["eod-token-id"].as<std::int64_t>() < 0)
      std::erase_if(ignored, [](const std::string& flag) {
        return flag.starts_with("--tokenizer-type") || flag.starts_with("--tokenizer-model") ||
               flag.starts_with("--vocab-file");
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
    if (!ignored.empty() && rendezvous.rank == rendezvous.world_size - 1) {
      std::string listed;
      for (const auto& flag : ignored) listed += (listed.empty() ? "" : ", ") + flag;
      std::printf(" note: Megatron-LM flags without effect here (trestle train --help says why): %s\n", listed.c_str());
      std::fflush(stdout);
    }
    // A Megatron-LM script (its model described by flags) that leaves dropout out trains with Megatron's 0.1 there.
    // (Under --use-checkpoint-args Megatron takes dropout from the checkpoint.)
    const bool megatron_model =
        (args.count("num-layers") || args.count("hidden-size")) && !(args.count("use-checkpoint-args") && config->load);
    if (megatron_model && (!args.count("hidden-dropout") || !args.count("attention-dropout")) &&
        rendezvous.rank == rendezvous.world_size - 1) {
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
    config->device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(rendezvous.local_rank));
    if (auto s = use_gpu(config->device); !s.ok()) {
      std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous.rank, printable_text(s.message()).c_str());
      return 1;
    }
    // Megatron's TransformerConfig: bf16 GEMMs on the GPU without cuBLAS's reduced-precision reductions.
    if (config->bf16 && args.count("disable-bf16-reduced-precision-matmul"))
      at::globalContext().setAllowBF16ReductionCuBLAS(false);
    options.backend = parallel::BackendKind::kNccl;
  }
  auto state = ParallelState::create(*layout, rendezvous, options);
  if (!state.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", printable_text(state.status().message()).c_str());
    return 1;
  }
  if (args.count("test-collectives"))
    return check_collectives(*state, args["test-sleep-seconds"].as<int>(), args["test-kill-rank"].as<int>());
  auto converted = convert_megatron_load(args, *config, *state, rendezvous);
  Status status = converted.ok() ? describe_model(args, *layout, *config, rendezvous.rank == rendezvous.world_size - 1)
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
  if (converted.ok() && *converted && rendezvous.local_rank == 0) {
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

int run_worker(const cxxopts::ParseResult& args, std::chrono::milliseconds timeout, int argc, char** argv) {
  // A peer that dies closes its sockets under this rank's writes: Gloo's pairs and the c10d store's server write with
  // writev() and write(), which raise SIGPIPE, and its default action ended the rank as "killed by signal 13" where it
  // should fail naming the group it waited on. Ignored, those writes fail with EPIPE and become errors, as in
  // Python's workers (Python ignores SIGPIPE at start-up). SIGXFSZ likewise (Python ignores it too): a save past
  // `ulimit -f` fails with EFBIG naming its file, as a full disk does, instead of killing the rank.
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGXFSZ, SIG_IGN);
  if (Status tied = parallel::die_with_launcher(); !tied.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", printable_text(tied.message()).c_str());
    return 1;
  }
  auto rendezvous = parallel::rendezvous_from_environment(timeout);
  if (!rendezvous.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", printable_text(rendezvous.status().message()).c_str());
    return 1;
  }
  const int code = train_worker(args, *rendezvous, timeout, argc, argv);
  if (Status left = parallel::leave_rendezvous(*rendezvous, code == 0, timeout); !left.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", printable_text(left.message()).c_str());
    return code != 0 ? code : 1;
  }
  return code;
}

}  // namespace

int train_main(int argc, char** argv) {
  cxxopts::Options spec = train_options();
  try {
    const auto args = parse_train_options(spec, argc, argv);
    if (args.count("help")) {
      std::cout << train_help(spec) << "\n";
      return 0;
    }
    if (args.count("print-groups")) return print_groups(args, args["print-groups"].as<int>());
    if (!check_launch_flags(args)) return 2;
    if (args.count("nproc-per-node")) {
      std::error_code error;
      const auto self = std::filesystem::read_symlink("/proc/self/exe", error);
      if (error) {
        std::fprintf(stderr, "trestle train: cannot find this executable: %s\n", error.message().c_str());
        return 1;
      }
      return launch_train_workers(args, argc, argv, self.string());
    }
    const auto timeout =
        args.count("distributed-timeout-seconds")
            ? std::chrono::milliseconds(std::chrono::seconds(args["distributed-timeout-seconds"].as<int>()))
            : std::chrono::milliseconds(std::chrono::minutes(args["distributed-timeout-minutes"].as<int>()));
    return run_worker(args, timeout, argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    std::cerr << "trestle train: " << describe_parse_error(e, argc, argv) << "\n";
    return 2;
  } catch (const std::system_error& e) {  // a thread or lock the machine would not give (out of threads, say)
    std::cerr << "trestle train: " << e.what() << " (" << e.code().message() << ")\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "trestle train: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace trestle::cli
