#include "train/data/split.h"

#include <cmath>
#include <regex>
#include <vector>

#include "train/data/python_float.h"

namespace trestle::data {

const char* split_name(Split split) {
  switch (split) {
    case Split::kTrain:
      return "train";
    case Split::kValid:
      return "valid";
    case Split::kTest:
      return "test";
  }
  return "?";
}

Result<SplitMatrix> parse_split(const std::string& split) {
  std::vector<double> parts;
  static const std::regex kNumber(R"([.0-9]+)");
  for (auto it = std::sregex_iterator(split.begin(), split.end(), kNumber); it != std::sregex_iterator(); ++it) {
    // Megatron: float() of each run of digits and dots, so "1.2.3" is an error, not 1.2.
    const auto part = python_float(it->str());
    if (!part) return Status::Error("--split '" + split + "': '" + it->str() + "' is not a number");
    parts.push_back(*part);
  }
  if (parts.empty() || parts.size() > 3)
    return Status::Error("--split '" + split + "': expected one to three weights such as 969,30,1");
  parts.resize(3, 0.0);
  double sum = 0;
  for (const double p : parts) sum += p;
  if (sum <= 0) return Status::Error("--split '" + split + "': the weights sum to 0");
  SplitMatrix matrix;
  double begin = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    const double end = begin + parts[i] / sum;
    if (end > begin) matrix[i] = std::make_pair(begin, end);
    begin = end;
  }
  return matrix;
}

std::pair<std::size_t, std::size_t> split_range(const std::pair<double, double>& bookends, std::size_t num_documents) {
  // std::nearbyint rounds half to even under the default rounding mode, as Python's round() does.
  const auto n = static_cast<double>(num_documents);
  return {static_cast<std::size_t>(std::nearbyint(bookends.first * n)),
          static_cast<std::size_t>(std::nearbyint(bookends.second * n))};
}

}  // namespace trestle::data
