#include "decode/sampler.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "test_util.h"
#include "util/error.h"

namespace mtpx {
namespace {

std::vector<double> softmax(const std::vector<float>& logits, double t) {
  std::vector<double> p(logits.size());
  double mx = -1e300, s = 0;
  for (float l : logits) mx = std::max(mx, l / t);
  for (size_t i = 0; i < logits.size(); ++i) s += (p[i] = std::exp(logits[i] / t - mx));
  for (double& x : p) x /= s;
  return p;
}

TEST(Sampler, GreedyIsOneHotArgmaxWithLowestIdOnTies) {
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  TokenDistribution d = truncate(logits, {.temperature = 0.0}, 4);
  ASSERT_EQ(d.ids.size(), 1u);
  EXPECT_EQ(d.ids[0], 1);
  EXPECT_EQ(d.probs[0], 1.0f);
  // Ids past the vocabulary limit are never chosen.
  EXPECT_EQ(argmax(std::vector<float>{0.0f, 1.0f, 9.0f}, 2), 1);
}

TEST(Sampler, TemperatureOnlyIsTheFullSoftmax) {
  std::vector<float> logits = {1.0f, 2.0f, 3.0f, 0.0f};
  TokenDistribution d = truncate(logits, {.temperature = 0.5}, 4);
  auto p = softmax(logits, 0.5);
  ASSERT_EQ(d.ids.size(), 4u);
  EXPECT_EQ(d.ids[0], 2);
  for (size_t i = 0; i < d.ids.size(); ++i) EXPECT_NEAR(d.probs[i], p[static_cast<size_t>(d.ids[i])], 1e-6);
}

TEST(Sampler, TopKKeepsTiesAtTheBoundary) {
  std::vector<float> logits = {5.0f, 1.0f, 3.0f, 3.0f, -2.0f};
  TokenDistribution d = truncate(logits, {.temperature = 1.0, .top_k = 2}, 5);
  // The 2nd largest logit is 3.0, shared by ids 2 and 3: both stay (transformers' TopKLogitsWarper).
  ASSERT_EQ(d.ids, (std::vector<int32_t>{0, 2, 3}));
  const double z = std::exp(5.0) + 2 * std::exp(3.0);
  EXPECT_NEAR(d.probs[0], std::exp(5.0) / z, 1e-6);
  EXPECT_NEAR(d.probs[1], std::exp(3.0) / z, 1e-6);
}

TEST(Sampler, TopPKeepsTheSmallestPrefixReachingP) {
  // probabilities 0.5, 0.3, 0.15, 0.05 (as logits of their logs)
  std::vector<float> logits = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  EXPECT_EQ(truncate(logits, {.temperature = 1.0, .top_p = 0.5}, 4).ids, (std::vector<int32_t>{1}));
  EXPECT_EQ(truncate(logits, {.temperature = 1.0, .top_p = 0.79}, 4).ids, (std::vector<int32_t>{1, 3}));
  TokenDistribution d = truncate(logits, {.temperature = 1.0, .top_p = 0.81}, 4);
  EXPECT_EQ(d.ids, (std::vector<int32_t>{1, 3, 0}));
  EXPECT_NEAR(d.probs[0], 0.5 / 0.95, 1e-6);
  EXPECT_NEAR(d.probs[2], 0.15 / 0.95, 1e-6);
}

TEST(Sampler, MinPDropsTokensBelowAFractionOfTheTop) {
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  EXPECT_EQ(truncate(logits, {.temperature = 1.0, .min_p = 0.2}, 4).ids, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(truncate(logits, {.temperature = 1.0, .min_p = 0.61}, 4).ids, (std::vector<int32_t>{0}));
}

// Top-k against a brute force (sort every id): logits on a coarse grid so that ties at the k-th value are
// common, k from 1 to past the vocabulary.
TEST(Sampler, TopKMatchesFullSort) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> grid(-40, 40);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t n = 1 + trial * 37 % 500;
    std::vector<float> logits(static_cast<size_t>(n));
    for (float& l : logits) l = static_cast<float>(grid(rng)) * 0.25f;
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{20}, n - 1, n, n + 5}) {
      if (k < 1) continue;
      std::vector<float> sorted = logits;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const float kth = sorted[static_cast<size_t>(std::min(k, n) - 1)];
      size_t expected = 0;
      for (float l : logits) expected += l >= kth ? 1 : 0;
      const TokenDistribution d = truncate(logits, {.temperature = 1.0, .top_k = k}, n);
      ASSERT_EQ(d.ids.size(), expected) << "n " << n << " k " << k;
      for (size_t i = 0; i < d.ids.size(); ++i) {
        ASSERT_GE(logits[static_cast<size_t>(d.ids[i])], kth);
        if (i > 0) {  // highest first, ties by lower id
          const float prev = logits[static_cast<size_t>(d.ids[i - 1])],
                      cur = logits[static_cast<size_t>(d.ids[i])];
          ASSERT_TRUE(prev > cur || (prev == cur && d.ids[i - 1] < d.ids[i]));
        }
      }
    }
  }
}

