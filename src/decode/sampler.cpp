#include "decode/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

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

// What truncate() does once top-k has chosen the survivors: `ids` (any order) with logit(id) their logits.
// Sorted highest logit first (ties: lower id first), then softmax(logit / T), top-p, min-p, renormalized.
// rest_mass > 0: the ids are the top of a row whose other ids weigh rest_mass in all (each
// exp(logit / T - max / T)); it counts in top-p's total, and the result must not reach below the ids.
template <typename LogitOf>
TokenDistribution truncate_survivors(std::vector<int32_t> ids, LogitOf logit, const SamplerParams& p,
                                     double rest_mass = 0.0) {
  TokenDistribution d;
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    const float la = logit(a), lb = logit(b);
    return la > lb || (la == lb && a < b);
  });

  // softmax(logits / T) over the survivors, in double for a stable sum.
  const double inv_t = 1.0 / p.temperature;
  const double max_logit = logit(ids[0]) * inv_t;
  std::vector<double> w(ids.size());
  double total = 0.0;
  for (size_t i = 0; i < ids.size(); ++i) {
    w[i] = std::exp(static_cast<double>(logit(ids[i])) * inv_t - max_logit);
    total += w[i];
  }
  total += rest_mass;
  bool cut = false;  // whether top-p or min-p dropped ids here (then they drop every id below too)
  size_t keep = ids.size();
  if (p.top_p < 1.0) {
    // Keep token i while the mass strictly before it is < p (HF removes tokens whose ascending cumsum <=
    // 1-p). i == size: the first id past these (nothing, or the rest's first).
    double before = 0.0;
    for (size_t i = 0; i <= ids.size(); ++i) {
      if (before / total >= p.top_p && i > 0) {
        keep = i;
        cut = true;
        break;
      }
      if (i < ids.size()) before += w[i];
    }
  }
  if (p.min_p > 0.0) {
    const double floor = p.min_p * w[0];
    size_t i = 1;
    while (i < keep && w[i] >= floor) ++i;
    cut |= i < ids.size();
    keep = i;
  }
  if (rest_mass > 0.0 && !cut)
    fail(ErrorKind::kInternal, "sampling candidates do not decide the truncation (rest mass {})", rest_mass);
  double kept_total = 0.0;
  for (size_t i = 0; i < keep; ++i) kept_total += w[i];
  d.ids.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep));
  d.probs.resize(keep);
  for (size_t i = 0; i < keep; ++i) d.probs[i] = static_cast<float>(w[i] / kept_total);
  return d;
}

}  // namespace

TokenDistribution truncate(std::span<const float> logits, const SamplerParams& p, int64_t vocab_limit) {
  const int64_t n = std::min<int64_t>(vocab_limit, static_cast<int64_t>(logits.size()));
  if (n <= 0) invalid_input("no tokens to sample from");
  if (p.greedy()) return one_hot(argmax(logits, n));
  // The survivors of top-k (all ids without it): with top-k only k (plus ties) are sorted.
  std::vector<int32_t> ids;
  if (p.top_k > 0 && p.top_k < n) {
    // The k-th largest logit (counting repeats) from one pass that keeps the k largest in a min-heap: most
    // logits lose one comparison with the heap's top. (An nth_element over all n ids took 15 us for the
    // shipped model's 8192, and speculative decoding truncates 2K + 1 rows per step.)
    std::vector<float> heap(logits.begin(), logits.begin() + p.top_k);
    std::make_heap(heap.begin(), heap.end(), std::greater<>());
    auto offer = [&](int64_t i) {
      const float l = logits[static_cast<size_t>(i)];
      if (l > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<>());
        heap.back() = l;
        std::push_heap(heap.begin(), heap.end(), std::greater<>());
      }
    };
    // Blocks whose logits all lose to the heap's top are skipped after one (vectorized) test: the top only
    // grows, so a logit that loses to it at the block's start loses to it at its turn too, and the others
    // are offered in order, so the heap ends as the plain scan leaves it. (8192 ids: 7.3 -> 1.9 us.)
    int64_t i = p.top_k;
    for (; i + kBlock <= n; i += kBlock)
      if (any_passes(&logits[static_cast<size_t>(i)], heap.front(), std::greater<>()))
        for (int64_t j = i; j < i + kBlock; ++j) offer(j);
    for (; i < n; ++i) offer(i);
    const float kth = heap.front();
    // Keep every token whose logit is >= the k-th largest (ties at the boundary survive, as in HF).
    i = 0;
    for (; i + kBlock <= n; i += kBlock)
      if (any_passes(&logits[static_cast<size_t>(i)], kth, std::greater_equal<>()))
        for (int64_t j = i; j < i + kBlock; ++j)
          if (logits[static_cast<size_t>(j)] >= kth) ids.push_back(static_cast<int32_t>(j));
    for (; i < n; ++i)
      if (logits[static_cast<size_t>(i)] >= kth) ids.push_back(static_cast<int32_t>(i));
  } else {
    ids.resize(static_cast<size_t>(n));
    std::iota(ids.begin(), ids.end(), 0);
  }
  return truncate_survivors(
      std::move(ids), [&](int32_t id) { return logits[static_cast<size_t>(id)]; }, p);
}

TokenDistribution truncate_candidates(std::span<const int32_t> ids, std::span<const float> logits,
                                      const SamplerParams& p, double rest_mass) {
  if (ids.empty() || ids.size() != logits.size())
    invalid_input("truncate_candidates: {} ids with {} logits", ids.size(), logits.size());
  if (!(rest_mass >= 0.0)) invalid_input("truncate_candidates: a rest mass of {}", rest_mass);
  if (p.greedy()) {
    size_t best = 0;
    for (size_t i = 1; i < ids.size(); ++i)
      if (logits[i] > logits[best] || (logits[i] == logits[best] && ids[i] < ids[best])) best = i;
    return one_hot(ids[best]);
  }
  // logit(id) by the candidate's position: ids are unique, so sort positions by id once.
  std::vector<std::pair<int32_t, float>> by_id(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) by_id[i] = {ids[i], logits[i]};
  std::sort(by_id.begin(), by_id.end());
  auto logit = [&](int32_t id) {
    return std::lower_bound(by_id.begin(), by_id.end(), std::pair<int32_t, float>{id, -INFINITY})->second;
  };
  return truncate_survivors(std::vector<int32_t>(ids.begin(), ids.end()), logit, p, rest_mass);
}

int32_t sample(const TokenDistribution& d, Rng& rng) {
  const double u = rng.uniform();
  double cumulative = 0.0;
  for (size_t i = 0; i < d.ids.size(); ++i) {
    cumulative += d.probs[i];
    if (u < cumulative) return d.ids[i];
  }
  return d.ids.back();  // u beyond the float-rounded total
}

CandidateRequest candidate_request(const SamplerParams& p, int64_t vocab_limit) {
  if (p.greedy()) return {};
  return {.limit = vocab_limit,
          .top_k = p.top_k,
          .temperature = p.temperature,
          .top_p = p.top_p,
          .min_p = p.min_p};
}

SamplerParams sampler_defaults(const GenerationConfig& g) {
  return {
      .temperature = g.do_sample ? g.temperature : 0.0, .top_k = g.top_k, .top_p = g.top_p, .min_p = g.min_p};
}

}  // namespace mtpx
