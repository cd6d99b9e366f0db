#include "decode/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>

#include "backend/cpu/ops.h"
#include "util/error.h"

namespace mtpx {

void validate(const SamplerParams& p) {
  if (!(p.temperature >= 0.0 && p.temperature <= 100.0))
    invalid_input("temperature must be in [0, 100], got {}", p.temperature);
  if (p.top_k < 0) invalid_input("top-k must be >= 0, got {}", p.top_k);
  if (!(p.top_p > 0.0 && p.top_p <= 1.0)) invalid_input("top-p must be in (0, 1], got {}", p.top_p);
  if (!(p.min_p >= 0.0 && p.min_p <= 1.0)) invalid_input("min-p must be in [0, 1], got {}", p.min_p);
}

float TokenDistribution::prob(int32_t id) const {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] == id) return probs[i];
  return 0.0f;
}

float TokenDistribution::prob_of_logit(float logit) const {
  if (unlisted <= 0.0) fail(ErrorKind::kInternal, "prob_of_logit: a distribution listed whole");
  if (!(logit >= scale.at_least)) return 0.0f;  // below what top-p keeps
  return static_cast<float>(std::exp(static_cast<double>(logit) * scale.inv_temperature - scale.max_scaled) /
                            scale.total);
}

int32_t argmax(std::span<const float> logits, int64_t vocab_limit) {
  const int64_t n = std::min<int64_t>(vocab_limit, static_cast<int64_t>(logits.size()));
  return n > 0 ? cpu::argmax(logits.data(), n) : 0;
}

TokenDistribution one_hot(int32_t id) { return TokenDistribution{{id}, {1.0f}}; }

namespace {

// Whether any of kBlock logits passes `passes(logit, threshold)` (> or >=; NaN passes neither). A count
// without branches, so that the compiler tests the block in vector registers.
constexpr int64_t kBlock = 32;
template <class Compare>
bool any_passes(const float* x, float threshold, Compare passes) {
  int count = 0;
  for (int64_t j = 0; j < kBlock; ++j) count += passes(x[j], threshold) ? 1 : 0;
  return count > 0;
}

}  // namespace

