// trestle train: launches the job's local workers (--nproc-per-node) or, as a worker started by it, torchrun or Slurm,
// joins the c10d rendezvous and sets up Megatron's parallel state (coordinates and process groups) for the layout.
#include <ATen/ops/full.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cxxopts.hpp>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "parallel/launcher.h"
#include "parallel/parallel_state.h"
#include "tools/command.h"
#include "tools/train.h"

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
  const int model = layout.tp * layout.pp * layout.cp;
  if (model < 1 || world_size % model != 0)
    return Status::Error("world size " + std::to_string(world_size) + " is not divisible by tensor x pipeline x context " +
                         "parallel size " + std::to_string(model));
  layout.data_parallel = world_size / model;
  return layout;
}

// Every group of every kind as JSON {"tp": [[0,1],...], ...} (compared with megatron-core's rank generator).
int print_groups(const cxxopts::ParseResult& args, int world_size) {
  auto layout = layout_for(args, world_size);
  nlohmann::json out;
  for (GroupKind kind : parallel::kAllGroupKinds) {
    auto groups = layout.ok() ? parallel::group_ranks(*layout, kind) : Result<std::vector<std::vector<int>>>(layout.status());
    if (!groups.ok()) {
      std::fprintf(stderr, "trestle train: %s\n", groups.status().message().c_str());
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

int run_worker(const cxxopts::ParseResult& args, std::chrono::milliseconds timeout) {
  auto rendezvous = parallel::rendezvous_from_environment(timeout);
  if (!rendezvous.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", rendezvous.status().message().c_str());
    return 1;
  }
  auto layout = layout_for(args, rendezvous->world_size);
  if (!layout.ok()) {
    std::fprintf(stderr, "trestle train: rank %d: %s\n", rendezvous->rank, layout.status().message().c_str());
    return 1;
  }
  parallel::ParallelStateOptions options;
  options.timeout = timeout;
  auto state = ParallelState::create(*layout, *rendezvous, options);
  if (!state.ok()) {
    std::fprintf(stderr, "trestle train: %s\n", state.status().message().c_str());
    return 1;
  }
  if (args.count("test-collectives"))
    return check_collectives(*state, args["test-sleep-seconds"].as<int>(), args["test-kill-rank"].as<int>());
  const auto& c = state->coordinates();
  std::printf("rank %d of %d: tp %d/%d, cp %d/%d, dp %d/%d, pp %d/%d, ep %d/%d\n", state->rank(), state->world_size(),
              c.tp_rank, layout->tp, c.cp_rank, layout->cp, c.dp_rank, layout->dp(), c.pp_rank, layout->pp, c.ep_rank,
              layout->ep);
  return 0;
}

}  // namespace


int train_main(int argc, char** argv) {
  cxxopts::Options spec("trestle train",
                        "Start a training job's workers and set up Megatron's parallel state over c10d (Gloo on CPU).\n"
                        "With --nproc-per-node N, starts N local workers of itself with torchrun's variables and\n"
                        "forwards their output prefixed by rank; when one fails, the others are terminated and the\n"
                        "job exits with its code. Without it, the process is a worker: torchrun's variables (RANK,\n"
                        "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or Slurm's give its place in the job.\n"
                        "Data parallel size = world size / (tensor x pipeline x context parallel size).");
  spec.add_options("launch")("nproc-per-node", "start this many local workers", cxxopts::value<int>())(
      "master-addr", "address of rank 0's c10d store", cxxopts::value<std::string>()->default_value("127.0.0.1"))(
      "master-port", "port of rank 0's c10d store (default: a free port)", cxxopts::value<int>()->default_value("0"))(
      "distributed-timeout-minutes", "rendezvous and collective timeout", cxxopts::value<int>()->default_value("10"));
  spec.add_options("parallel")("tensor-model-parallel-size", "tensor parallel size", cxxopts::value<int>()->default_value("1"))(
      "pipeline-model-parallel-size", "pipeline parallel size", cxxopts::value<int>()->default_value("1"))(
      "context-parallel-size", "context parallel size", cxxopts::value<int>()->default_value("1"))(
      "expert-model-parallel-size", "expert parallel size", cxxopts::value<int>()->default_value("1"));
  // Hidden: used by the tests.
  spec.add_options("test")("distributed-timeout-seconds", "timeout in seconds (overrides the minutes)", cxxopts::value<int>())(
      "test-collectives", "all-reduce in every group and print the sums")(
      "test-sleep-seconds", "sleep before the collectives", cxxopts::value<int>()->default_value("0"))(
      "test-kill-rank", "this rank SIGKILLs itself before its collectives", cxxopts::value<int>()->default_value("-1"))(
      "print-groups", "print every group's ranks for this world size as JSON and exit", cxxopts::value<int>());
  spec.add_options()("h,help", "show this help");
  try {
    const auto args = spec.parse(argc, argv);
    if (args.count("help")) {
      std::cout << spec.help({"", "launch", "parallel"}) << "\n";
      return 0;
    }
    if (args.count("print-groups")) return print_groups(args, args["print-groups"].as<int>());
    const auto timeout = args.count("distributed-timeout-seconds")
                             ? std::chrono::milliseconds(std::chrono::seconds(args["distributed-timeout-seconds"].as<int>()))
                             : std::chrono::milliseconds(std::chrono::minutes(args["distributed-timeout-minutes"].as<int>()));
    if (!args.count("nproc-per-node")) return run_worker(args, timeout);

    parallel::LaunchOptions launch;
    launch.nproc = args["nproc-per-node"].as<int>();
    launch.master_addr = args["master-addr"].as<std::string>();
    launch.master_port = args["master-port"].as<int>();
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
    if (!outcome.ok()) {
      std::fprintf(stderr, "trestle train: %s\n", outcome.status().message().c_str());
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
