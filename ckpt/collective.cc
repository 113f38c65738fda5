#include "ckpt/collective.h"

namespace trestle {

class ThreadMember final : public Collective {
 public:
  ThreadMember(ThreadGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size_; }
  Result<std::vector<std::string>> all_gather(const std::string& bytes) override {
    return group_->all_gather(rank_, bytes);
  }

 private:
  ThreadGroup* group_;
  int rank_;
};

ThreadGroup::ThreadGroup(int size) : size_(size), slots_(static_cast<std::size_t>(size)) {}

std::unique_ptr<Collective> ThreadGroup::member(int rank) { return std::make_unique<ThreadMember>(this, rank); }

Result<std::vector<std::string>> ThreadGroup::all_gather(int rank, const std::string& bytes) {
  std::unique_lock lock(mutex_);
  // Wait until the previous round has been read by everyone before reusing the slots.
  changed_.wait(lock, [&] { return departed_ == 0; });
  const auto generation = generation_;
  slots_[static_cast<std::size_t>(rank)] = bytes;
  if (++arrived_ == size_) {
    ++generation_;
    changed_.notify_all();
  } else {
    changed_.wait(lock, [&] { return generation_ != generation; });
  }
  std::vector<std::string> out = slots_;
  if (++departed_ == size_) {
    arrived_ = 0;
    departed_ = 0;
    changed_.notify_all();
  }
  return out;
}

}  // namespace trestle
