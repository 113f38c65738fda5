// A plain-text table with aligned columns, for the CLI's human-readable output. Cells hold names from files, so each
// is printed as printable_text: one line, no control characters.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "ckpt/printable_text.h"

namespace trestle::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> header) { add(std::move(header)); }
  void add(std::vector<std::string> row) {
    for (auto& cell : row) cell = printable_text(std::move(cell));
    rows_.push_back(std::move(row));
  }
  // Columns listed in right_aligned are numbers and line up on the right.
  void print(std::FILE* out, const std::vector<bool>& right_aligned = {}) const {
    std::vector<std::size_t> width;
    for (const auto& row : rows_)
      for (std::size_t i = 0; i < row.size(); ++i) {
        if (width.size() <= i) width.push_back(0);
        width[i] = std::max(width[i], row[i].size());
      }
    for (const auto& row : rows_) {
      std::string line;
      for (std::size_t i = 0; i < row.size(); ++i) {
        const bool right = i < right_aligned.size() && right_aligned[i];
        const std::string pad(width[i] - row[i].size(), ' ');
        line += (i ? "  " : "") + (right ? pad + row[i] : (i + 1 == row.size() ? row[i] : row[i] + pad));
      }
      std::fprintf(out, "%s\n", line.c_str());
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace trestle::cli
