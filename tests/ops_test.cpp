// The CPU's elementwise activations and the delta-rule step against plain double-precision references.
#include "backend/cpu/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace mtpx::cpu {
namespace {

double silu_ref(double x) { return x / (1.0 + std::exp(-x)); }
double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Inputs over the range activations see, the saturated ends and the exact edges of the clamp.
std::vector<float> activation_inputs() {
  std::vector<float> xs = {0.0f,  -0.0f,  1e-30f, -1e-30f, 1e-7f, 0.5f,   -0.5f, 20.0f, -20.0f, 86.9f, -86.9f,
                           87.0f, -87.0f, 88.0f,  -88.0f,  90.0f, -90.0f, 1e4f,  -1e4f, 3e38f,  -3e38f};
  std::mt19937 rng(11);
  std::normal_distribution<float> wide(0.0f, 6.0f);
  for (int i = 0; i < 3000; ++i) xs.push_back(wide(rng));
  return xs;
}

TEST(Activations, MatchDoubleReference) {
  const std::vector<float> a = activation_inputs();
  std::vector<float> b(a.size());
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : b) v = normal(rng);
  const auto n = static_cast<int64_t>(a.size());
  std::vector<float> swiglu_out(a.size()), silu_out = a, gated = b;
  swiglu(a.data(), b.data(), n, swiglu_out.data());
  silu_in_place(silu_out.data(), n);
  mul_sigmoid(a.data(), n, gated.data());
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i];
    // The polynomial e^x is within ~1e-7 relative; the clamp at [-87, 88] changes sigmoid(x) only where it
    // is below e^-87 (absolute 1e-38).
    const double silu = silu_ref(x), sig = sigmoid_ref(x);
    EXPECT_NEAR(silu_out[i], silu, 1e-6 * std::abs(silu) + 1e-37) << "silu(" << x << ")";
    EXPECT_NEAR(swiglu_out[i], silu * b[i], 1e-6 * std::abs(silu * b[i]) + 1e-37) << "swiglu(" << x << ")";
    EXPECT_NEAR(gated[i], b[i] * sig, 1e-6 * std::abs(b[i] * sig) + 1e-37) << "sigmoid(" << x << ")";
  }
}

TEST(Activations, ExpShiftedMatchesDoubleReference) {
  std::vector<float> x = activation_inputs();
  for (float shift : {0.0f, 3.5f, -20.0f}) {
    std::vector<float> y = x;
    exp_shifted_in_place(y.data(), static_cast<int64_t>(y.size()), shift);
    for (size_t i = 0; i < x.size(); ++i) {
      const double arg = static_cast<double>(x[i] - shift);  // the float difference, as the kernel forms it
      if (arg > 88.0) {
        EXPECT_TRUE(std::isinf(y[i])) << x[i] << " - " << shift;
      } else if (arg >= -87.0) {
        EXPECT_NEAR(y[i], std::exp(arg), 1e-6 * std::exp(arg)) << x[i] << " - " << shift;
      } else {  // clamped: e^-87 (1.6e-38) where the true value is smaller still
        EXPECT_LE(y[i], 1.7e-38f) << x[i] << " - " << shift;
      }
    }
  }
}

TEST(Activations, NanPropagates) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : {1, 8, 9}) {  // the scalar form, a whole vector, a vector and a tail
    std::vector<float> a(static_cast<size_t>(n), nan), b(static_cast<size_t>(n), 1.0f), out(a.size());
    swiglu(a.data(), b.data(), n, out.data());
    for (float v : out) EXPECT_TRUE(std::isnan(v));
    mul_sigmoid(a.data(), n, b.data());
    for (float v : b) EXPECT_TRUE(std::isnan(v));
  }
}

// An element's result does not depend on where it falls (vector lane or scalar tail) or on n.
TEST(Activations, SameBitsWhateverTheLength) {
  const std::vector<float> a = activation_inputs();
  const auto total = static_cast<int64_t>(a.size());
  std::vector<float> whole = a;
  silu_in_place(whole.data(), total);
  for (int64_t start : {0, 3, 7})
    for (int64_t n : {1, 5, 8, 13, 31}) {
      std::vector<float> part(a.begin() + start, a.begin() + start + n);
      silu_in_place(part.data(), n);
      EXPECT_EQ(0, std::memcmp(part.data(), &whole[static_cast<size_t>(start)], part.size() * sizeof(float)))
          << "start " << start << " n " << n;
    }
}

// One token of the gated delta rule (spec §4.2) in double precision.
void delta_rule_ref(std::vector<double>& S, const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, double decay, double beta, int64_t dk, int64_t dv,
                    std::vector<double>& o) {
  std::vector<double> kv(static_cast<size_t>(dv), 0.0);
  for (auto& s : S) s *= decay;
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) kv[j] += k[i] * S[i * dv + j];
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) S[i * dv + j] += k[i] * (v[j] - kv[j]) * beta;
  o.assign(static_cast<size_t>(dv), 0.0);
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) o[j] += q[i] * S[i * dv + j];
}

