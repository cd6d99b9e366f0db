// Comparisons shared by the tests that check the engine against reference outputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
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
// with logit < below and >= at_least, in id order, at which the running sum of exp(logit * inv_temperature -
// max_scaled) exceeds the weight; the last such id when none does; -1 when there is none.
inline int32_t draw_below_reference(const std::vector<float>& row, const BelowDraw& d) {
  double sum = 0.0;
  int32_t last = -1;
  for (int64_t i = 0; i < d.limit; ++i) {
    const float l = row[static_cast<size_t>(i)];
    if (!(l < d.below && l >= d.at_least)) continue;
    last = static_cast<int32_t>(i);
    sum += std::exp(static_cast<double>(l) * d.inv_temperature - d.max_scaled);
    if (d.weight < sum) return last;
  }
  return last;
}

// Ids 0 .. limit - 1 by logit, highest first, ties by id (the order every truncation ranks a row in).
inline std::vector<int32_t> ranked_by_logit(std::span<const float> row, int64_t limit) {
  std::vector<int32_t> ranked(static_cast<size_t>(limit));
  std::iota(ranked.begin(), ranked.end(), 0);
  std::sort(ranked.begin(), ranked.end(), [&](int32_t a, int32_t b) {
    const float la = row[static_cast<size_t>(a)], lb = row[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  });
  return ranked;
}

// Where top-p's prefix ends in a row, from its rule (ranked by logit, ties by id; an id is kept while the
// mass before it is < top_p of the total): the last kept logit, and the weights exp((logit - max) / T)
// of the ids < limit below `below` and above it, of those at it, their count, and the row's total.
struct TopPEnd {
  float boundary = 0.0f;
  double above = 0.0, at = 0.0, total = 0.0;
  int64_t count = 0;
};
inline TopPEnd top_p_end(std::span<const float> row, int64_t limit, double t, double top_p, float below) {
  const std::vector<int32_t> ranked = ranked_by_logit(row, limit);
  const double max_logit = row[static_cast<size_t>(ranked[0])];
  auto weight = [&](int32_t id) {
    return std::exp((static_cast<double>(row[static_cast<size_t>(id)]) - max_logit) / t);
  };
  TopPEnd end;
  for (int32_t id : ranked) end.total += weight(id);
  double before = 0.0;
  for (size_t i = 0; i < ranked.size() && before < top_p * end.total; ++i)
    end.boundary = row[static_cast<size_t>(ranked[i])], before += weight(ranked[i]);
  for (int32_t i = 0; i < limit; ++i) {
    const float l = row[static_cast<size_t>(i)];
    if (l < below && l > end.boundary) end.above += weight(i);
    if (l == end.boundary) end.at += weight(i), ++end.count;
  }
  return end;
}

}  // namespace mtpx::testing_util