// What a device sends back for sampling: the ids < limit whose logit is >= threshold, shuffled (a device
// sends them in any order), and their logits.
std::pair<std::vector<int32_t>, std::vector<float>> candidates_at_or_above(const std::vector<float>& logits,
                                                                           int64_t limit, float threshold,
                                                                           std::mt19937& rng) {
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < limit; ++i)
    if (logits[static_cast<size_t>(i)] >= threshold) ids.push_back(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<float> values;
  for (int32_t id : ids) values.push_back(logits[static_cast<size_t>(id)]);
  return {ids, values};
}

// A device sends back only the survivors of top-k for sampling (every id below the limit whose logit is >=
// the k-th largest, ties included, in any order): truncate_candidates on them is truncate on the whole row,
// to the bit, for every sampler. Logits on a coarse grid, so ties at the boundary are common; the candidates
// are found here by sorting a copy, and shuffled.
TEST(Sampler, TruncatingTheTopKCandidatesIsTruncatingTheRow) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> grid(-30, 30);
  int checked = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t n = 2 + trial * 53 % 700, limit = n - trial % 3;
    std::vector<float> logits(static_cast<size_t>(n));
    for (float& l : logits) l = static_cast<float>(grid(rng)) * 0.3f;
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{20}, limit - 1}) {
      if (k < 1 || k >= limit) continue;
      std::vector<float> sorted(logits.begin(), logits.begin() + limit);
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const auto [ids, values] =
          candidates_at_or_above(logits, limit, sorted[static_cast<size_t>(k - 1)], rng);
      for (const SamplerParams& p :
           {SamplerParams{.temperature = 0.7, .top_k = k, .top_p = 0.95},
            SamplerParams{.temperature = 1.3, .top_k = k},
            SamplerParams{.temperature = 1.0, .top_k = k, .top_p = 0.5, .min_p = 0.1},
            SamplerParams{.temperature = 0.0, .top_k = k}}) {
        const TokenDistribution full = truncate(logits, p, limit),
                                from_candidates = truncate_candidates(ids, values, p);
        ASSERT_EQ(full.ids, from_candidates.ids) << "n " << n << " k " << k << " T " << p.temperature;
        ASSERT_EQ(full.probs, from_candidates.probs) << "n " << n << " k " << k << " T " << p.temperature;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 600);
  EXPECT_THROW(truncate_candidates({}, {}, {.temperature = 1.0, .top_k = 5}), Error);
}

