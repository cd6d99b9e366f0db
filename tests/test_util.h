// Comparisons shared by the tests that check the engine against reference outputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mtpx::testing_util {

// max |a - b| / max |b| over n values (the tolerance measure of the reference tests).
inline double relative_error(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

// The largest relative_error over the rows of [rows, width] matrices.
inline double worst_row_relative_error(const std::vector<float>& got, const std::vector<float>& want,
                                       int64_t width) {
  double worst = 0;
  for (size_t r = 0; r < want.size() / static_cast<size_t>(width); ++r)
    worst = std::max(worst, relative_error(&got[r * static_cast<size_t>(width)],
                                           &want[r * static_cast<size_t>(width)], width));
  return worst;
}

}  // namespace mtpx::testing_util
