// Where a worker stands in its job as torchrun, srun or nothing describe it (read_launch_environment's rules), and the
// store rendezvous_from_environment makes of it under torchrun's agent (a client of the agent's store, its keys under
// the restart attempt's prefix) and under `trestle train --nproc-per-node` (rank 0 serves on the socket its launcher
// bound); leaving it, rank 0 waits for every rank.
#include "parallel/launch_environment.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <future>
#include <map>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>
#include <vector>

#include "parallel/store_collective.h"
#include "tests/support/loopback_listener.h"
#include "tests/support/status_matchers.h"

namespace {

using trestle::fails_with;
using trestle::parallel::LaunchEnvironment;
using trestle::parallel::read_launch_environment;
using trestle::parallel::slurm_job_port;

using Variables = std::map<std::string, std::string>;

trestle::Result<LaunchEnvironment> read(const Variables& variables) {
  return read_launch_environment([&](const std::string& name) -> std::optional<std::string> {
    const auto it = variables.find(name);
    return it == variables.end() || it->second.empty() ? std::nullopt : std::optional<std::string>(it->second);
  });
}

LaunchEnvironment read_ok(const Variables& variables) {
  auto out = read(variables);
  EXPECT_TRUE(out.ok()) << out.status().message();
  return out.ok() ? *out : LaunchEnvironment{};
}

// What torchrun's agent gives worker 1 of the second node of a job of 2 nodes x 2, restarted once (torch's
// local_elastic_agent.py, _start_workers).
const Variables kTorchrun = {{"RANK", "3"},
                             {"LOCAL_RANK", "1"},
                             {"WORLD_SIZE", "4"},
                             {"GROUP_RANK", "1"},
                             {"LOCAL_WORLD_SIZE", "2"},
                             {"GROUP_WORLD_SIZE", "2"},
                             {"MASTER_ADDR", "n0"},
                             {"MASTER_PORT", "29400"},
                             {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                             {"TORCHELASTIC_RESTART_COUNT", "1"},
                             {"TORCHELASTIC_MAX_RESTARTS", "3"},
                             {"TORCHELASTIC_RUN_ID", "job"}};

// What srun gives task 2 (the first of the second node) of 4 tasks on gpu[03-04].
const Variables kSlurm = {{"SLURM_PROCID", "2"},
                          {"SLURM_STEP_ID", "0"},
                          {"SLURM_NTASKS", "4"},
                          {"SLURM_LOCALID", "0"},
                          {"SLURM_NODEID", "1"},
                          {"SLURM_JOB_ID", "4312345"},
                          {"SLURM_STEP_NODELIST", "gpu[03-04]"},
                          {"SLURM_JOB_NODELIST", "gpu[01-04]"},
                          {"SLURM_NODELIST", "gpu[01-04]"}};

Variables with(Variables base, const Variables& changes) {
  for (const auto& [name, value] : changes) base[name] = value;
  return base;
}

TEST(LaunchEnvironment, NothingSetIsASingleProcess) {
  const auto single = read_ok({});
  EXPECT_EQ(single.rank, 0);
  EXPECT_EQ(single.world_size, 1);
  EXPECT_EQ(single.launcher, "a single process");
  EXPECT_TRUE(single.master_addr.empty());
}

TEST(LaunchEnvironment, TorchrunUnderItsC10dRendezvous) {
  const auto e = read_ok(kTorchrun);
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.node, 1);
  EXPECT_EQ(e.master_addr, "n0");
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_TRUE(e.store_served_by_agent);
  EXPECT_EQ(e.store_prefix, "/worker/attempt_1");
}

TEST(LaunchEnvironment, TorchrunStyleVariablesAlone) {
  // `trestle train --nproc-per-node`, or torchrun with the static rendezvous: rank 0 serves the store, no prefix.
  const auto e = read_ok(
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_FALSE(e.store_served_by_agent);
  EXPECT_EQ(e.store_prefix, "");
  EXPECT_EQ(e.node, 0);
  // Without GROUP_RANK the node is named by its first rank.
  EXPECT_EQ(read_ok(with(kTorchrun, {{"GROUP_RANK", ""}})).node, 2);
  // torch only promises the agent's store when the flag is exactly "True".
  EXPECT_FALSE(read_ok(with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "False"}})).store_served_by_agent);
  EXPECT_EQ(read_ok(with(kTorchrun, {{"TORCHELASTIC_RESTART_COUNT", "0"}})).store_prefix, "/worker/attempt_0");
}

