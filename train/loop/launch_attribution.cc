#include "train/loop/launch_attribution.h"

#include <algorithm>
#include <unordered_map>

namespace trestle::train {
namespace {

// One thread's operators as a forest: operators recorded on one thread nest (each is a scope), so the one open
// before another starts and still open when it ends is its parent.
class OperatorForest {
 public:
  void add(const TimedEvent* op) { ops_.push_back({op, -1}); }

  void build() {
    std::sort(ops_.begin(), ops_.end(), [](const Node& a, const Node& b) {
      return a.op->start_ns != b.op->start_ns ? a.op->start_ns < b.op->start_ns : a.op->end_ns > b.op->end_ns;
    });
    std::vector<int> open;
    for (int i = 0; i < static_cast<int>(ops_.size()); ++i) {
      while (!open.empty() && ops_[static_cast<std::size_t>(open.back())].op->end_ns < ops_[i].op->end_ns)
        open.pop_back();
      ops_[static_cast<std::size_t>(i)].parent = open.empty() ? -1 : open.back();
      open.push_back(i);
    }
  }

  // The outermost and innermost operators open at `t` (both null when none is).
  std::pair<const TimedEvent*, const TimedEvent*> around(std::uint64_t t) const {
    auto after = std::upper_bound(ops_.begin(), ops_.end(), t,
                                  [](std::uint64_t v, const Node& n) { return v < n.op->start_ns; });
    int i = static_cast<int>(after - ops_.begin()) - 1;
    while (i >= 0 && ops_[static_cast<std::size_t>(i)].op->end_ns < t) i = ops_[static_cast<std::size_t>(i)].parent;
    if (i < 0) return {nullptr, nullptr};
    const TimedEvent* inner = ops_[static_cast<std::size_t>(i)].op;
    while (ops_[static_cast<std::size_t>(i)].parent >= 0) i = ops_[static_cast<std::size_t>(i)].parent;
    return {ops_[static_cast<std::size_t>(i)].op, inner};
  }

 private:
  struct Node {
    const TimedEvent* op;
    int parent;
  };
  std::vector<Node> ops_;
};

}  // namespace

std::vector<ProfileRow> device_time_by_launcher(const std::vector<TimedEvent>& events) {
  std::unordered_map<std::uint64_t, OperatorForest> threads;
  std::unordered_map<std::uint64_t, const TimedEvent*> launches;
  for (const TimedEvent& e : events) {
    if (e.kind == TimedEvent::Kind::kOperator) threads[e.thread].add(&e);
    if (e.kind == TimedEvent::Kind::kLaunch) launches.emplace(e.correlation, &e);
  }
  for (auto& [thread, forest] : threads) forest.build();
  std::vector<ProfileRow> out;
  for (const TimedEvent& e : events) {
    if (e.kind != TimedEvent::Kind::kDevice) continue;
    std::string launcher = "(launch not recorded)";
    if (const auto launch = launches.find(e.correlation); launch != launches.end()) {
      const auto forest = threads.find(launch->second->thread);
      const auto [outer, inner] = forest == threads.end()
                                      ? std::pair<const TimedEvent*, const TimedEvent*>{nullptr, nullptr}
                                      : forest->second.around(launch->second->start_ns);
      launcher = !outer           ? "(no operator)"
                 : outer == inner ? outer->name + outer->inputs
                                  : outer->name + " > " + inner->name + inner->inputs;
    }
    out.push_back({std::move(launcher), 1, static_cast<double>(e.end_ns - e.start_ns) / 1e6});
  }
  return out;
}

}  // namespace trestle::train