TEST(DeltaRuleStep, MatchesDoubleReferenceOverTokens) {
  for (auto [dk, dv] : {std::pair<int64_t, int64_t>{64, 64}, {16, 48}, {5, 7}, {128, 128}}) {
    std::mt19937 rng(static_cast<unsigned>(dk * 131 + dv));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> unit(0.05f, 0.99f);
    std::vector<float> S(static_cast<size_t>(dk * dv), 0.0f), o(static_cast<size_t>(dv)),
        scratch(static_cast<size_t>(2 * dv));
    std::vector<double> S_ref(S.size(), 0.0), o_ref;
    for (int token = 0; token < 6; ++token) {
      std::vector<float> q(static_cast<size_t>(dk)), k(static_cast<size_t>(dk)), v(static_cast<size_t>(dv));
      for (float& x : q) x = normal(rng) * 0.2f;
      for (float& x : k) x = normal(rng) * 0.2f;
      for (float& x : v) x = normal(rng);
      const float decay = unit(rng), beta = unit(rng);
      // In place on even tokens, out of place (to a copy, then back) on odd ones: the same bits either way.
      if (token % 2 == 0) {
        delta_rule_step(S.data(), S.data(), q.data(), k.data(), v.data(), decay, beta, dk, dv, o.data(),
                        scratch.data());
      } else {
        std::vector<float> before = S, after(S.size(), NAN), in_place = S, o_in_place(o.size());
        delta_rule_step(before.data(), after.data(), q.data(), k.data(), v.data(), decay, beta, dk, dv,
                        o.data(), scratch.data());
        delta_rule_step(in_place.data(), in_place.data(), q.data(), k.data(), v.data(), decay, beta, dk, dv,
                        o_in_place.data(), scratch.data());
        ASSERT_EQ(0, std::memcmp(after.data(), in_place.data(), S.size() * sizeof(float)));
        ASSERT_EQ(0, std::memcmp(o.data(), o_in_place.data(), o.size() * sizeof(float)));
        ASSERT_EQ(0,
                  std::memcmp(before.data(), S.data(), S.size() * sizeof(float)));  // the input is untouched
        S = after;
      }
      delta_rule_ref(S_ref, q, k, v, decay, beta, dk, dv, o_ref);
      for (size_t j = 0; j < o.size(); ++j)
        ASSERT_NEAR(o[j], o_ref[j], 1e-4) << dk << "x" << dv << " t" << token;
      for (size_t j = 0; j < S.size(); ++j)
        ASSERT_NEAR(S[j], S_ref[j], 1e-4) << dk << "x" << dv << " t" << token;
    }
  }
}

// Columns of the state are independent, so the first 64 columns of a state 80 wide (the plain loops) must
// equal, bit for bit, a state 64 wide (the 512-bit kernel where the CPU has it): the step's bits do not
// depend on which version runs.
TEST(DeltaRuleStep, SameBitsWhateverTheWidth) {
  const int64_t dk = 32, narrow = 64, wide = 80;
  std::mt19937 rng(77);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<float> S_narrow(static_cast<size_t>(dk * narrow)), S_wide(static_cast<size_t>(dk * wide));
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < wide; ++j) {
      const float value = normal(rng);
      S_wide[static_cast<size_t>(i * wide + j)] = value;
      if (j < narrow) S_narrow[static_cast<size_t>(i * narrow + j)] = value;
    }
  std::vector<float> q(dk), k(dk), v(wide), o_narrow(narrow), o_wide(wide), scratch(2 * wide);
  for (int token = 0; token < 4; ++token) {
    for (float& x : q) x = normal(rng);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    delta_rule_step(S_narrow.data(), S_narrow.data(), q.data(), k.data(), v.data(), 0.9f, 0.6f, dk, narrow,
                    o_narrow.data(), scratch.data());
    delta_rule_step(S_wide.data(), S_wide.data(), q.data(), k.data(), v.data(), 0.9f, 0.6f, dk, wide,
                    o_wide.data(), scratch.data());
    ASSERT_EQ(0, std::memcmp(o_narrow.data(), o_wide.data(), narrow * sizeof(float))) << "token " << token;
    for (int64_t i = 0; i < dk; ++i)
      ASSERT_EQ(0, std::memcmp(&S_narrow[static_cast<size_t>(i * narrow)],
                               &S_wide[static_cast<size_t>(i * wide)], narrow * sizeof(float)))
          << "token " << token << " row " << i;
  }
}

