#include "train/loop/profile_rows.h"

#include <algorithm>
#include <map>
#include <utility>

namespace trestle::train {

std::vector<ProfileRow> rank_by_total(const std::vector<ProfileRow>& rows, std::size_t top) {
  std::map<std::string, ProfileRow> by_name;
  for (const ProfileRow& r : rows) {
    ProfileRow& into = by_name[r.name];
    into.name = r.name;
    into.calls += r.calls;
    into.total_ms += r.total_ms;
  }
  std::vector<ProfileRow> out;
  for (auto& [name, row] : by_name) out.push_back(std::move(row));
  std::sort(out.begin(), out.end(), [](const ProfileRow& a, const ProfileRow& b) {
    return a.total_ms != b.total_ms ? a.total_ms > b.total_ms : a.name < b.name;
  });
  if (out.size() > top) out.resize(top);
  return out;
}

}  // namespace trestle::train