// Without top-k, a device sends back the top of the row (every id < limit at or above a threshold) and the
// rest's mass: where CandidateRequest::decided_by() says they decide top-p or min-p, truncate_candidates on
// them is truncate on the whole row, to the bit; where they do not and the sampler's own sums agree, it
// fails rather than sample from a distribution missing the rest. Candidates are found here by sorting a
// copy, the rest's mass summed here in double (descending order, unlike the sampler's).
TEST(Sampler, ThresholdCandidatesWithTheRestMassDecideTheTruncationOfTheRow) {
  std::mt19937 rng(23);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  int decided = 0, undecided = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const int64_t n = 50 + trial * 97 % 3000, limit = n - trial % 4;
    std::vector<float> logits(static_cast<size_t>(n));
    for (float& l : logits) l = trial % 5 == 0 ? std::round(normal(rng)) : normal(rng);  // ties on a grid
    std::vector<float> sorted(logits.begin(), logits.begin() + limit);
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    for (int64_t top : {int64_t{1}, int64_t{8}, int64_t{40}, limit / 3}) {
      if (top < 1 || top >= limit) continue;
      const float threshold = sorted[static_cast<size_t>(top - 1)];
      const auto [ids, values] = candidates_at_or_above(logits, limit, threshold, rng);
      for (const SamplerParams& p :
           {SamplerParams{.temperature = 0.7, .top_p = 0.9}, SamplerParams{.temperature = 1.0, .min_p = 0.05},
            SamplerParams{.temperature = 1.3, .top_p = 0.6, .min_p = 0.2},
            SamplerParams{.temperature = 0.3, .top_p = 0.99}}) {
        const double inv_t = 1.0 / p.temperature, max_logit = sorted[0];
        double candidate_mass = 0.0, rest_mass = 0.0;
        for (float l : sorted)
          (l >= threshold ? candidate_mass : rest_mass) +=
              std::exp((static_cast<double>(l) - max_logit) * inv_t);
        const double lowest_weight = std::exp((static_cast<double>(threshold) - max_logit) * inv_t);
        const CandidateRequest request = candidate_request(p, limit);
        ASSERT_TRUE(request.active());
        const TokenDistribution full = truncate(logits, p, limit);
        if (request.decided_by(candidate_mass, rest_mass, lowest_weight)) {
          const TokenDistribution from_candidates = truncate_candidates(ids, values, p, rest_mass);
          ASSERT_EQ(full.ids, from_candidates.ids) << "n " << n << " top " << top << " T " << p.temperature;
          ASSERT_EQ(full.probs, from_candidates.probs)
              << "n " << n << " top " << top << " T " << p.temperature;
          ++decided;
        } else if (rest_mass > 0.0 && full.ids.size() > ids.size()) {
          // The row's truncation keeps ids below the candidates: they cannot give it.
          EXPECT_THROW(truncate_candidates(ids, values, p, rest_mass), Error) << "n " << n << " top " << top;
          ++undecided;
        }
      }
    }
  }
  EXPECT_GT(decided, 300);
  EXPECT_GT(undecided, 100);
  // Greedy needs no candidates; sampling does, top-k or not; a negative rest mass is refused.
  EXPECT_FALSE(candidate_request({.temperature = 0.0, .top_k = 20}, 100).active());
  EXPECT_FALSE(candidate_request({.temperature = 1.0}, 100).active());       // the whole row is sampled
  EXPECT_TRUE(candidate_request({.temperature = 1.0}, 100, true).active());  // unless it can be fetched
  EXPECT_TRUE(candidate_request({.temperature = 1.0, .top_k = 20}, 100).top_k_active());
  EXPECT_FALSE(candidate_request({.temperature = 1.0, .top_k = 100, .top_p = 0.9}, 100).top_k_active());
  EXPECT_THROW(truncate_candidates(std::vector<int32_t>{1}, std::vector<float>{0.0f}, {.top_p = 0.5}, -1.0),
               Error);
}