namespace {

using WeightedIds = std::vector<std::pair<int32_t, double>>;
using IdLogits = std::vector<std::pair<int32_t, float>>;

// Highest logit first, ties by lower id: the order top-p walks. The pairs themselves, not ids with a
// lookup: 768 device candidates sorted through a binary search of their logits per comparison took
// 0.8 ms, most of a 0.8B GPU decode step.
void sort_by_rank(IdLogits& pairs) {
  std::sort(pairs.begin(), pairs.end(), [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  });
}

// Ids in rank order with their weights exp(logit / T - max / T) (max: the first's), in double for a stable
// sum.
struct RankedIds {
  IdLogits pairs;
  std::vector<double> weight;
  double max_scaled = 0.0;  // the first logit / T
  double mass = 0.0;        // the weights' sum, in rank order
};
RankedIds rank(IdLogits ids, double temperature) {
  RankedIds r{std::move(ids), {}, 0.0, 0.0};
  sort_by_rank(r.pairs);
  const double inv_t = 1.0 / temperature;
  r.max_scaled = r.pairs[0].second * inv_t;
  r.weight.resize(r.pairs.size());
  for (size_t i = 0; i < r.pairs.size(); ++i)
    r.mass += r.weight[i] = std::exp(static_cast<double>(r.pairs[i].second) * inv_t - r.max_scaled);
  return r;
}

// What truncate() does once top-k has chosen the survivors, ranked (rank(): highest logit first, ties: lower
// id first, with their weights): softmax(logit / T), top-p, min-p, renormalized.
// rest_mass > 0: the ids are the top of a row whose other ids weigh rest_mass in all (each
// exp(logit / T - max / T)); it counts in top-p's total. The result must not reach below the ids: when
// top-p or min-p cut inside them, it is the row's; when nothing cuts, a row sampled whole (temperature
// alone) gets the ids with their share of the row's mass, then `rest` (the ids below with their weights)
// when given, else `unlisted` = the rest's share. Any other is undecided (nullopt: the ids below are
// needed).
std::optional<TokenDistribution> truncate_ranked(const RankedIds& survivors, const SamplerParams& p,
                                                 double rest_mass = 0.0, const WeightedIds* rest = nullptr) {
  TokenDistribution d;
  const IdLogits& pairs = survivors.pairs;
  const std::vector<double>& w = survivors.weight;
  const size_t count = pairs.size();
  const double inv_t = 1.0 / p.temperature;
  const double max_logit = survivors.max_scaled;
  const double total = survivors.mass + rest_mass;
  bool cut = false;  // whether top-p or min-p dropped ids here (then they drop every id below too)
  size_t keep = count;
  if (p.top_p < 1.0) {
    // Keep token i while the mass strictly before it is < p (HF removes tokens whose ascending cumsum <=
    // 1-p). i == size: the first id past these (nothing, or the rest's first).
    double before = 0.0;
    for (size_t i = 0; i <= count; ++i) {
      if (before / total >= p.top_p && i > 0) {
        keep = i;
        cut = true;
        break;
      }
      if (i < count) before += w[i];
    }
  }
  if (p.min_p > 0.0) {
    const double floor = p.min_p * w[0];
    size_t i = 1;
    while (i < keep && w[i] >= floor) ++i;
    cut |= i < count;
    keep = i;
  }
  const bool whole_row = p.top_p >= 1.0 && p.min_p <= 0.0;
  if (rest_mass > 0.0 && !cut && !whole_row) return std::nullopt;
  // Nothing cut below the ids: every id of the row stays, so the shares are of the row's total.
  const bool unlisted = rest_mass > 0.0 && !cut;
  double kept_total = unlisted ? total : 0.0;
  if (!unlisted)
    for (size_t i = 0; i < keep; ++i) kept_total += w[i];
  d.ids.resize(keep);
  for (size_t i = 0; i < keep; ++i) d.ids[i] = pairs[i].first;
  d.probs.resize(keep);
  for (size_t i = 0; i < keep; ++i) d.probs[i] = static_cast<float>(w[i] / kept_total);
  if (unlisted && rest != nullptr) {
    d.ids.reserve(keep + rest->size());
    d.probs.reserve(keep + rest->size());
    for (const auto& [id, weight] : *rest) {
      d.ids.push_back(id);
      d.probs.push_back(static_cast<float>(weight / total));
    }
  } else if (unlisted) {
    d.unlisted = rest_mass / total;
    d.scale = {
        .inv_temperature = inv_t, .max_scaled = max_logit, .total = total, .below = pairs.back().second};
  }
  return d;
}
// The same from survivors in any order, with nothing below them.
TokenDistribution truncate_survivors(IdLogits survivors, const SamplerParams& p) {
  return *truncate_ranked(rank(std::move(survivors), p.temperature), p);
}

// The k-th largest of logits[0, n) (counting repeats; 0 < k <= n) from one pass that keeps the k largest in
// a min-heap: most logits lose one comparison with the heap's top. (An nth_element over all n ids took
// 15 us for the shipped model's 8192, and speculative decoding truncates 2K + 1 rows per step.) Blocks
// whose logits all lose to the heap's top are skipped after one (vectorized) test: the top only grows, so
// a logit that loses to it at the block's start loses to it at its turn too, and the others are offered in
// order, so the heap ends as the plain scan leaves it. (8192 ids: 7.3 -> 1.9 us.)
float kth_largest(std::span<const float> logits, int64_t n, int64_t k) {
  std::vector<float> heap(logits.begin(), logits.begin() + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<>());
  auto offer = [&](int64_t i) {
    const float l = logits[static_cast<size_t>(i)];
    if (l > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      heap.back() = l;
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  int64_t i = k;
  for (; i + kBlock <= n; i += kBlock)
    if (any_passes(&logits[static_cast<size_t>(i)], heap.front(), std::greater<>()))
      for (int64_t j = i; j < i + kBlock; ++j) offer(j);
  for (; i < n; ++i) offer(i);
  return heap.front();
}

// Every id < n whose logit is >= threshold with its logit, in id order.
IdLogits ids_at_or_above(std::span<const float> logits, int64_t n, float threshold) {
  IdLogits ids;
  auto offer = [&](int64_t j) {
    const float l = logits[static_cast<size_t>(j)];
    if (l >= threshold) ids.emplace_back(static_cast<int32_t>(j), l);
  };
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    if (any_passes(&logits[static_cast<size_t>(i)], threshold, std::greater_equal<>()))
      for (int64_t j = i; j < i + kBlock; ++j) offer(j);
  for (; i < n; ++i) offer(i);
  return ids;
}

// Rows without top-k longer than this are truncated from their top kTopIds ids and the rest's mass
// instead of a sort of the whole row: at Qwen's 248,320 ids that sort took 30 ms per row, several decode
// steps of a GPU.
constexpr int64_t kTopIds = 1024;
constexpr int64_t kSortWholeRowsUpTo = 4 * kTopIds;

// truncate() of a long row whose top-p prefix reaches below its top ids (min-p cutting none of them): a
// flat row, where the prefix can hold most of the vocabulary. Sorting the row to find where the prefix
// ends took 30 ms at 248,320 ids; instead the ids below the top are binned by (max - logit) / T, a
// monotone function of the logit (ties share a bin), the bins spread over the row's range of it (to 48:
// weights below e^-48 share the last bin): the bins' masses place the end of the prefix in one bin, and
// only that bin is sorted. The prefix is the brute force's (ranked by logit, ties by id; kept while the
// mass before an id is < top_p of the row's), up to the order of the sums; min-p then drops the ids
// weighing < min_p of the top one (monotone too: a prefix of the prefix). Listed: the top ids in rank
// order, then the kept ids below them in id order (draw() walks the list, so any order is as exact).
constexpr int kBins = 4096;
constexpr double kBinnedRange = 48.0;

// `top`: the top ids, ranked. `weight`: each id's weight exp(logit / T - max / T) where its logit is below
// `threshold` (the top ids' and NaN's entries unused), `rest_mass` their sum in id order, as truncate()
// weighed them, and `lowest` the lowest finite logit among them (threshold when none).
TokenDistribution truncate_wide(std::span<const float> logits, int64_t n, const RankedIds& top,
                                float threshold, const std::vector<double>& weight, double rest_mass,
                                float lowest, const SamplerParams& p) {
  const double inv_t = 1.0 / p.temperature;
  const float highest = top.pairs[0].second;
  const double top_mass = top.mass;
  // The bins' width: the row's range of (max - logit) / T over kBins - 1 bins (-infinity goes in the last).
  const double range = std::min(kBinnedRange, (static_cast<double>(highest) - lowest) * inv_t);
  const double bins_per_unit = range > 0.0 ? (kBins - 1) / range : 1.0;
  // Each id's bin (kBins: a top id or NaN, not binned) and the bins' masses.
  std::vector<uint16_t> bin(static_cast<size_t>(n), kBins);
  std::vector<double> bin_mass(kBins, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const float l = logits[static_cast<size_t>(i)];
    if (!(l < threshold)) continue;
    const double position = (static_cast<double>(highest) - l) * inv_t * bins_per_unit;
    const int b = position < kBins - 1 ? static_cast<int>(position) : kBins - 1;
    bin[static_cast<size_t>(i)] = static_cast<uint16_t>(b);
    bin_mass[static_cast<size_t>(b)] += weight[static_cast<size_t>(i)];
  }
  const double total = top_mass + rest_mass;
  // Bins before `end_bin` are kept whole, bin end_bin up to its id `last_kept` (rank order), none after.
  int end_bin = kBins;
  std::optional<std::pair<int32_t, float>> last_kept;  // (id, logit); nullopt: none of end_bin
  if (p.top_p < 1.0) {
    double before = top_mass;
    for (int b = 0; b < kBins; ++b) {
      if ((before + bin_mass[static_cast<size_t>(b)]) / total < p.top_p) {
        before += bin_mass[static_cast<size_t>(b)];
        continue;
      }
      end_bin = b;
      if (before / total >= p.top_p) break;  // the prefix ended with the bin before
      IdLogits members;
      for (int64_t i = 0; i < n; ++i)
        if (bin[static_cast<size_t>(i)] == b)
          members.emplace_back(static_cast<int32_t>(i), logits[static_cast<size_t>(i)]);
      sort_by_rank(members);
      for (const auto& member : members) {
        if (before / total >= p.top_p) break;
        last_kept = member;
        before += weight[static_cast<size_t>(member.first)];
      }
      break;
    }
  }
  // The top ids (all kept: neither top-p nor min-p cut inside them), then the kept ids below in id order.
  TokenDistribution d;
  d.ids.reserve(static_cast<size_t>(n));
  double kept_total = top_mass;
  for (const auto& [id, l] : top.pairs) d.ids.push_back(id);
  const double floor = p.min_p;  // min-p's share of the top id's weight, exp(0) = 1
  for (int64_t i = 0; i < n; ++i) {
    const int b = bin[static_cast<size_t>(i)];
    if (b > end_bin || b == kBins) continue;
    if (b == end_bin) {
      const float l = logits[static_cast<size_t>(i)];
      if (!last_kept || l < last_kept->second || (l == last_kept->second && i > last_kept->first)) continue;
    }
    const double w = weight[static_cast<size_t>(i)];
    if (w < floor) continue;
    d.ids.push_back(static_cast<int32_t>(i));
    kept_total += w;
  }
  d.probs.resize(d.ids.size());
  for (size_t i = 0; i < d.ids.size(); ++i)
    d.probs[i] = static_cast<float>(
        (i < top.pairs.size() ? top.weight[i] : weight[static_cast<size_t>(d.ids[i])]) / kept_total);
  return d;
}

}  // namespace

TokenDistribution truncate(std::span<const float> logits, const SamplerParams& p, int64_t vocab_limit) {
  const int64_t n = std::min<int64_t>(vocab_limit, static_cast<int64_t>(logits.size()));
  if (n <= 0) invalid_input("no tokens to sample from");
  if (p.greedy()) return one_hot(argmax(logits, n));
  if (p.top_k > 0 && p.top_k < n) {
    // Keep every token whose logit is >= the k-th largest (ties at the boundary survive, as in HF).
    return truncate_survivors(ids_at_or_above(logits, n, kth_largest(logits, n, p.top_k)), p);
  }
  // Without top-k: the ids at or above the kTopIds-th largest and the mass of those below (in id order,
  // each weighed as rank() weighs the ids); truncate_wide where top-p's prefix reaches below.
  if (n > kSortWholeRowsUpTo) {
    const float threshold = kth_largest(logits, n, kTopIds);
    // Ranked once: the truncations below all start from the top ids in rank order with their weights.
    const RankedIds top = rank(ids_at_or_above(logits, n, threshold), p.temperature);
    const double inv_t = 1.0 / p.temperature;
    const double max_logit = top.max_scaled;
    // Temperature alone samples the whole row: the ids below follow the top ones in id order.
    const bool whole_row = p.top_p >= 1.0 && p.min_p <= 0.0;
    if (!whole_row) {
      // The ids below weigh between 0 and their count x the threshold's weight (1e-9 over: the sum's
      // rounding). Top-p's prefix only ends later as the total grows, and the kept ids' probabilities do
      // not depend on the total: where top-p or min-p cut inside the top ids at both ends, the result is
      // the one for the exact rest mass, without the exps of the ids below (3-5 ms a row at 248,320 ids).
      const double most = static_cast<double>(n - static_cast<int64_t>(top.pairs.size())) *
                          std::exp(static_cast<double>(threshold) * inv_t - max_logit) * (1.0 + 1e-9);
      std::optional<TokenDistribution> least_rest =
          truncate_ranked(top, p, std::numeric_limits<double>::min());
      std::optional<TokenDistribution> most_rest = truncate_ranked(top, p, most);
      if (least_rest && most_rest && least_rest->ids.size() == most_rest->ids.size())
        return *std::move(most_rest);
    }
    WeightedIds rest;            // whole_row: the ids below, in id order, with their weights
    std::vector<double> weight;  // otherwise each id's weight, for truncate_wide
    if (whole_row)
      rest.reserve(static_cast<size_t>(n));
    else
      weight.resize(static_cast<size_t>(n));
    double rest_mass = 0.0;
    float lowest = threshold;  // the lowest finite logit below the top ids: the range truncate_wide bins
    for (int64_t i = 0; i < n; ++i) {
      const float l = logits[static_cast<size_t>(i)];
      if (!(l < threshold)) continue;  // a top id (or NaN)
      const double w = std::exp(static_cast<double>(l) * inv_t - max_logit);
      rest_mass += w;
      if (whole_row) {
        rest.emplace_back(static_cast<int32_t>(i), w);
      } else {
        weight[static_cast<size_t>(i)] = w;
        if (l < lowest && std::isfinite(l)) lowest = l;
      }
    }
    if (std::optional<TokenDistribution> d = truncate_ranked(top, p, rest_mass, &rest)) return *std::move(d);
    return truncate_wide(logits, n, top, threshold, weight, rest_mass, lowest, p);
  }
  IdLogits ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[static_cast<size_t>(i)] = {static_cast<int32_t>(i), logits[static_cast<size_t>(i)]};
  return truncate_survivors(std::move(ids), p);
}

TokenDistribution truncate_candidates(std::span<const int32_t> ids, std::span<const float> logits,
                                      const SamplerParams& p, double rest_mass, KeptBelow kept_below) {
  if (ids.empty() || ids.size() != logits.size())
    invalid_input("truncate_candidates: {} ids with {} logits", ids.size(), logits.size());
  if (!(rest_mass >= 0.0)) invalid_input("truncate_candidates: a rest mass of {}", rest_mass);
  if (p.greedy()) {
    size_t best = 0;
    for (size_t i = 1; i < ids.size(); ++i)
      if (logits[i] > logits[best] || (logits[i] == logits[best] && ids[i] < ids[best])) best = i;
    return one_hot(ids[best]);
  }
  IdLogits survivors(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) survivors[i] = {ids[i], logits[i]};
  RankedIds ranked = rank(std::move(survivors), p.temperature);
  if (kept_below.mass > 0.0) {
    // Top-p's prefix holds every id here and those below down to kept_below.at_least (the device checked
    // that against the row's total, CandidateRequest::decides_kept_below): the ids here, then the kept
    // ones below as truncate_wide lists them (id order), unlisted.
    if (p.top_k > 0 || p.top_p >= 1.0 || p.min_p > 0.0)
      fail(ErrorKind::kInternal, "truncate_candidates: ids kept below the candidates without top-p alone");
    TokenDistribution d;
    const double total = ranked.mass + kept_below.mass;
    d.ids.reserve(ranked.pairs.size());
    d.probs.reserve(ranked.pairs.size());
    for (size_t i = 0; i < ranked.pairs.size(); ++i) {
      d.ids.push_back(ranked.pairs[i].first);
      d.probs.push_back(static_cast<float>(ranked.weight[i] / total));
    }
    d.unlisted = kept_below.mass / total;
    d.scale = {.inv_temperature = 1.0 / p.temperature,
               .max_scaled = ranked.max_scaled,
               .total = total,
               .below = ranked.pairs.back().second,
               .at_least = kept_below.at_least};
    return d;
  }
  std::optional<TokenDistribution> d = truncate_ranked(ranked, p, rest_mass);
  if (!d)
    fail(ErrorKind::kInternal, "sampling candidates do not decide the truncation (rest mass {})", rest_mass);
  return *std::move(d);
}

std::optional<int32_t> draw(const TokenDistribution& d, double u) {
  double cumulative = 0.0;
  for (size_t i = 0; i < d.ids.size(); ++i) {
    cumulative += d.probs[i];
    if (u < cumulative) return d.ids[i];
  }
  if (d.unlisted > 0.0) return std::nullopt;  // below the listed ids
  return d.ids.back();                        // u beyond the float-rounded total
}

BelowDraw below_draw(const TokenDistribution& d, double u) {
  if (d.unlisted <= 0.0) fail(ErrorKind::kInternal, "below_draw: a distribution listed whole");
  double listed = 0.0;
  for (float p : d.probs) listed += p;
  return {.below = d.scale.below,
          .at_least = d.scale.at_least,
          .inv_temperature = d.scale.inv_temperature,
          .max_scaled = d.scale.max_scaled,
          .weight = std::max(0.0, u - listed) * d.scale.total};
}

int32_t sample(const TokenDistribution& d, Rng& rng) {
  if (d.unlisted > 0.0) fail(ErrorKind::kInternal, "sample: the distribution lists only part of its row");
  return *draw(d, rng.uniform());
}

CandidateRequest candidate_request(const SamplerParams& p, int64_t vocab_limit, bool rows_on_request) {
  if (p.greedy()) return {};
  return {.limit = vocab_limit,
          .top_k = p.top_k,
          .temperature = p.temperature,
          .top_p = p.top_p,
          .min_p = p.min_p,
          .rows_on_request = rows_on_request};
}

SamplerParams sampler_defaults(const GenerationConfig& g) {
  return {
      .temperature = g.do_sample ? g.temperature : 0.0, .top_k = g.top_k, .top_p = g.top_p, .min_p = g.min_p};
}

}  // namespace mtpx
