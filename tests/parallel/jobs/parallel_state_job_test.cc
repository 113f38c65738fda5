// Megatron's parallel state over real processes: `trestle train --nproc-per-node N` jobs whose every group all-reduces
// the expected sum, a worker SIGKILLed mid-run ending the job with its rank named, a rank that never arrives failing
// the rendezvous within the timeout. (Apart from tests/parallel's other suites: these start the trestle CLI, which
// embeds CPython, so they do not run under the sanitizers.)
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace {


struct JobRun {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

// Runs a shell command line, capturing stdout and stderr together.
JobRun run(const std::string& command) {
  JobRun out;
  const auto start = std::chrono::steady_clock::now();
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return out;
  char buffer[4096];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.output.append(buffer, n);
  const int status = ::pclose(pipe);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  socklen_t length = sizeof(address);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

const std::string kTrain = std::string(TRESTLE_TRESTLE_BIN) + " train";

// A job in test mode: every group a rank belongs to (world included) prints one line, all "ok"; ranks in the first
// pipeline stage belong to `first_stage_groups` groups, the others to one fewer (no position-embedding group).
JobRun expect_all_reduces(const std::string& layout, int world, int pp, int first_stage_groups) {
  const JobRun r = run(kTrain + " --nproc-per-node " + std::to_string(world) + " " + layout +
                       " --distributed-timeout-seconds 120 --test-collectives");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "FAILED"), 0u) << r.output;
  for (int rank = 0; rank < world; ++rank) {
    const bool first_stage = rank < world / pp;
    EXPECT_EQ(count(r.output, "[rank " + std::to_string(rank) + "] ok: group "),
              static_cast<std::size_t>(first_stage ? first_stage_groups : first_stage_groups - 1))
        << "rank " << rank << "\n"
        << r.output;
  }
  return r;
}

TEST(ParallelStateJob, FourRanksTp2Dp2AllReduceInEveryGroup) {
  // World + 12 kinds: at pp 1 every rank is its own pipeline, embedding and position-embedding group.
  const JobRun r = expect_all_reduces("--tensor-model-parallel-size 2", 4, 1, 13);
  EXPECT_NE(r.output.find("[rank 3] ok: group tp [2,3] (rank 1 of 2) all-reduce sum 7 expected 7"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 3] ok: group dp [1,3] (rank 1 of 2) all-reduce sum 6 expected 6"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 0] ok: group world [0,1,2,3] (rank 0 of 4) all-reduce sum 10 expected 10"),
            std::string::npos)
      << r.output;
}

TEST(ParallelStateJob, ExpertGroupsOfTheirOwnTensorParallelism) {
  // tp 2 x dp 2 with whole experts (etp 1) over ep 2: the stage's ranks cut as etp 1 x ep 2 x expert-dp 2, so the
  // tensor-parallel pair [0,1] is an expert-parallel group and each rank its own expert-tp group.
  const JobRun r = expect_all_reduces(
      "--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 1", 4, 1, 13);
  EXPECT_NE(r.output.find("[rank 1] ok: group ep [0,1] (rank 1 of 2) all-reduce sum 3 expected 3"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 1] ok: group expert-tp [1] (rank 0 of 1) all-reduce sum 2 expected 2"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 1] ok: group expert-dp [1,3] (rank 0 of 2) all-reduce sum 6 expected 6"),
            std::string::npos)
      << r.output;
}

TEST(ParallelStateJob, EightRanksTp2Pp2Dp2AllReduceInEveryGroup) {
  // At pp 2 every rank is a first or last stage, so in an embedding group; only the first stage has position ones.
  const JobRun r = expect_all_reduces("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 8, 2, 13);
  // Ranks 4 and 5 are pipeline stage 1 of pp groups [0,4] and [1,5]; the embedding group spans both stages.
  EXPECT_NE(r.output.find("[rank 5] ok: group pp [1,5] (rank 1 of 2) all-reduce sum 8 expected 8"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 4] ok: group embedding [0,4] (rank 1 of 2) all-reduce sum 6 expected 6"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 6] ok: group tp-pp [2,3,6,7] (rank 2 of 4) all-reduce sum 22 expected 22"),
            std::string::npos)
      << r.output;
}

TEST(ParallelStateJob, KilledWorkerEndsTheJobNamingItsRank) {
  // Rank 2 SIGKILLs itself; the others sleep in their collectives' way: the launcher must end them, long before the
  // 300 s collective timeout.
  const JobRun r = run(kTrain +
                       " --nproc-per-node 4 --tensor-model-parallel-size 2 --distributed-timeout-seconds 300 "
                       "--test-collectives --test-sleep-seconds 2 --test-kill-rank 2");
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("trestle train: FAILED: rank 2 exited with signal 9"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
}

TEST(ParallelStateJob, TerminatedLauncherEndsItsWorkers) {
  // The workers would sleep 60 s; SIGTERM to the launcher alone must end them at once (exit 128 + 15).
  const JobRun r = run("/bin/bash -c '" + kTrain +
                       " --nproc-per-node 2 --test-collectives --test-sleep-seconds 60 & "
                       "pid=$!; sleep 3; kill -TERM $pid; wait $pid; echo launcher exit: $?'");
  EXPECT_NE(r.output.find("trestle train: FAILED: the launcher received signal 15"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("launcher exit: 143"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;
}

TEST(ParallelStateJob, RankThatNeverArrivesFailsTheRendezvousWithinTheTimeout) {
  // Ranks 0, 1, 2 of a world of 4 started as torchrun would start them; rank 3 never comes.
  const std::string env =
      "WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port());
  std::string script = "fails=0; ";
  for (int rank = 0; rank < 3; ++rank)
    script += "RANK=" + std::to_string(rank) + " LOCAL_RANK=" + std::to_string(rank) + " " + env + " " + kTrain +
              " --tensor-model-parallel-size 2 --distributed-timeout-seconds 5 --test-collectives & ";
  script += "for j in $(jobs -p); do wait $j || fails=$((fails+1)); done; echo failed workers: $fails";
  const JobRun r = run("/bin/bash -c '" + script + "'");
  EXPECT_NE(r.output.find("failed workers: 3"), std::string::npos) << r.output;
  EXPECT_EQ(count(r.output, "rank(s) 3 never arrived at the rendezvous of 4 ranks within 5 s"), 3u) << r.output;
  EXPECT_LT(r.seconds, 60) << r.output;
}

}  // namespace
