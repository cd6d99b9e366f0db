// Comparisons shared by the tests that check the engine against reference outputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "model/device.h"

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

// A draw below a row's top ids (BelowDraw) on the host, written from its definition: the first id < limit
// with logit < below, in id order, at which the running sum of exp(logit * inv_temperature - max_scaled)
// exceeds the weight; the last such id when none does; -1 when there is none.
inline int32_t draw_below_reference(const std::vector<float>& row, const BelowDraw& d) {
  double sum = 0.0;
  int32_t last = -1;
  for (int64_t i = 0; i < d.limit; ++i) {
    const float l = row[static_cast<size_t>(i)];
    if (!(l < d.below)) continue;
    last = static_cast<int32_t>(i);
    sum += std::exp(static_cast<double>(l) * d.inv_temperature - d.max_scaled);
    if (d.weight < sum) return last;
  }
  return last;
}

}  // namespace mtpx::testing_util