TEST(LaunchEnvironment, TorchrunErrorsNameTheVariable) {
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"MASTER_PORT", ""}})),
                         "MASTER_ADDR and MASTER_PORT must be set for a job of 4 ranks"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"RANK", "x"}})), "environment variable RANK='x' is not a number"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"RANK", "-1"}})), "RANK='-1' is not a number"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"WORLD_SIZE", "99999999999"}})), "WORLD_SIZE='99999999999'"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"RANK", "4"}})), "torchrun gives rank 4, not below the world size 4"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"WORLD_SIZE", "0"}})), "torchrun gives a world size of 0"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"MASTER_PORT", "70000"}})), "the store's port 70000 is not in"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"TORCHELASTIC_RESTART_COUNT", "one"}})),
                         "TORCHELASTIC_RESTART_COUNT='one' is not a number"));
  // A node's ranks number 0 .. LOCAL_WORLD_SIZE - 1 (on a GPU the local rank picks the device).
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"LOCAL_RANK", "2"}})),
                         "torchrun gives LOCAL_RANK 2 of LOCAL_WORLD_SIZE 2 in a world of 4"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "8"}})), "LOCAL_WORLD_SIZE 8 in a world of 4"));
  EXPECT_TRUE(
      fails_with(read(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "two"}})), "LOCAL_WORLD_SIZE='two' is not a number"));
  EXPECT_TRUE(fails_with(read(with(kTorchrun, {{"LOCAL_WORLD_SIZE", ""}, {"RANK", "0"}})),
                         "torchrun gives local rank 1 to rank 0: a local rank cannot exceed its global rank"));
  EXPECT_TRUE(fails_with(read(with(kSlurm, {{"SLURM_LOCALID", "3"}})), "Slurm gives local rank 3 to rank 2"));
}

TEST(LaunchEnvironment, SlurmStoreOnTheStepsFirstHostAtThePortOfTheJob) {
  const auto e = read_ok(kSlurm);
  EXPECT_EQ(e.launcher, "Slurm");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.node, 1);
  EXPECT_EQ(e.master_addr, "gpu03");
  EXPECT_EQ(e.master_port, 15000 + 2345);
  EXPECT_FALSE(e.store_served_by_agent);
  // Jobs whose ids end alike share a port: their keys apart, by job (and step).
  EXPECT_EQ(e.store_prefix, "/slurm_job_4312345.0");
  // Two steps of one job side by side on a node: other keys and another port.
  const auto step3 = read_ok(with(kSlurm, {{"SLURM_STEP_ID", "3"}}));
  EXPECT_EQ(step3.store_prefix, "/slurm_job_4312345.3");
  EXPECT_EQ(step3.master_port, 15000 + 2348);
  EXPECT_EQ(read_ok(with(kSlurm, {{"SLURM_STEP_ID", ""}, {"SLURM_STEPID", "5"}})).store_prefix, "/slurm_job_4312345.5");
  // srun -n fewer than the allocation's tasks: the step's count.
  EXPECT_EQ(read_ok(with(kSlurm, {{"SLURM_STEP_NUM_TASKS", "3"}})).world_size, 3);
  // Without the step's list, the job's; then the old name.
  EXPECT_EQ(read_ok(with(kSlurm, {{"SLURM_STEP_NODELIST", ""}})).master_addr, "gpu01");
  EXPECT_EQ(read_ok(with(kSlurm, {{"SLURM_STEP_NODELIST", ""}, {"SLURM_JOB_NODELIST", ""}, {"SLURM_NODELIST", "x7"}}))
                .master_addr,
            "x7");
  // The script's MASTER_ADDR and MASTER_PORT win.
  const auto set = read_ok(with(kSlurm, {{"MASTER_ADDR", "head"}, {"MASTER_PORT", "6000"}}));
  EXPECT_EQ(set.master_addr, "head");
  EXPECT_EQ(set.master_port, 6000);
  // Without SLURM_NODEID the node is named by its first rank.
  EXPECT_EQ(read_ok(with(kSlurm, {{"SLURM_NODEID", ""}, {"SLURM_PROCID", "3"}, {"SLURM_LOCALID", "1"}})).node, 2);
}

