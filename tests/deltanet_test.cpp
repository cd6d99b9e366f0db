#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"
#include "model/attention.h"
#include "model/gated_deltanet.h"

namespace mtpx {
namespace {

struct Inputs {
  std::vector<float> q, k, v, g, beta;
};

Inputs random_inputs(int64_t T, int64_t dk, int64_t dv, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  Inputs in;
  in.q.resize(static_cast<size_t>(T * dk));
  in.k.resize(in.q.size());
  in.v.resize(static_cast<size_t>(T * dv));
  for (float& x : in.q) x = n(rng);
  for (float& x : in.k) x = n(rng);
  for (float& x : in.v) x = n(rng);
  for (int64_t t = 0; t < T; ++t) {
    cpu::l2_normalize(&in.q[static_cast<size_t>(t * dk)], 1e-6f, dk);
    cpu::l2_normalize(&in.k[static_cast<size_t>(t * dk)], 1e-6f, dk);
    in.g.push_back(-2.0f * u(rng));  // log-decay <= 0
    in.beta.push_back(u(rng));
  }
  return in;
}

// The chunked form (prefill) computes the same outputs and final state as the token recurrence.
TEST(DeltaRule, ChunkedEqualsRecurrent) {
  const int64_t dk = 16, dv = 24;
  for (int64_t T : {1, 5, 63, 64, 65, 150}) {
    Inputs in = random_inputs(T, dk, dv, static_cast<uint64_t>(T));
    std::vector<float> s_rec(static_cast<size_t>(dk * dv)), s_chk(s_rec.size());
    std::mt19937_64 rng(99);
    std::normal_distribution<float> n(0.0f, 0.5f);
    for (size_t i = 0; i < s_rec.size(); ++i) s_rec[i] = s_chk[i] = n(rng);  // a non-zero incoming state
    std::vector<float> o_rec(static_cast<size_t>(T * dv)), o_chk(o_rec.size());
    delta_rule_recurrent(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, dk, dv,
                         s_rec.data(), o_rec.data(), dk, dv, dv);
    delta_rule_chunked(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, dk, dv,
                       s_chk.data(), o_chk.data(), dk, dv, dv);
    for (size_t i = 0; i < o_rec.size(); ++i)
      ASSERT_NEAR(o_chk[i], o_rec[i], 2e-5 + 2e-5 * std::abs(o_rec[i])) << "T=" << T << " i=" << i;
    for (size_t i = 0; i < s_rec.size(); ++i)
      ASSERT_NEAR(s_chk[i], s_rec[i], 2e-5 + 2e-5 * std::abs(s_rec[i])) << "T=" << T << " state " << i;
  }
}

// The decode-attention kernels against a double-precision sum, on sizes with every kind of tail (keys
// not a multiple of 4, dims past the 64-wide blocks and past the 8-lane vectors), and each output the same
// bits whatever the number of keys in the call.
TEST(AttentionKernels, MatchDoubleSumsAndDoNotDependOnTheKeyCount) {
  const int64_t n = 11, d = 90, stride = 100;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(d), rows(n * stride), weights(n);
  for (float& x : q) x = normal(rng);
  for (float& x : rows) x = normal(rng);
  for (float& x : weights) x = normal(rng);
  std::vector<float> scores(n), out(d);
  cpu::dot_rows(q.data(), rows.data(), stride, n, d, 0.5f, scores.data());
  cpu::weighted_row_sum(weights.data(), rows.data(), stride, n, d, out.data());
  for (int64_t j = 0; j < n; ++j) {
    double s = 0;
    for (int64_t i = 0; i < d; ++i) s += static_cast<double>(q[i]) * rows[j * stride + i];
    EXPECT_NEAR(scores[j], 0.5 * s, 1e-5 * (1 + std::abs(s))) << "key " << j;
  }
  for (int64_t i = 0; i < d; ++i) {
    double s = 0;
    for (int64_t j = 0; j < n; ++j) s += static_cast<double>(weights[j]) * rows[j * stride + i];
    EXPECT_NEAR(out[i], s, 1e-5 * (1 + std::abs(s))) << "dim " << i;
  }
  for (int64_t m : {1, 3, 4, 7}) {
    std::vector<float> part(m);
    cpu::dot_rows(q.data(), rows.data(), stride, m, d, 0.5f, part.data());
    for (int64_t j = 0; j < m; ++j) EXPECT_EQ(part[j], scores[j]) << m << " keys, key " << j;
  }
}

// One recurrent step from the state left by a window equals the window's next row: the recurrence has
// no dependence on how tokens are grouped (what lets a verify window replace decode steps exactly).
TEST(DeltaRule, RecurrentIsIndependentOfGrouping) {
  const int64_t dk = 8, dv = 8, T = 9;
  Inputs in = random_inputs(T, dk, dv, 5);
  std::vector<float> s_all(static_cast<size_t>(dk * dv)), s_step(s_all.size());
  std::vector<float> o_all(static_cast<size_t>(T * dv)), o_step(o_all.size());
  delta_rule_recurrent(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), T, dk, dv,
                       s_all.data(), o_all.data(), dk, dv, dv);
  for (int64_t t = 0; t < T; ++t)
    delta_rule_recurrent(&in.q[static_cast<size_t>(t * dk)], &in.k[static_cast<size_t>(t * dk)],
                         &in.v[static_cast<size_t>(t * dv)], &in.g[static_cast<size_t>(t)],
                         &in.beta[static_cast<size_t>(t)], 1, dk, dv, s_step.data(),
                         &o_step[static_cast<size_t>(t * dv)], dk, dv, dv);
  EXPECT_EQ(o_all, o_step);
  EXPECT_EQ(s_all, s_step);
}

TEST(Rope, RotatesPairsHalfARotaryDimApartAndLeavesTheRest) {
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};  // D = 8, rotary_dim = 4: pairs (0,2), (1,3)
  apply_partial_rope(x.data(), 4, 10000.0, 3);
  const double a0 = 3.0, a1 = 3.0 / 100.0;  // pos * theta^(-2i/4), i = 0, 1
  EXPECT_NEAR(x[0], 1 * std::cos(a0) - 3 * std::sin(a0), 1e-6);
  EXPECT_NEAR(x[2], 3 * std::cos(a0) + 1 * std::sin(a0), 1e-6);
  EXPECT_NEAR(x[1], 2 * std::cos(a1) - 4 * std::sin(a1), 1e-6);
  EXPECT_NEAR(x[3], 4 * std::cos(a1) + 2 * std::sin(a1), 1e-6);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(x[static_cast<size_t>(i)], static_cast<float>(i + 1));
}

}  // namespace
}  // namespace mtpx