// Top-p alone whose prefix ends below a device's top ids: the device says where (the boundary logit, the
// mass above it below the top ids, at it and how many ids share it; computed here from a sort of the row,
// ranked by logit, ties by id). Where CandidateRequest::decides_kept_below() holds, truncate_candidates
// lists the top ids as truncate() of the row lists them (to 1e-6: the totals are summed in other orders),
// gives each id below its probability in the row's truncation through prob_of_logit (0 for those top-p
// drops), and a draw below the top (here on the host) follows the row listed as its top ids, then the
// kept ones in id order. A boundary shared by ids of which top-p keeps only some is refused.
TEST(Sampler, TopPEndingBelowADevicesTopIdsIsTheRowsTruncation) {
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int decided = 0, refused = 0;
  for (int trial = 0; trial < 6; ++trial) {
    const int64_t n = 9000 + trial * 4111;
    std::vector<float> logits(static_cast<size_t>(n));
    const bool grid = trial % 3 == 2;  // ties: a few hundred ids share each logit
    for (float& l : logits) l = grid ? std::round(normal(rng) * 16) / 16 : normal(rng);
    const std::vector<int32_t> ranked = testing_util::ranked_by_logit(logits, n);
    const float threshold = logits[static_cast<size_t>(ranked[767])];
    const auto [ids, values] = candidates_at_or_above(logits, n, threshold, rng);
    for (const double t : {0.8, 1.0, 1.5}) {
      const double max_logit = logits[static_cast<size_t>(ranked[0])];
      auto weight = [&](int32_t id) {
        return std::exp((static_cast<double>(logits[static_cast<size_t>(id)]) - max_logit) / t);
      };
      double total = 0.0, candidate_mass = 0.0;
      for (int32_t id : ranked) total += weight(id);
      for (int32_t id : ids) candidate_mass += weight(id);
      for (const double top_p : {0.6, 0.8, 0.97}) {
        const SamplerParams p{.temperature = t, .top_p = top_p};
        const std::string where = fmt::format("n {} T {} top-p {}", n, t, top_p);
        // The last id the prefix keeps: the mass before it is < top_p of the total.
        double before = 0.0;
        size_t last = 0;
        for (size_t i = 0; i < ranked.size() && before < top_p * total; ++i)
          last = i, before += weight(ranked[i]);
        const float boundary = logits[static_cast<size_t>(ranked[last])];
        ASSERT_LT(boundary, threshold) << where;  // flat rows: the prefix ends below the top ids
        double above = 0.0, at = 0.0;
        int64_t count = 0;
        for (int32_t i = 0; i < n; ++i) {
          const float l = logits[static_cast<size_t>(i)];
          if (l < threshold && l > boundary) above += weight(i);
          if (l == boundary) at += weight(i), ++count;
        }
        const CandidateRequest request = candidate_request(p, n);
        ASSERT_FALSE(request.decided_by(candidate_mass, total - candidate_mass, 0.0)) << where;
        if (!request.decides_kept_below(candidate_mass, above, at, count, total)) {
          ++refused;
          EXPECT_GT(count, 1) << where;  // only a boundary shared with ids top-p drops
          continue;
        }
        ++decided;
        const TokenDistribution top = truncate_candidates(ids, values, p, total - candidate_mass,
                                                          {.at_least = boundary, .mass = above + at});
        const TokenDistribution row = truncate(logits, p, n);
        ASSERT_EQ(top.ids.size(), ids.size()) << where;
        ASSERT_GT(row.ids.size(), ids.size()) << where;
        for (size_t i = 0; i < top.ids.size(); ++i) {
          ASSERT_EQ(top.ids[i], row.ids[i]) << where;
          ASSERT_NEAR(top.probs[i], row.probs[i], 1e-6 * row.probs[i]) << where;
        }
        double unlisted = 0.0;
        std::set<int32_t> kept;
        for (size_t i = ids.size(); i < row.ids.size(); ++i) {
          kept.insert(row.ids[i]);
          unlisted += row.probs[i];
          ASSERT_NEAR(top.prob_of_logit(logits[static_cast<size_t>(row.ids[i])]), row.probs[i],
                      1e-6 * row.probs[i])
              << where << " id " << row.ids[i];
        }
        EXPECT_NEAR(top.unlisted, unlisted, 1e-5) << where;
        int dropped = 0;
        for (int32_t i = 0; i < n; ++i)
          if (logits[static_cast<size_t>(i)] < threshold && kept.count(i) == 0) {
            ASSERT_EQ(top.prob_of_logit(logits[static_cast<size_t>(i)]), 0.0f) << where << " id " << i;
            ++dropped;
          }
        EXPECT_GT(dropped, 0) << where;
        // The inverse CDF of the top ids ranked, then the kept ones in id order; draws below the top land
        // where it puts u (or a neighbour, within the floats' rounding of the listed probabilities).
        std::vector<int32_t> listed(top.ids);
        for (int32_t id : kept) listed.push_back(id);
        std::vector<double> cumulative;
        double sum = 0.0;
        for (int32_t id : listed) cumulative.push_back(sum += weight(id));
        for (int i = 0; i < 3000; ++i) {
          const double u = (i + 0.5) / 3000;
          const size_t k = static_cast<size_t>(
              std::upper_bound(cumulative.begin(), cumulative.end(), u * sum) - cumulative.begin());
          const std::optional<int32_t> from_top = draw(top, u);
          const int32_t got = from_top ? *from_top : [&] {
            BelowDraw d = below_draw(top, u);
            d.limit = n;
            return testing_util::draw_below_reference(logits, d);
          }();
          const double start = k == 0 ? 0.0 : cumulative[k - 1] / sum, end = cumulative[k] / sum;
          const bool neighbour = (u - start < 1e-6 && k > 0 && got == listed[k - 1]) ||
                                 (end - u < 1e-6 && k + 1 < listed.size() && got == listed[k + 1]);
          ASSERT_TRUE(got == listed[k] || neighbour)
              << where << " u " << u << ": " << got << " for " << listed[k];
        }
      }
    }
  }
  EXPECT_GT(decided, 25);
  EXPECT_GT(refused, 0);  // the grid's rows: boundaries shared by a few hundred ids
  // The rule on small numbers (total 1 unless said): an id is kept while the mass before it is < top_p.
  const CandidateRequest top_p_85{.limit = 10, .top_p = 0.85}, top_p_75{.limit = 10, .top_p = 0.75};
  EXPECT_TRUE(top_p_85.decides_kept_below(0.5, 0.3, 0.1, 1, 1.0));    // 0.8 before it, 0.9 after
  EXPECT_FALSE(top_p_85.decides_kept_below(0.5, 0.4, 0.1, 1, 1.0));   // 0.9 before it: not kept
  EXPECT_FALSE(top_p_85.decides_kept_below(0.5, 0.2, 0.1, 1, 1.0));   // 0.8 after it: the next is kept
  EXPECT_TRUE(top_p_85.decides_kept_below(0.5, 0.2, 0.2, 2, 1.0));    // 0.7 and 0.8 before the two at it
  EXPECT_FALSE(top_p_75.decides_kept_below(0.5, 0.2, 0.2, 2, 1.0));   // 0.8 before the second: one of two
  EXPECT_TRUE(top_p_75.decides_kept_below(0.5, 0.2, 0.2, 2, 1.1));    // 0.8 < 0.825 before the second
  EXPECT_FALSE(top_p_85.decides_kept_below(0.5, 0.3, 0.05, 1, 1.0));  // 0.85 after it: within the margin
  EXPECT_FALSE(top_p_85.decides_kept_below(0.5, 0.3, 0.0, 0, 1.0));   // no id at the boundary
  EXPECT_FALSE(
      (CandidateRequest{.limit = 10, .top_p = 0.85, .min_p = 0.1}.decides_kept_below(0.5, 0.3, 0.1, 1, 1.0)));
  EXPECT_FALSE(
      (CandidateRequest{.limit = 10, .top_k = 5, .top_p = 0.85}.decides_kept_below(0.5, 0.3, 0.1, 1, 1.0)));
  const std::vector<int32_t> three_ids = {4, 1, 7};
  const std::vector<float> three_logits = {0.5f, 1.0f, 0.25f};
  EXPECT_THROW(truncate_candidates(three_ids, three_logits, {.temperature = 1.0, .top_p = 0.5, .min_p = 0.1},
                                   1.0, {.at_least = -1.0f, .mass = 0.5}),
               Error);
}

