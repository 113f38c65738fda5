#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace trestle::parallel {
namespace {

int group_size(const PipelineScheduleConfig& c) { return c.microbatch_group > 0 ? c.microbatch_group : c.pp; }

}  // namespace

Status check_pipeline_schedule_config(const PipelineScheduleConfig& c) {
  if (c.pp < 1 || c.chunks < 1 || c.microbatches < 1)
    return Status::Error("pipeline schedule: pp, chunks and microbatches must be at least 1 (pp " +
                         std::to_string(c.pp) + ", chunks " + std::to_string(c.chunks) + ", microbatches " +
                         std::to_string(c.microbatches) + ")");
  if (c.chunks > 1) {
    if (c.pp == 1) return Status::Error("pipeline schedule: virtual pipeline chunks need pp > 1");
    const int g = group_size(c);
    if (g < c.pp || g > c.microbatches)
      return Status::Error("pipeline schedule: the microbatch group per virtual stage (" + std::to_string(g) +
                           ") must be between pp (" + std::to_string(c.pp) + ") and the microbatches (" +
                           std::to_string(c.microbatches) + ")");
    // A last group smaller than pp would leave stages waiting inside the step (Megatron refuses it too).
    const int last_group = c.microbatches % g;
    if (last_group > 0 && last_group < c.pp)
      return Status::Error("pipeline schedule: " + std::to_string(c.microbatches) + " microbatches in groups of " +
                           std::to_string(g) + " leave a last group of " + std::to_string(last_group) +
                           ", fewer than pp (" + std::to_string(c.pp) + ")");
  }
  return OkStatus();
}

PipelineCounts pipeline_counts(const PipelineScheduleConfig& c, int rank) {
  PipelineCounts n;
  n.total = c.microbatches * c.chunks;
  if (c.forward_only) n.warmup = n.total;
  else if (c.pp > 1 && c.chunks == 1) n.warmup = c.pp - rank - 1;
  else if (c.pp > 1) n.warmup = (c.pp - rank - 1) * 2 + (c.chunks - 1) * group_size(c);
  if (n.warmup >= n.total) {
    n.warmup = n.total;
    n.all_in_warmup = true;
  }
  n.remaining = n.total - n.warmup;
  return n;
}

std::vector<std::pair<int, int>> pipeline_schedule_table(const PipelineScheduleConfig& c) {
  std::vector<std::pair<int, int>> table;
  const int g = group_size(c);
  for (int first = 0; first < c.microbatches; first += g) {
    const int last = first + g >= c.microbatches ? c.microbatches : first + g;  // the last group takes the rest
    for (int chunk = 0; chunk < c.chunks; ++chunk)
      for (int mb = first; mb < last; ++mb) table.emplace_back(mb, chunk);
    if (last == c.microbatches) break;
  }
  return table;
}

std::vector<PipelineStep> pipeline_schedule(const PipelineScheduleConfig& c, int rank) {
  const PipelineCounts n = pipeline_counts(c, rank);
  const auto table = pipeline_schedule_table(c);
  auto forward = [&](int k) { return PipelineStep{true, table[k].first, table[k].second}; };
  // The k-th backward runs the k-th virtual micro-batch's micro-batch through the chunks in reverse order.
  auto backward = [&](int k) { return PipelineStep{false, table[k].first, c.chunks - table[k].second - 1}; };
  std::vector<PipelineStep> steps;
  for (int k = 0; k < n.warmup; ++k) steps.push_back(forward(k));
  if (c.forward_only) return steps;
  for (int k = 0; k < n.remaining; ++k) {
    steps.push_back(forward(n.warmup + k));
    steps.push_back(backward(k));
  }
  for (int k = n.remaining; k < n.total; ++k) steps.push_back(backward(k));
  return steps;
}

std::string to_string(const PipelineStep& s) {
  return std::string(s.forward ? "F" : "B") + std::to_string(s.microbatch) + "c" + std::to_string(s.chunk);
}

Status check_pipeline_schedules(const PipelineScheduleConfig& c) {
  TRESTLE_RETURN_IF_ERROR(check_pipeline_schedule_config(c));
  std::vector<std::vector<PipelineStep>> orders;
  for (int r = 0; r < c.pp; ++r) orders.push_back(pipeline_schedule(c, r));
  return check_pipeline_orders(c, orders);
}

Status check_pipeline_orders(const PipelineScheduleConfig& c, const std::vector<std::vector<PipelineStep>>& orders) {
  const int stages = c.pp * c.chunks;  // virtual stages
  if (orders.size() != static_cast<std::size_t>(c.pp))
    return Status::Error("pipeline schedule: " + std::to_string(orders.size()) + " orders for " +
                         std::to_string(c.pp) + " stages");
  for (int r = 0; r < c.pp; ++r) {
    // every (direction, micro-batch, chunk) exactly once
    std::set<std::tuple<bool, int, int>> seen;
    for (const auto& s : orders[r])
      if (!seen.insert({s.forward, s.microbatch, s.chunk}).second)
        return Status::Error("pipeline schedule: stage " + std::to_string(r) + " runs " + to_string(s) + " twice");
    const std::size_t expected = static_cast<std::size_t>(c.microbatches) * c.chunks * (c.forward_only ? 1 : 2);
    if (seen.size() != expected)
      return Status::Error("pipeline schedule: stage " + std::to_string(r) + " runs " + std::to_string(seen.size()) +
                           " steps, expected " + std::to_string(expected));
  }
  // done[{forward, microbatch, virtual stage}]
  std::set<std::tuple<bool, int, int>> done;
  std::vector<std::size_t> next(c.pp, 0);
  auto ready = [&](int rank, const PipelineStep& s) {
    const int v = s.chunk * c.pp + rank;
    if (s.forward) return v == 0 || done.count({true, s.microbatch, v - 1}) > 0;
    if (!done.count({true, s.microbatch, v})) return false;
    return v == stages - 1 || done.count({false, s.microbatch, v + 1}) > 0;
  };
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < c.pp; ++r)
      while (next[r] < orders[r].size() && ready(r, orders[r][next[r]])) {
        const auto& s = orders[r][next[r]++];
        done.insert({s.forward, s.microbatch, s.chunk * c.pp + r});
        progressed = true;
      }
  }
  std::string stuck;
  for (int r = 0; r < c.pp; ++r)
    if (next[r] < orders[r].size())
      stuck += (stuck.empty() ? "" : ", ") + std::string("stage ") + std::to_string(r) + " at " +
               to_string(orders[r][next[r]]);
  if (!stuck.empty())
    return Status::Error("pipeline schedule (pp " + std::to_string(c.pp) + ", chunks " + std::to_string(c.chunks) +
                         ", microbatches " + std::to_string(c.microbatches) + ") deadlocks: " + stuck);
  return OkStatus();
}

}  // namespace trestle::parallel