// The vector argmax gives argmax's index: ties (the first wins), +0 and -0, the maximum in the tail or in the
// first lane, every length, and NaN anywhere.
// Every length around the vector blocks, a NaN, +Inf or -Inf at every position is found; the largest
// finite values, denormals and -0 are finite.
TEST(AllFinite, FindsNanAndInfAtEveryPositionAndAcceptsExtremeFiniteValues) {
  const float finite[] = {0.0f,
                          -0.0f,
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(),
                          1.0f,
                          -3.5f};
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  for (int64_t n = 0; n <= 97; ++n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = finite[i % 7];
    ASSERT_TRUE(all_finite(x.data(), n)) << n;
    for (int64_t i = 0; i < n; ++i)
      for (float b : bad) {
        const float keep = x[static_cast<size_t>(i)];
        x[static_cast<size_t>(i)] = b;
        ASSERT_FALSE(all_finite(x.data(), n)) << "length " << n << " position " << i << " value " << b;
        x[static_cast<size_t>(i)] = keep;
      }
  }
}

TEST(ArgmaxRowsKernel, SameIndexAsTheLoop) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> coarse(-6, 6);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n = 1; n <= 70; ++n)
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& v : x) v = static_cast<float>(coarse(rng)) * 0.5f;  // many ties
      if (trial % 5 == 1) x[static_cast<size_t>(trial % n)] = -0.0f;
      if (trial % 7 == 2) x[static_cast<size_t>((trial * 13) % n)] = nan;
      if (trial % 11 == 3) x[static_cast<size_t>(n - 1)] = 100.0f;
      ASSERT_EQ(argmax_rows_kernel(x.data(), n), argmax(x.data(), n)) << "n " << n << " trial " << trial;
    }
  std::vector<float> zeros = {-0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f};
  EXPECT_EQ(argmax_rows_kernel(zeros.data(), 9), argmax(zeros.data(), 9));
}

// Several queries over one KV cache head (the query heads of a KV head in every row of a verify window):
// each output bit-identical to the single-query kernels over that query's own prefix, for head dims on and
// off whole vectors, prefixes of different lengths (the causal window) and a stride wider than the rows.
TEST(AttentionMultiQuery, EachQueryIsBitIdenticalToItsOwnCall) {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t d : {64, 256, 20, 8}) {
    const int64_t stride = 2 * d + 8, rows_n = 300;
    std::vector<float> rows(static_cast<size_t>(rows_n * stride));
    for (float& x : rows) x = normal(rng);
    for (int64_t count : {1, 2, 8}) {
      std::vector<std::vector<float>> qs(static_cast<size_t>(count)), scores(qs.size()), weights(qs.size()),
          outs(qs.size());
      std::vector<int64_t> n(qs.size());
      std::vector<const float*> q_ptr, w_ptr;
      std::vector<float*> s_ptr, o_ptr;
      for (size_t i = 0; i < qs.size(); ++i) {
        n[i] = rows_n - 3 * static_cast<int64_t>(i) - (d == 20 ? 1 : 0);
        qs[i].resize(static_cast<size_t>(d));
        for (float& x : qs[i]) x = normal(rng);
        scores[i].assign(static_cast<size_t>(rows_n), NAN);
        weights[i].resize(static_cast<size_t>(rows_n));
        for (float& x : weights[i]) x = std::abs(normal(rng));
        outs[i].assign(static_cast<size_t>(d), NAN);
        q_ptr.push_back(qs[i].data());
        s_ptr.push_back(scores[i].data());
        w_ptr.push_back(weights[i].data());
        o_ptr.push_back(outs[i].data());
      }
      dot_rows_multi(q_ptr, n, rows.data(), stride, d, 0.125f, s_ptr);
      weighted_row_sum_multi(w_ptr, n, rows.data(), stride, d, o_ptr);
      for (size_t i = 0; i < qs.size(); ++i) {
        std::vector<float> alone(static_cast<size_t>(n[i])), sum(static_cast<size_t>(d));
        dot_rows(qs[i].data(), rows.data(), stride, n[i], d, 0.125f, alone.data());
        weighted_row_sum(weights[i].data(), rows.data(), stride, n[i], d, sum.data());
        ASSERT_EQ(0, std::memcmp(alone.data(), scores[i].data(), alone.size() * sizeof(float)))
            << "d " << d << " queries " << count << " query " << i;
        ASSERT_EQ(0, std::memcmp(sum.data(), outs[i].data(), sum.size() * sizeof(float)))
            << "d " << d << " queries " << count << " query " << i;
        if (n[i] < rows_n) {  // untouched past its prefix
          EXPECT_TRUE(std::isnan(scores[i][static_cast<size_t>(n[i])]));
        }
      }
    }
  }
}

}  // namespace
}  // namespace mtpx::cpu