// The top-k scan skips blocks of logits that all lose to the heap's top: orders where the top changes
// within a block (ascending, by 0.01 or by a hair), never (descending) or at random, block edges and tails
// included.
TEST(Sampler, TopKBlockSkippingKeepsExactlyTheTopK) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t n : {31, 32, 33, 84, 1000, 8192}) {
    for (int order = 0; order < 4; ++order) {
      std::vector<float> logits(static_cast<size_t>(n));
      for (size_t i = 0; i < logits.size(); ++i)
        logits[i] = order == 0   ? static_cast<float>(i) * 0.01f
                    : order == 1 ? -static_cast<float>(i) * 0.01f
                    : order == 2 ? normal(rng)
                                 : 1.0f + static_cast<float>(i) * 1e-6f;  // each beats the top by a hair
      for (int64_t k : {1, 20, 32, 33}) {
        if (k > n) continue;
        std::vector<int32_t> expected(static_cast<size_t>(n));
        std::iota(expected.begin(), expected.end(), 0);
        std::stable_sort(expected.begin(), expected.end(), [&](int32_t x, int32_t y) {
          return logits[static_cast<size_t>(x)] > logits[static_cast<size_t>(y)];
        });
        expected.resize(static_cast<size_t>(k));  // distinct values here: no ties at the boundary
        const TokenDistribution d = truncate(logits, {.temperature = 1.0, .top_k = k}, n);
        ASSERT_EQ(d.ids, expected) << "n " << n << " order " << order << " k " << k;
      }
    }
  }
}

