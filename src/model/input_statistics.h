// What quantization calibrates with (an "importance matrix", as llama.cpp's imatrix): for each weight
// matrix, the mean square of each input column over the rows a model ran on. For y = W x the expected
// squared error of an output from an error e in row w of W is sum_k E[x_k^2] e_k^2 when the inputs are
// uncorrelated, so these means weigh each column's quantization error.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "backend/cpu/matmul.h"

namespace mtpx {

class InputStatistics {
 public:
  // Adds `rows` input rows x [rows, w.cols] of a product with w.
  void add(const cpu::WeightMatrix& w, const float* x, int64_t rows) {
    Entry& e = entries_[w.data];
    if (e.sum_squares.empty()) e.sum_squares.assign(static_cast<size_t>(w.cols), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < w.cols; ++k) {
        const double v = x[r * w.cols + k];
        e.sum_squares[static_cast<size_t>(k)] += v * v;
      }
    e.rows += rows;
  }
  // E[x_k^2] per input column of w (empty when w was never multiplied).
  std::vector<float> mean_squares(const cpu::WeightMatrix& w) const {
    const auto it = entries_.find(w.data);
    if (it == entries_.end() || it->second.rows == 0) return {};
    std::vector<float> out(it->second.sum_squares.size());
    for (size_t k = 0; k < out.size(); ++k)
      out[k] = static_cast<float>(it->second.sum_squares[k] / static_cast<double>(it->second.rows));
    return out;
  }
  size_t matrices() const { return entries_.size(); }

 private:
  struct Entry {
    std::vector<double> sum_squares;
    int64_t rows = 0;
  };
  std::unordered_map<const void*, Entry> entries_;  // by the matrix's weights (one matrix, one buffer)
};

}  // namespace mtpx
