// MTP speculative decoding: the rejection sampler's math, exact rollback, and end-to-end losslessness
// (greedy: token for token; sampled: in distribution) on fixture models with a native MTP head.
#include "decode/speculative.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>

#include "decode/generate.h"
#include "model/qwen35.h"
#include "test_paths.h"
#include "test_util.h"
#include "util/error.h"

namespace mtpx {
namespace {

using test_paths::kDefaultModel;
using test_paths::kFixtures;

TokenDistribution dist(std::vector<int32_t> ids, std::vector<float> probs) {
  return {std::move(ids), std::move(probs)};
}

// Chi-square homogeneity test of two samples over the same categories; categories with few counts are
// pooled. Returns (statistic, critical value at false-alarm rate 1e-3) via Wilson-Hilferty.
std::pair<double, double> chi_square_two_sample(const std::map<std::string, int>& a,
                                                const std::map<std::string, int>& b) {
  std::map<std::string, std::pair<double, double>> cells;
  for (auto& [k, v] : a) cells[k].first += v;
  for (auto& [k, v] : b) cells[k].second += v;
  std::vector<std::pair<double, double>> merged;
  std::pair<double, double> pooled{0, 0};
  for (auto& [k, v] : cells) {
    if (v.first + v.second >= 20)
      merged.push_back(v);
    else
      pooled.first += v.first, pooled.second += v.second;
  }
  if (pooled.first + pooled.second > 0) merged.push_back(pooled);
  double na = 0, nb = 0;
  for (auto& [x, y] : merged) na += x, nb += y;
  double chi2 = 0;
  for (auto& [x, y] : merged) {
    const double total = x + y, ea = total * na / (na + nb), eb = total * nb / (na + nb);
    chi2 += (x - ea) * (x - ea) / ea + (y - eb) * (y - eb) / eb;
  }
  const double df = static_cast<double>(merged.size() - 1), z = 3.0902;  // z_{0.999}
  const double critical = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
  return {chi2, critical};
}

TEST(AcceptDrafts, GreedyIsExactMatchThenTargetArgmax) {
  Rng rng(1);
  auto one = [](int32_t id) { return dist({id}, {1.0f}); };
  // Target argmaxes 5, 6, 7, bonus 8.
  std::vector<TokenDistribution> target = {one(5), one(6), one(7), one(8)};
  EXPECT_EQ(accept_drafts(std::vector<int32_t>{5, 6, 7}, std::vector{one(5), one(6), one(7)}, target, rng),
            (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(accept_drafts(std::vector<int32_t>{5, 9, 7}, std::vector{one(5), one(9), one(7)}, target, rng),
            (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(accept_drafts(std::vector<int32_t>{4, 6, 7}, std::vector{one(4), one(6), one(7)}, target, rng),
            (std::vector<int32_t>{5}));
}

TEST(AcceptDrafts, ResidualIsNormalizedPositivePart) {
  TokenDistribution p = dist({0, 1, 2}, {0.5f, 0.3f, 0.2f});
  TokenDistribution q = dist({1, 0, 3}, {0.6f, 0.2f, 0.2f});
  TokenDistribution r = residual_distribution(p, q);
  // max(p - q, 0) = {0: 0.3, 1: 0, 2: 0.2, 3: 0} -> {0: 0.6, 2: 0.4}
  ASSERT_EQ(r.ids, (std::vector<int32_t>{0, 2}));
  EXPECT_NEAR(r.probs[0], 0.6, 1e-6);
  EXPECT_NEAR(r.probs[1], 0.4, 1e-6);
}

// Rows sampled whole list every id (a dense table of q's probabilities then, not a map): the residual is
// still max(p - q, 0) normalized, for ids in any order and q listing ids p does not.
TEST(AcceptDrafts, ResidualOfRowsSampledWhole) {
  std::mt19937 rng(5);
  const int32_t n = 6000;
  auto random_row = [&](int32_t ids) {
    TokenDistribution d;
    std::vector<double> w(static_cast<size_t>(ids));
    double total = 0;
    for (double& x : w) total += (x = std::uniform_real_distribution<double>(0.0, 1.0)(rng));
    for (int32_t i = 0; i < ids; ++i) d.ids.push_back(i);
    std::shuffle(d.ids.begin(), d.ids.end(), rng);
    for (int32_t id : d.ids) d.probs.push_back(static_cast<float>(w[static_cast<size_t>(id)] / total));
    return d;
  };
  const TokenDistribution p = random_row(n), q = random_row(n + 100);
  std::vector<double> pp(static_cast<size_t>(n + 100)), qq(pp.size()), expected(pp.size());
  for (size_t i = 0; i < p.ids.size(); ++i) pp[static_cast<size_t>(p.ids[i])] = p.probs[i];
  for (size_t i = 0; i < q.ids.size(); ++i) qq[static_cast<size_t>(q.ids[i])] = q.probs[i];
  double total = 0;
  for (size_t i = 0; i < pp.size(); ++i) total += (expected[i] = std::max(0.0, pp[i] - qq[i]));
  const TokenDistribution r = residual_distribution(p, q);
  size_t positive = 0;
  for (double e : expected) positive += e > 0 ? 1 : 0;
  ASSERT_EQ(r.ids.size(), positive);
  for (size_t i = 0; i < r.ids.size(); ++i)
    ASSERT_NEAR(r.probs[i], expected[static_cast<size_t>(r.ids[i])] / total, 1e-6) << r.ids[i];
}

// Rows listed in part, as a device returns them: the top `top` ids (ties included) with their share, and
// the share of the ids kept below them unlisted: all of them sampled whole (temperature alone), those down
// to top-p's boundary with top-p whose prefix ends below the top ids; `below` reaches under them from the
// rows' logits.
struct RowsInPart {
  int64_t n = 0, top = 0;
  SamplerParams sampler;
  TokenDistribution in_part(const std::vector<float>& logits) const {
    std::vector<float> sorted = logits;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    std::vector<int32_t> ids;
    std::vector<float> values;
    const float threshold = sorted[static_cast<size_t>(top - 1)];
    double candidate_mass = 0, rest = 0;
    for (int32_t i = 0; i < n; ++i) {
      const float l = logits[static_cast<size_t>(i)];
      const double w = std::exp((static_cast<double>(l) - sorted[0]) / sampler.temperature);
      if (l >= threshold) {
        ids.push_back(i), values.push_back(l), candidate_mass += w;
      } else {
        rest += w;
      }
    }
    if (sampler.top_p >= 1.0) return truncate_candidates(ids, values, sampler, rest);
    const testing_util::TopPEnd end =
        testing_util::top_p_end(logits, n, sampler.temperature, sampler.top_p, threshold);
    const CandidateRequest request = candidate_request(sampler, n, true);
    EXPECT_TRUE(end.boundary < threshold && request.decides_kept_below(candidate_mass, end.above, end.at,
                                                                       end.count, candidate_mass + rest))
        << "top-p's prefix should end below the top ids";
    return truncate_candidates(ids, values, sampler, rest,
                               {.at_least = end.boundary, .mass = end.above + end.at});
  }
};

// accept_drafts on rows listed in part accepts and rejects as on the whole rows, for the same seed (one
// id's probability from its logit is the whole row's), and emits the same bonus; a row listed in part with
// no way below its ids is an error, not a wrong draw.
TEST(AcceptDrafts, RowsListedInPartAcceptAsTheWholeRows) {
  std::mt19937 gen(8);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t K = 3;
  for (const SamplerParams& sampler :
       {SamplerParams{.temperature = 1.2}, SamplerParams{.temperature = 1.2, .top_p = 0.95}}) {
    const RowsInPart part{.n = 6000, .top = 768, .sampler = sampler};
    auto row = [&] {
      std::vector<float> logits(static_cast<size_t>(part.n));
      for (float& l : logits) l = normal(gen);
      return logits;
    };
    int rejected = 0, all_accepted = 0, logits_read = 0;
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<std::vector<float>> p_logits, q_logits;
      std::vector<TokenDistribution> p_whole, q_whole, p_part, q_part;
      for (int64_t i = 0; i <= K; ++i) {
        p_logits.push_back(row());
        p_whole.push_back(truncate(p_logits.back(), part.sampler, part.n));
        p_part.push_back(part.in_part(p_logits.back()));
        ASSERT_GT(p_part.back().unlisted, 0.0);
        if (i == K) break;
        q_logits.push_back(row());
        q_whole.push_back(truncate(q_logits.back(), part.sampler, part.n));
        q_part.push_back(part.in_part(q_logits.back()));
      }
      RowsBelow below;
      below.logit = [&](bool target, size_t i, int32_t id) {
        ++logits_read;
        return (target ? p_logits : q_logits)[i][static_cast<size_t>(id)];
      };
      below.whole = [&](bool target, size_t i) -> const TokenDistribution& {
        return target ? p_whole[i] : q_whole[i];
      };
      for (uint64_t seed = 0; seed < 50; ++seed) {
        Rng draft_rng(seed * 31 + static_cast<uint64_t>(trial));
        std::vector<int32_t> drafts;
        for (const TokenDistribution& q : q_whole) drafts.push_back(sample(q, draft_rng));
        Rng a(seed), b(seed);
        const std::vector<int32_t> from_part = accept_drafts(drafts, q_part, p_part, a, below),
                                   from_whole = accept_drafts(drafts, q_whole, p_whole, b);
        ASSERT_EQ(from_part.size(), from_whole.size()) << "trial " << trial << " seed " << seed;
        if (from_part.size() == drafts.size() + 1) {
          ASSERT_EQ(from_part, from_whole) << "trial " << trial << " seed " << seed;  // the same bonus draw
          ++all_accepted;
        } else {
          ++rejected;  // the same accepted prefix; the recovered token has the residual's law (test below)
          ASSERT_TRUE(std::equal(from_part.begin(), from_part.end() - 1, from_whole.begin()));
        }
      }
    }
    EXPECT_GT(rejected, 100) << "top-p " << sampler.top_p;
    EXPECT_GT(all_accepted, 0) << "top-p " << sampler.top_p;
    EXPECT_GT(logits_read, 0) << "top-p " << sampler.top_p;
    Rng rng(1);
    const TokenDistribution listed = part.in_part(row());
    std::vector<int32_t> below_ids;  // an id below the listed ones: its probability needs more of the row
    for (int32_t i = 0; i < part.n && below_ids.empty(); ++i)
      if (listed.prob(i) == 0.0f) below_ids.push_back(i);
    EXPECT_THROW(accept_drafts(below_ids, std::vector{listed}, std::vector{listed, listed}, rng), Error);
  }
}

// draw_residual from rows listed in part (proposals from p kept with probability max(0, 1 - q / p)) has the
// law of normalize(max(p - q, 0)) over the whole rows: chi-square against draws from residual_distribution,
// for rows far apart (the proposals decide) and for rows so close that the proposals often give up (then
// the whole rows' residual decides), with few listed ids so that draws below them come often.
TEST(AcceptDrafts, ResidualOfRowsListedInPartHasTheResidualLaw) {
  std::mt19937 gen(21);
  std::normal_distribution<float> normal(0.0f, 2.0f), jitter(0.0f, 0.01f);
  for (const SamplerParams& sampler :
       {SamplerParams{.temperature = 1.2}, SamplerParams{.temperature = 1.2, .top_p = 0.9}}) {
    const RowsInPart part{.n = 1000, .top = 100, .sampler = sampler};
    std::vector<float> p_logits(static_cast<size_t>(part.n));
    for (float& l : p_logits) l = normal(gen);
    for (bool close : {false, true}) {
      std::vector<float> q_logits = p_logits;
      for (float& l : q_logits) l = close ? l + jitter(gen) : normal(gen);
      const TokenDistribution p_whole = truncate(p_logits, part.sampler, part.n),
                              q_whole = truncate(q_logits, part.sampler, part.n);
      const TokenDistribution p_part = part.in_part(p_logits), q_part = part.in_part(q_logits);
      // p draws below its top ids as a device does (in id order), q only from its whole row.
      int q_whole_asked = 0;
      const SampledRow p_row{p_part, [&](int32_t id) { return p_logits[static_cast<size_t>(id)]; },
                             [&](BelowDraw d) {
                               d.limit = part.n;
                               return testing_util::draw_below_reference(p_logits, d);
                             },
                             [&]() -> const TokenDistribution& { return p_whole; }};
      const SampledRow q_row{q_part,
                             [&](int32_t id) { return q_logits[static_cast<size_t>(id)]; },
                             {},
                             [&]() -> const TokenDistribution& {
                               ++q_whole_asked;
                               return q_whole;
                             }};
      const TokenDistribution exact = residual_distribution(p_whole, q_whole);
      const int draws = 20000;
      std::map<std::string, int> from_part, from_exact;
      Rng a(3), b(4);
      for (int i = 0; i < draws; ++i) {
        ++from_part[std::to_string(draw_residual(p_row, q_row, a))];
        ++from_exact[std::to_string(sample(exact, b))];
      }
      const auto [chi2, critical] = chi_square_two_sample(from_part, from_exact);
      EXPECT_LT(chi2, critical) << (close ? "close rows" : "rows far apart") << ", top-p " << sampler.top_p;
      if (close)
        EXPECT_GT(q_whole_asked, draws / 10);  // the proposals gave up (residual mass ~1%)
      else
        EXPECT_LT(q_whole_asked, draws / 1000);
    }
  }
}

// The emitted first token is distributed as p whatever q is (the theorem of speculative sampling).
TEST(AcceptDrafts, FirstTokenFollowsTheTargetDistribution) {
  TokenDistribution p = dist({0, 1, 2, 3}, {0.4f, 0.3f, 0.2f, 0.1f});
  TokenDistribution q = dist({3, 2, 1, 4}, {0.5f, 0.2f, 0.2f, 0.1f});  // disagrees with p, even on support
  Rng rng(2026);
  const int n = 60000;
  std::vector<int> counts(5);
  for (int i = 0; i < n; ++i) {
    const int32_t d = sample(q, rng);
    std::vector<int32_t> out = accept_drafts(std::vector<int32_t>{d}, std::vector{q}, std::vector{p, p}, rng);
    ++counts[static_cast<size_t>(out[0])];
  }
  EXPECT_EQ(counts[4], 0);  // never outside p's support
  double chi2 = 0;
  for (int i = 0; i < 4; ++i)
    chi2 += std::pow(counts[static_cast<size_t>(i)] - n * p.probs[static_cast<size_t>(i)], 2) /
            (n * p.probs[static_cast<size_t>(i)]);
  EXPECT_LT(chi2, 16.27);  // chi-square, 3 degrees of freedom, false alarm 1e-3
}

// A recorded window cut back to its first `keep` tokens leaves exactly the state of having run only those.
TEST(Rollback, RecordedWindowCutBackIsBitwiseExact) {
  auto model = Model::load(kFixtures / "wrapper_sharded_tied_bf16");
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  const std::vector<int32_t> window = {10, 20, 30, 40, 50};
  for (int64_t keep = 1; keep <= 5; ++keep) {
    InferenceState a = model->new_state(32), b = model->new_state(32);
    ForwardResult ra, rb;
    model->forward(a, prompt, LogitRows::kLast, ra);
    model->forward(b, prompt, LogitRows::kLast, rb);
    model->forward(a, window, LogitRows::kAll, ra, /*record_window=*/true);
    model->rollback(a, keep);
    model->forward(b, std::span<const int32_t>(window.data(), static_cast<size_t>(keep)), LogitRows::kAll,
                   rb);
    ASSERT_EQ(a.position(), b.position());
    const int32_t next = 77;
    model->forward(a, std::span<const int32_t>(&next, 1), LogitRows::kLast, ra);
    model->forward(b, std::span<const int32_t>(&next, 1), LogitRows::kLast, rb);
    ASSERT_EQ(0, std::memcmp(ra.logits.data(), rb.logits.data(), ra.logits.size() * sizeof(float)))
        << "keep " << keep;
  }
  // The window's first token is always kept (a verify window starts with the last emitted token).
  InferenceState a = model->new_state(32);
  ForwardResult ra;
  model->forward(a, window, LogitRows::kAll, ra, /*record_window=*/true);
  EXPECT_THROW(model->rollback(a, 0), Error);
}

struct LosslessCase {
  std::filesystem::path model;
  std::vector<int32_t> prompt;
};

// Proposes the plain run's own next tokens, corrupting some, so that accept, reject and bonus paths run.
std::function<void(std::span<const int32_t>, std::vector<int32_t>&)> oracle(const std::vector<int32_t>& truth,
                                                                            size_t prompt_len,
                                                                            uint64_t seed) {
  auto rng = std::make_shared<std::mt19937_64>(seed);
  return [truth, prompt_len, rng](std::span<const int32_t> context, std::vector<int32_t>& drafts) {
    for (size_t i = 0; i < drafts.size(); ++i) {
      const size_t index = context.size() - prompt_len + i;
      if (index < truth.size() && (*rng)() % 10 < 7) drafts[i] = truth[index];
    }
  };
}

TEST(SpeculativeGreedy, IdenticalToPlainDecodingForAllDraftDepths) {
  const std::vector<std::filesystem::path> models = {
      kFixtures / "wrapper_sharded_tied_bf16", kDefaultModel, kFixtures / "causal_mtp_untied_f32",
      kFixtures / "moe_wrapper_fused_bf16", kFixtures / "moe_causal_mtp_f32"};
  for (const auto& path : models) {
    auto model = Model::load(path);
    ASSERT_NE(model->mtp(), nullptr) << path;
    std::mt19937 rng(7);
    for (int64_t prompt_len : {1, 5, 11, 40}) {
      std::vector<int32_t> prompt;
      for (int64_t i = 0; i < prompt_len; ++i)
        prompt.push_back(static_cast<int32_t>(
            rng() % static_cast<uint32_t>(std::min<int64_t>(200, model->config().vocab_size - 3))));
      for (int64_t max_tokens : {1, 2, 7, 24}) {
        GenerateOptions plain;
        plain.max_tokens = max_tokens;
        plain.sampler.temperature = 0.0;
        const GenerateResult want = generate(*model, prompt, plain);
        for (int64_t k = 1; k <= 4; ++k) {
          for (bool with_oracle : {false, true}) {
            GenerateOptions spec = plain;
            spec.draft = k;
            if (with_oracle) spec.draft_hook = oracle(want.tokens, prompt.size(), static_cast<uint64_t>(k));
            const GenerateResult got = generate(*model, prompt, spec);
            ASSERT_EQ(got.tokens, want.tokens) << path << " prompt " << prompt_len << " max " << max_tokens
                                               << " K=" << k << " oracle " << with_oracle;
            EXPECT_EQ(got.finish_reason, want.finish_reason);
            if (with_oracle && max_tokens > 7) {
              EXPECT_GT(got.stats.mtp.accepted, 0);
            }
          }
        }
      }
      // A stop token in the middle of an accepted run ends both the same way.
      GenerateOptions plain;
      plain.max_tokens = 24;
      plain.sampler.temperature = 0.0;
      const GenerateResult free_run = generate(*model, prompt, plain);
      plain.stop_ids = {free_run.tokens[5]};
      const GenerateResult want = generate(*model, prompt, plain);
      ASSERT_EQ(want.finish_reason, "stop");
      for (int64_t k = 1; k <= 4; ++k) {
        GenerateOptions spec = plain;
        spec.draft = k;
        spec.draft_hook = oracle(free_run.tokens, prompt.size(), 99);
        const GenerateResult got = generate(*model, prompt, spec);
        EXPECT_EQ(got.tokens, want.tokens) << "stop, K=" << k;
        EXPECT_EQ(got.finish_reason, "stop");
      }
    }
  }
}

// The joint distribution of the first two generated tokens, and the distribution of the fourth (which
// depends on rollback after rejections), under MTP equal plain sampling, for several sampler settings,
// with the head's own drafts, with oracle drafts (accept paths) and with drafts from a draft vocabulary.
void expect_early_tokens_have_the_plain_distribution(const std::filesystem::path& path,
                                                     const std::vector<SamplerParams>& settings) {
  auto model = Model::load(path);
  const std::vector<int32_t> prompt = {11, 22, 33};
#ifdef MTPX_SANITIZED
  // Under AddressSanitizer (scripts/test_sanitized.sh) each run is ~10x slower; the sanitizer run is there
  // for memory errors along these paths, and 600 runs per sample still test the distributions (with less
  // power) where the plain build's 2500 would take three minutes.
  const int runs = 600;
#else
  const int runs = 2500;
#endif
  for (const SamplerParams& sampler : settings) {
    // The plain sample (seeds 0..runs-1), compared with each variant's MTP sample.
    std::map<std::string, int> plain_counts, plain_fourth;
    for (int i = 0; i < runs; ++i) {
      GenerateOptions o;
      o.max_tokens = 4;
      o.sampler = sampler;
      o.seed = static_cast<uint64_t>(i);
      auto a = generate(*model, prompt, o);
      plain_counts[std::to_string(a.tokens[0]) + "," + std::to_string(a.tokens[1])]++;
      plain_fourth[std::to_string(a.tokens[3])]++;
    }
    // Variants: the head's drafts; oracle drafts; the head's drafts from a draft vocabulary of the first
    // 64 ids (tokens it cannot propose come through the residual).
    for (int variant = 0; variant < 3; ++variant) {
      std::map<std::string, int> spec_counts, spec_fourth;
      for (int i = 0; i < runs; ++i) {
        GenerateOptions o;
        o.max_tokens = 4;
        o.sampler = sampler;
        o.seed = static_cast<uint64_t>(i) + 1000000;  // independent of the plain sample
        o.draft = 2;
        if (variant == 2) o.draft_vocab = 64;
        if (variant == 1) {
          // Propose the plain run's continuation of another seed: often right, sometimes wrong.
          GenerateOptions other = o;
          other.draft = 0;
          other.seed = static_cast<uint64_t>(i) + 2000000;
          o.draft_hook =
              oracle(generate(*model, prompt, other).tokens, prompt.size(), static_cast<uint64_t>(i));
        }
        auto b = generate(*model, prompt, o);
        spec_counts[std::to_string(b.tokens[0]) + "," + std::to_string(b.tokens[1])]++;
        spec_fourth[std::to_string(b.tokens[3])]++;
      }
      auto [chi2, critical] = chi_square_two_sample(plain_counts, spec_counts);
      EXPECT_LT(chi2, critical) << "tokens 1-2, temperature " << sampler.temperature << " top_k "
                                << sampler.top_k << " variant " << variant;
      auto [chi2_fourth, critical_fourth] = chi_square_two_sample(plain_fourth, spec_fourth);
      EXPECT_LT(chi2_fourth, critical_fourth)
          << "token 4, temperature " << sampler.temperature << " variant " << variant;
    }
  }
}

TEST(SpeculativeSampling, EarlyTokensHaveThePlainDistribution) {
  expect_early_tokens_have_the_plain_distribution(kFixtures / "wrapper_sharded_tied_bf16",
                                                  {{.temperature = 1.0},
                                                   {.temperature = 0.7, .top_k = 20, .top_p = 0.95},
                                                   {.temperature = 1.3, .min_p = 0.05}});
}

// The same on a mixture-of-experts model (its head's layer is a MoE block too), where a verify window's
// rows route to different experts.
TEST(SpeculativeSampling, EarlyTokensHaveThePlainDistributionOnAMixtureOfExperts) {
  expect_early_tokens_have_the_plain_distribution(
      kFixtures / "moe_wrapper_fused_bf16",
      {{.temperature = 1.0}, {.temperature = 0.8, .top_k = 40, .top_p = 0.9}});
}

// A draft vocabulary (drafts only from ids below N) changes which tokens are proposed, never the output:
// greedy MTP equals plain decoding at any N, and no draft is an id >= N.
TEST(SpeculativeGreedy, DraftVocabularyKeepsTheOutputAndBoundsTheDrafts) {
  for (const auto& path : {kFixtures / "wrapper_sharded_tied_bf16", kDefaultModel}) {
    auto model = Model::load(path);
    const int64_t V = model->config().vocab_size;
    std::mt19937 rng(3);
    for (int64_t prompt_len : {5, 40}) {
      std::vector<int32_t> prompt;
      for (int64_t i = 0; i < prompt_len; ++i)
        prompt.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(std::min<int64_t>(200, V - 3))));
      GenerateOptions plain;
      plain.max_tokens = 24;
      plain.sampler.temperature = 0.0;
      const GenerateResult want = generate(*model, prompt, plain);
      for (int64_t draft_vocab : {int64_t{1}, V / 8, V}) {
        for (int64_t k : {1, 3}) {
          GenerateOptions spec = plain;
          spec.draft = k;
          spec.draft_vocab = draft_vocab;
          int32_t largest_draft = -1;
          spec.draft_hook = [&](std::span<const int32_t>, std::vector<int32_t>& drafts) {
            for (int32_t d : drafts) largest_draft = std::max(largest_draft, d);
          };
          const GenerateResult got = generate(*model, prompt, spec);
          ASSERT_EQ(got.tokens, want.tokens) << path << " draft vocab " << draft_vocab << " K=" << k;
          EXPECT_LT(largest_draft, draft_vocab) << path;
          EXPECT_GE(largest_draft, 0) << path;
        }
      }
    }
  }
}

TEST(Speculative, RejectsBadDraftDepthAndHeadlessModels) {
  auto model = Model::load(kFixtures / "wrapper_sharded_tied_bf16");
  GenerateOptions o;
  o.max_tokens = 3;
  o.draft = 9;
  EXPECT_THROW(generate(*model, std::vector<int32_t>{1, 2}, o), Error);
  auto headless = Model::load(kFixtures / "causal_untied_single_bf16");
  EXPECT_EQ(headless->mtp(), nullptr);
  o.draft = 1;
  EXPECT_THROW(generate(*headless, std::vector<int32_t>{1, 2}, o), Error);
}

}  // namespace
}  // namespace mtpx
