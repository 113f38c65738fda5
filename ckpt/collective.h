// The few collectives a distributed save needs, over whatever connects the ranks: parallel/ implements it with c10d
// process groups (Gloo, NCCL); ThreadCollective connects threads of one process (tests, single-process tools).
// Every rank calls each operation in the same order.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckpt/status.h"

namespace trestle {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank contributes bytes and receives all contributions, indexed by rank.
  virtual Result<std::vector<std::string>> all_gather(const std::string& bytes) = 0;
};

// One rank alone.
class SoloCollective final : public Collective {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Result<std::vector<std::string>> all_gather(const std::string& bytes) override {
    return std::vector<std::string>{bytes};
  }
};

// `size` threads of one process, each holding the Collective made by ThreadGroup::member(rank).
class ThreadGroup {
 public:
  explicit ThreadGroup(int size);
  std::unique_ptr<Collective> member(int rank);

 private:
  friend class ThreadMember;
  Result<std::vector<std::string>> all_gather(int rank, const std::string& bytes);
  int size_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> slots_;
  int arrived_ = 0;
  int departed_ = 0;
  std::uint64_t generation_ = 0;
};

}  // namespace trestle