// The row's distribution as transformers computes it, by brute force: every id < n sorted (highest logit
// first, ties by id), softmax(logit / T) in double, top-p (keep while the mass before < p), min-p,
// renormalized.
std::pair<std::vector<int32_t>, std::vector<double>> brute_force(const std::vector<float>& logits, int64_t n,
                                                                 const SamplerParams& p) {
  std::vector<int32_t> order = testing_util::ranked_by_logit(logits, n);
  std::vector<double> w;
  double total = 0;
  for (int32_t id : order)
    total += w.emplace_back(
        std::exp((logits[static_cast<size_t>(id)] - logits[static_cast<size_t>(order[0])]) / p.temperature));
  size_t keep = order.size();
  double before = 0;
  for (size_t i = 0; i < order.size() && p.top_p < 1.0; ++i) {  // top-p 1: no top-p step (HF's neither)
    if (i > 0 && before / total >= p.top_p) {
      keep = i;
      break;
    }
    before += w[i];
  }
  size_t i = 1;
  while (i < keep && w[i] >= p.min_p * w[0]) ++i;
  keep = i;
  order.resize(keep);
  w.resize(keep);
  const double kept = std::accumulate(w.begin(), w.end(), 0.0);
  for (double& x : w) x /= kept;
  return {order, w};
}