TEST(LaunchEnvironment, ABatchScriptIsNoSlurmTask) {
  // sbatch's script has SLURM_PROCID 0 and SLURM_NTASKS of the allocation, but no step id (or one of Slurm's own
  // steps'): a single process, as torchrun and Megatron-LM take it, not rank 0 of tasks that never come.
  EXPECT_EQ(read_ok(with(kSlurm, {{"SLURM_STEP_ID", ""}, {"SLURM_PROCID", "0"}})).launcher, "a single process");
  EXPECT_EQ(read_ok(with(kSlurm, {{"SLURM_STEP_ID", "4294967291"}, {"SLURM_PROCID", "0"}})).world_size, 1);
  EXPECT_EQ(read_ok(with(kSlurm, {{"SLURM_STEP_ID", "4294967292"}})).launcher, "a single process");
}

TEST(LaunchEnvironment, RankWinsOverSlurm) {
  // torchrun started by srun: torchrun's variables describe the worker.
  const auto e = read_ok(with(kSlurm, kTorchrun));
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.master_addr, "n0");
}

TEST(LaunchEnvironment, SlurmErrorsSayWhatToSet) {
  EXPECT_TRUE(
      fails_with(read(with(kSlurm, {{"SLURM_STEP_NODELIST", ""}, {"SLURM_JOB_NODELIST", ""}, {"SLURM_NODELIST", ""}})),
                 "a Slurm job of 4 tasks needs its store's host: set MASTER_ADDR"));
  EXPECT_TRUE(fails_with(read(with(kSlurm, {{"SLURM_JOB_ID", ""}})),
                         "a Slurm job of 4 tasks needs its store's port: set MASTER_PORT, or SLURM_JOB_ID"));
  EXPECT_TRUE(fails_with(read(with(kSlurm, {{"SLURM_STEP_NODELIST", "gpu[03-"}})),
                         "environment variable SLURM_STEP_NODELIST: Slurm host list 'gpu[03-': the '[' at offset 3"));
  EXPECT_TRUE(fails_with(read(with(kSlurm, {{"SLURM_NTASKS", ""}})), "environment variable SLURM_NPROCS is not set"));
  EXPECT_TRUE(
      fails_with(read(with(kSlurm, {{"SLURM_PROCID", "4"}})), "Slurm gives rank 4, not below the world size 4"));
  // One task needs no store.
  EXPECT_TRUE(read(with(kSlurm, {{"SLURM_NTASKS", "1"}, {"SLURM_PROCID", "0"}, {"SLURM_JOB_ID", ""}})).ok());
}

TEST(LaunchEnvironment, SlurmJobPort) {
  EXPECT_EQ(*slurm_job_port("7", "0"), 15007);
  EXPECT_EQ(*slurm_job_port("123456789", "0"), 15000 + 6789);
  EXPECT_EQ(*slurm_job_port("10000", "0"), 15000);
  EXPECT_EQ(*slurm_job_port("19999", "1"), 15000);
  EXPECT_EQ(*slurm_job_port("7", "2"), 15009);
  EXPECT_TRUE(fails_with(slurm_job_port("12_3", "0"), "SLURM_JOB_ID='12_3' is not a number"));
}

