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

namespace {

// The profiler's dtype names are C++ type names ("float", "long int", "c10::BFloat16"); a row says ATen's ("Float").
std::string dtype_name(const std::string& recorded) {
  static const std::map<std::string, std::string> kCppNames = {
      {"float", "Float"}, {"double", "Double"},   {"long int", "Long"},    {"int", "Int"},
      {"bool", "Bool"},   {"short int", "Short"}, {"signed char", "Char"}, {"unsigned char", "Byte"}};
  if (const auto it = kCppNames.find(recorded); it != kCppNames.end()) return it->second;
  return recorded.rfind("c10::", 0) == 0 ? recorded.substr(5) : recorded;
}

}  // namespace

std::string describe_inputs(const std::vector<std::vector<std::int64_t>>& shapes,
                            const std::vector<std::string>& dtypes) {
  std::string out;
  for (std::size_t i = 0; i < shapes.size() && i < dtypes.size(); ++i) {
    const std::string& dtype = dtypes[i];
    if (dtype.empty() || dtype == "Scalar" || dtype.find("List") != std::string::npos) continue;
    std::string shape;
    for (std::int64_t d : shapes[i]) shape += (shape.empty() ? "" : "x") + std::to_string(d);
    out += (out.empty() ? " (" : ", ") + (shape.empty() ? "()" : shape) + " " + dtype_name(dtype);
  }
  return out.empty() ? out : out + ")";
}

}  // namespace trestle::train