// Rows of more than 4096 ids without top-k are truncated from their top ids and the rest's mass, not a
// sort of the whole row: the result is the brute force's. Where it keeps ids below the top ones (temperature
// alone; top-p 0.9999 at T 2; flat rows, as a random checkpoint's, where top-p 0.95 or min-p keeps most of
// the vocabulary), the ids at or above the 1024th largest logit lead in the brute force's order and the
// others follow in id order. Rows rounded to a grid put many ties in the bin where top-p's prefix ends.
TEST(Sampler, LongRowsWithoutTopKAreTheBruteForcesDistribution) {
  std::mt19937 rng(41);
  for (int trial = 0; trial < 7; ++trial) {
    const bool flat = trial >= 4;
    const int64_t n = flat ? (trial == 6 ? 248320 : 30000 + 7001 * trial) : 5000 + 9000 * trial;
    const int64_t limit = n - trial * 7;
    std::normal_distribution<float> normal(0.0f, flat ? 0.05f : 3.0f);
    std::vector<float> logits(static_cast<size_t>(n));
    for (float& l : logits)
      l = trial % 2 == 0 ? std::round(normal(rng) * (flat ? 512 : 4)) / (flat ? 512 : 4)
                         : normal(rng);  // ties
    if (trial == 5) logits[17] = -std::numeric_limits<float>::infinity();
    std::vector<float> sorted(logits.begin(), logits.begin() + limit);
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    const size_t top = static_cast<size_t>(
        std::count_if(logits.begin(), logits.begin() + limit, [&](float l) { return l >= sorted[1023]; }));
    for (const SamplerParams& p :
         {SamplerParams{.temperature = 0.7}, SamplerParams{.temperature = 2.0},
          SamplerParams{.temperature = 1.0, .top_p = 0.9}, SamplerParams{.temperature = 2.0, .top_p = 0.9999},
          SamplerParams{.temperature = 1.0, .min_p = 0.01}, SamplerParams{.temperature = 3.0, .min_p = 0.001},
          SamplerParams{.temperature = 0.8, .top_p = 0.95, .min_p = 0.02},
          SamplerParams{.temperature = 0.8, .top_p = 0.95}, SamplerParams{.temperature = 0.1, .top_p = 0.5},
          SamplerParams{.temperature = 1.0, .min_p = 0.9},
          SamplerParams{.temperature = 0.5, .top_p = 0.95, .min_p = 0.8}}) {
      const auto [ids, probs] = brute_force(logits, limit, p);
      const TokenDistribution d = truncate(logits, p, limit);
      ASSERT_EQ(d.ids.size(), ids.size()) << "n " << n << " T " << p.temperature << " top-p " << p.top_p;
      EXPECT_EQ(d.unlisted, 0.0);
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i < top) {
          ASSERT_EQ(d.ids[i], ids[i]) << "at " << i << " n " << n << " T " << p.temperature;
        } else if (i > top) {
          ASSERT_LT(d.ids[i - 1], d.ids[i]) << "at " << i;  // the rest in id order
        }
      }
      std::vector<double> by_id(static_cast<size_t>(limit), -1.0);
      for (size_t i = 0; i < ids.size(); ++i) by_id[static_cast<size_t>(ids[i])] = probs[i];
      double sum = 0;
      for (size_t i = 0; i < d.ids.size(); ++i) {
        const double expected = by_id[static_cast<size_t>(d.ids[i])];
        ASSERT_NEAR(d.probs[i], expected, 1e-6 * expected + 1e-12) << "id " << d.ids[i];
        sum += d.probs[i];
      }
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  }
}

// A device's top ids of a row sampled whole (temperature alone), with the rest's mass: draw() gives the
// row's own draw at every u below their share and asks for the row (nullopt) at every u above it, where
// the row's draw is one of the ids below them; there below_draw() points a draw in id order below the top
// (a device's draw_below, here on the host) at the id the row listed as its top ids, then the others in
// id order, has at u. sample() refuses the part.
TEST(Sampler, DrawsBelowADevicesTopIdsAreTheRowsDraws) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int trial = 0; trial < 3; ++trial) {
    const int64_t n = 12000 + trial * 5000;
    std::vector<float> logits(static_cast<size_t>(n));
    for (float& l : logits) l = trial == 1 ? std::round(normal(rng) * 8) / 8 : normal(rng);
    std::vector<float> sorted = logits;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    const float threshold = sorted[767];  // as the CUDA executor asks: the 768 largest, ties included
    const auto [ids, values] = candidates_at_or_above(logits, n, threshold, rng);
    for (double t : {0.6, 1.0, 1.7}) {
      const SamplerParams p{.temperature = t};
      double rest = 0;
      for (float l : sorted)
        if (l < threshold) rest += std::exp((static_cast<double>(l) - sorted[0]) / t);
      const TokenDistribution top = truncate_candidates(ids, values, p, rest), row = truncate(logits, p, n);
      ASSERT_EQ(top.ids.size(), ids.size());
      ASSERT_GT(top.unlisted, 1e-4) << "T " << t;
      const std::set<int32_t> top_ids(ids.begin(), ids.end());
      // The row listed as its top ids (highest first, ties by id), then the others in id order, with the
      // cumulative weights: the inverse CDF a draw below the top follows.
      std::vector<int32_t> listed(ids.begin(), ids.end());
      std::sort(listed.begin(), listed.end(), [&](int32_t a, int32_t b) {
        const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
        return la > lb || (la == lb && a < b);
      });
      for (int32_t i = 0; i < n; ++i)
        if (top_ids.count(i) == 0) listed.push_back(i);
      std::vector<double> cumulative;
      double total = 0;
      for (int32_t id : listed)
        cumulative.push_back(
            total += std::exp((static_cast<double>(logits[static_cast<size_t>(id)]) - sorted[0]) / t));
      int below = 0;
      const int draws = 20000;
      for (int i = 0; i < draws; ++i) {
        const double u = (i + 0.5) / draws;
        const std::optional<int32_t> from_top = draw(top, u), from_row = draw(row, u);
        ASSERT_TRUE(from_row.has_value());
        if (from_top) {
          ASSERT_EQ(*from_top, *from_row) << "u " << u << " T " << t;
        } else {
          ASSERT_EQ(top_ids.count(*from_row), 0u) << "u " << u << " T " << t;
          ++below;
          BelowDraw at = below_draw(top, u);
          at.limit = n;
          const size_t k = static_cast<size_t>(
              std::upper_bound(cumulative.begin(), cumulative.end(), u * total) - cumulative.begin());
          const double start = k == 0 ? 0.0 : cumulative[k - 1] / total, end = cumulative[k] / total;
          // The listed probabilities are floats, so their sum may put a u within 1e-7 of a boundary on
          // either side of it.
          const int32_t got = testing_util::draw_below_reference(logits, at);
          const bool neighbour = (u - start < 1e-7 && k > 0 && got == listed[k - 1]) ||
                                 (end - u < 1e-7 && k + 1 < listed.size() && got == listed[k + 1]);
          ASSERT_TRUE(got == listed[k] || neighbour)
              << "u " << u << " T " << t << ": " << got << " for " << listed[k] << ", from the boundaries "
              << u - start << ", " << end - u;
        }
      }
      EXPECT_NEAR(below, top.unlisted * draws, 1.0) << "T " << t;
      Rng r(1);
      EXPECT_THROW(sample(top, r), Error);
    }
  }
}