// Sets environment variables for one test and restores them after.
class ScopedEnvironment {
 public:
  explicit ScopedEnvironment(const Variables& variables) {
    for (const auto& [name, value] : variables) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      ::setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~ScopedEnvironment() {
    for (const auto& [name, value] : saved_) {
      if (value) ::setenv(name.c_str(), value->c_str(), 1);
      else ::unsetenv(name.c_str());
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

// Rank 0 under torchrun's agent: the agent already serves the store at MASTER_ADDR:MASTER_PORT, so rank 0 must connect
// to it, not try to serve it (its port is taken); and what it writes lands under the attempt's prefix, apart from the
// keys of the attempt before.
TEST(LaunchEnvironment, RankZeroUnderTheAgentIsAClientOfItsStoreAndKeepsToItsAttempt) {
  c10d::TCPStoreOptions server_options;
  server_options.port = 0;
  server_options.isServer = true;
  server_options.waitWorkers = false;
  auto agent_store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", server_options);
  agent_store->set("/worker/attempt_0/trestle/state/arrived/0", std::vector<uint8_t>{1});
  const ScopedEnvironment environment({{"RANK", "0"},
                                       {"WORLD_SIZE", "2"},
                                       {"LOCAL_RANK", "0"},
                                       {"GROUP_RANK", "0"},
                                       {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", std::to_string(agent_store->getPort())},
                                       {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                       {"TORCHELASTIC_RESTART_COUNT", "1"}});
  auto rendezvous = trestle::parallel::rendezvous_from_environment(std::chrono::seconds(10));
  ASSERT_TRUE(rendezvous.ok()) << rendezvous.status().message();
  EXPECT_EQ(rendezvous->store_address, "127.0.0.1:" + std::to_string(agent_store->getPort()));
  EXPECT_FALSE(rendezvous->store->check({"trestle/state/arrived/0"}));  // the dead attempt's key is not seen
  rendezvous->store->set("trestle/state/arrived/0", std::vector<uint8_t>{2});
  EXPECT_EQ(agent_store->get("/worker/attempt_1/trestle/state/arrived/0"), std::vector<uint8_t>{2});
}

// With nothing served at the agent's address, rank 0 fails to reach the store rather than serve one of its own: a
// store only rank 0's node could see would split the job.
TEST(LaunchEnvironment, RankZeroUnderTheAgentNeverServesTheStore) {
  int port = 0;
  {
    c10d::TCPStoreOptions options;
    options.port = 0;
    options.isServer = true;
    options.waitWorkers = false;
    port = c10d::TCPStore("127.0.0.1", options).getPort();  // a port that was free, closed again
  }
  const ScopedEnvironment environment({{"RANK", "0"},
                                       {"WORLD_SIZE", "2"},
                                       {"LOCAL_RANK", "0"},
                                       {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", std::to_string(port)},
                                       {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                       {"TORCHELASTIC_RESTART_COUNT", "0"}});
  EXPECT_TRUE(fails_with(trestle::parallel::rendezvous_from_environment(std::chrono::seconds(1)),
                         "rank 0 (torchrun): cannot reach the c10d TCPStore at 127.0.0.1:" + std::to_string(port)));
}

}  // namespace

namespace {

// Who set RANK and WORLD_SIZE is named in the worker's errors: torchrun's agent, trestle's launcher, or a hand.
TEST(LaunchEnvironment, NamesWhoStartedTheRank) {
  auto launcher = [](std::vector<std::pair<std::string, std::string>> extra) {
    std::map<std::string, std::string> variables = {{"RANK", "0"}, {"WORLD_SIZE", "1"}};
    for (auto& [k, v] : extra) variables[k] = v;
    auto read = trestle::parallel::read_launch_environment([&](const std::string& name) -> std::optional<std::string> {
      const auto found = variables.find(name);
      return found == variables.end() ? std::nullopt : std::optional<std::string>(found->second);
    });
    return read.ok() ? read->launcher : read.status().message();
  };
  EXPECT_EQ(launcher({{"TORCHELASTIC_RUN_ID", "job"}}), "torchrun");
  EXPECT_EQ(launcher({{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TRESTLE_LAUNCHER_PID", "12"}}), "trestle train");
  EXPECT_EQ(launcher({}), "the RANK / WORLD_SIZE environment");
}

// Rank 0 of a local launch: the store's listening socket from its launcher (TRESTLE_STORE_LISTEN_FD), for rank 0 alone.
TEST(LaunchEnvironment, OnlyRankZeroOfALocalLaunchTakesTheStoresSocket) {
  const Variables local = {{"RANK", "0"},
                           {"WORLD_SIZE", "2"},
                           {"LOCAL_RANK", "0"},
                           {"MASTER_ADDR", "127.0.0.1"},
                           {"MASTER_PORT", "1234"},
                           {"TRESTLE_LAUNCHER_PID", "12"},
                           {"TRESTLE_STORE_LISTEN_FD", "3"}};
  EXPECT_EQ(read_ok(local).store_listen_fd, std::optional<int>(3));
  EXPECT_EQ(read_ok(with(local, {{"TRESTLE_STORE_LISTEN_FD", ""}})).store_listen_fd, std::nullopt);
  EXPECT_TRUE(fails_with(read(with(local, {{"RANK", "1"}, {"LOCAL_RANK", "1"}})),
                         "TRESTLE_STORE_LISTEN_FD is set for rank 1: only rank 0 of a local launch serves the store"));
  EXPECT_TRUE(fails_with(read(with(local, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}})),
                         "is set for rank 0 under torchrun's agent store"));
  EXPECT_TRUE(fails_with(read(with(local, {{"TRESTLE_STORE_LISTEN_FD", "x"}})), "TRESTLE_STORE_LISTEN_FD='x'"));
}

// Rank 0 serves the job's store on the listening socket it was handed, and another rank reaches it at MASTER_PORT.
TEST(LaunchEnvironment, RankZeroServesTheStoreOnTheSocketItsLauncherBound) {
  trestle::testing::LoopbackListener listener;
  ASSERT_GT(listener.port(), 0);
  const int port = listener.port(), fd = listener.release();  // the store closes it
  const ScopedEnvironment environment({{"RANK", "0"},
                                       {"WORLD_SIZE", "2"},
                                       {"LOCAL_RANK", "0"},
                                       {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", std::to_string(port)},
                                       {"TRESTLE_LAUNCHER_PID", std::to_string(::getpid())},
                                       {"TRESTLE_STORE_LISTEN_FD", std::to_string(fd)}});
  auto rendezvous = trestle::parallel::rendezvous_from_environment(std::chrono::seconds(10));
  ASSERT_TRUE(rendezvous.ok()) << rendezvous.status().message();
  EXPECT_TRUE(rendezvous->store_served_by_rank_0);
  rendezvous->store->set("served", std::vector<uint8_t>{7});
  c10d::TCPStoreOptions client;
  client.port = static_cast<std::uint16_t>(port);
  client.isServer = false;
  client.timeout = std::chrono::seconds(10);
  c10d::TCPStore other("127.0.0.1", client);
  EXPECT_EQ(other.get("served"), std::vector<uint8_t>{7});
}

// Leaving: rank 0, which serves the store, returns only once every rank has left (or fails after the timeout, naming
// it) unless it failed itself; the other ranks do not wait.
TEST(LeaveRendezvous, RankZeroWaitsForEveryRank) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto rank = [&](int r) {
    trestle::parallel::Rendezvous out;
    out.rank = r;
    out.world_size = 3;
    out.store = store;
    out.store_served_by_rank_0 = true;
    return out;
  };
  auto zero = std::async(std::launch::async,
                         [&] { return trestle::parallel::leave_rendezvous(rank(0), true, std::chrono::seconds(30)); });
  EXPECT_TRUE(trestle::parallel::leave_rendezvous(rank(1), true, std::chrono::seconds(30)).ok());
  EXPECT_EQ(zero.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);  // rank 2 is still in
  EXPECT_TRUE(trestle::parallel::leave_rendezvous(rank(2), true, std::chrono::seconds(30)).ok());
  const auto left = zero.get();
  EXPECT_TRUE(left.ok()) << left.message();

  auto alone = c10::make_intrusive<c10d::HashStore>();
  trestle::parallel::Rendezvous waiting = rank(0);
  waiting.store = alone;
  EXPECT_TRUE(fails_with(trestle::parallel::leave_rendezvous(waiting, true, std::chrono::milliseconds(200)),
                         "rank 0: its work is done, but rank(s) 1, 2 never left the job's c10d store"));
  trestle::parallel::Rendezvous one_left = rank(2);  // rank 2 leaves, rank 1 does not: rank 1 is named
  one_left.store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_TRUE(trestle::parallel::leave_rendezvous(one_left, true, std::chrono::milliseconds(200)).ok());
  one_left.rank = 0;
  EXPECT_TRUE(fails_with(trestle::parallel::leave_rendezvous(one_left, true, std::chrono::milliseconds(200)),
                         "but rank(s) 1 never left the job's c10d store (which rank 0 serves) within 0.2 s"));
  // A rank 0 that failed does not wait for the others (a dead peer would hold it for the whole timeout).
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(trestle::parallel::leave_rendezvous(waiting, false, std::chrono::seconds(30)).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // Under torchrun's agent store nobody waits.
  waiting.store_served_by_rank_0 = false;
  EXPECT_TRUE(trestle::parallel::leave_rendezvous(waiting, true, std::chrono::milliseconds(200)).ok());
}

}  // namespace