TEST(Sampler, OrderIsTemperatureTopKTopPMinP) {
  // After temperature 2 the probabilities flatten; top-k 3 then top-p 0.6 over the renormalized three.
  std::vector<float> logits = {4.0f, 3.0f, 2.0f, 1.0f, 0.0f};
  TokenDistribution d = truncate(logits, {.temperature = 2.0, .top_k = 3, .top_p = 0.6}, 5);
  auto p = softmax({4.0f, 3.0f, 2.0f}, 2.0);  // 0.506, 0.307, 0.186
  ASSERT_EQ(d.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(d.probs[0], p[0] / (p[0] + p[1]), 1e-6);
}

TEST(Sampler, SamplingFollowsTheDistribution) {
  std::vector<float> logits = {std::log(0.5f), std::log(0.25f), std::log(0.125f), std::log(0.125f)};
  TokenDistribution d = truncate(logits, {.temperature = 1.0}, 4);
  Rng rng(42);
  std::vector<int> counts(4);
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++counts[static_cast<size_t>(sample(d, rng))];
  // Chi-square with 3 degrees of freedom; 16.27 is the 0.999 quantile (false alarm 1e-3, fixed seed).
  const double expected[] = {0.5, 0.25, 0.125, 0.125};
  double chi2 = 0;
  for (int i = 0; i < 4; ++i)
    chi2 += std::pow(counts[static_cast<size_t>(i)] - n * expected[i], 2) / (n * expected[i]);
  EXPECT_LT(chi2, 16.27);
}

TEST(Sampler, SeededRngRepeats) {
  Rng a(7), b(7), c(8);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.uniform(), b.uniform());
  EXPECT_NE(Rng(7).uniform(), c.uniform());
}

TEST(Sampler, RejectsBadParameters) {
  EXPECT_THROW(validate({.temperature = -1.0}), Error);
  EXPECT_THROW(validate({.temperature = 1.0, .top_k = -3}), Error);
  EXPECT_THROW(validate({.temperature = 1.0, .top_p = 0.0}), Error);
  EXPECT_THROW(validate({.temperature = 1.0, .top_p = 1.5}), Error);
  EXPECT_THROW(validate({.temperature = 1.0, .min_p = 2.0}), Error);
  EXPECT_NO_THROW(validate({.temperature = 0.7, .top_k = 20, .top_p = 0.95, .min_p = 0.05}));
}

}  // namespace
}  // namespace mtpx
