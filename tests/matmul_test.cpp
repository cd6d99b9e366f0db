#include "backend/cpu/matmul.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "util/bf16.h"

namespace mtpx::cpu {
namespace {

struct Matrix {
  std::vector<uint16_t> half;        // bf16 or f16 storage
  std::vector<float> full;           // f32 storage
  std::unique_ptr<TileArena> tiles;  // bf16 on an AMX CPU: the tiles the AMX kernels read, as a model has
  WeightMatrix view;
};

Matrix make_matrix(WeightType type, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Matrix m;
  const size_t n = static_cast<size_t>(rows * cols);
  if (type == WeightType::kF32) {
    m.full.resize(n);
    for (float& x : m.full) x = dist(rng);
    m.view = {type, m.full.data(), rows, cols};
  } else {
    m.half.resize(n);
    for (uint16_t& x : m.half) x = type == WeightType::kBF16 ? f32_to_bf16(dist(rng)) : f32_to_f16(dist(rng));
    m.view = {type, m.half.data(), rows, cols};
  }
  if (matmul_kernel_supported(MatmulKernel::kAmx) && amx_tile_words(m.view) > 0) {
    m.tiles = std::make_unique<TileArena>(amx_tile_words(m.view));
    pack_amx_tiles(m.view, m.tiles->data());
    m.view.amx_tiles = m.tiles->data();
  }
  return m;
}

std::vector<float> random_vector(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class MatmulTest : public ::testing::TestWithParam<WeightType> {};

// Every kernel family this CPU runs (an AVX-512 machine also tests the AVX2 and scalar kernels).
std::vector<MatmulKernel> supported_kernels() {
  std::vector<MatmulKernel> kernels;
  for (MatmulKernel k :
       {MatmulKernel::kScalar, MatmulKernel::kAvx2, MatmulKernel::kAvx512, MatmulKernel::kAmx})
    if (matmul_kernel_supported(k)) kernels.push_back(k);
  return kernels;
}

const char* kernel_name(MatmulKernel k) {
  return k == MatmulKernel::kAmx      ? "amx"
         : k == MatmulKernel::kAvx512 ? "avx512"
         : k == MatmulKernel::kAvx2   ? "avx2"
                                      : "scalar";
}

// sum_k |x[m, k] W[o, k]| for every output: the scale of the AMX prefill's error bound.
std::vector<float> abs_products(const Matrix& w, const std::vector<float>& x, int64_t m) {
  const int64_t rows = w.view.rows, cols = w.view.cols;
  std::vector<float> abs_x(x.size()), abs_w(static_cast<size_t>(rows * cols)),
      out(static_cast<size_t>(m * rows));
  for (size_t i = 0; i < x.size(); ++i) abs_x[i] = std::abs(x[i]);
  for (int64_t o = 0; o < rows; ++o) weight_row_to_f32(w.view, o, &abs_w[static_cast<size_t>(o * cols)]);
  for (float& v : abs_w) v = std::abs(v);
  matmul_reference(WeightMatrix{WeightType::kF32, abs_w.data(), rows, cols}, abs_x.data(), m, out.data());
  return out;
}

// The float32 kernels' tolerance, plus, where the AMX prefill splits x into two bf16 terms (bf16 weights,
// M >= kGemmMinRows), its bound 2^-16 sum_k |x_k w_k| (matmul.cpp).
double tolerance(MatmulKernel kernel, WeightType type, int64_t m, int64_t cols, float ref, float abs_dot) {
  const bool split_x = kernel == MatmulKernel::kAmx && type == WeightType::kBF16 && m >= kGemmMinRows;
  return (split_x ? 0x1p-16 * abs_dot : 0.0) + 1e-5 * std::sqrt(static_cast<double>(cols)) +
         1e-6 * std::abs(ref);
}

TEST_P(MatmulTest, MatchesDoubleReference) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1},
                            {5, 7},
                            {13, 16},
                            {33, 100},
                            {64, 257},
                            {17, 1024},
                            {9, 1072},
                            {40, 320}}) {
    Matrix w = make_matrix(GetParam(), rows, cols, 1);
    for (int64_t m : {1, 3, 4, 5, 6, 11, 15, 37}) {
      auto x = random_vector(static_cast<size_t>(m * cols), 2);
      std::vector<float> y(static_cast<size_t>(m * rows)), ref(y.size());
      matmul_reference(w.view, x.data(), m, ref.data());
      const std::vector<float> abs_dot = abs_products(w, x, m);
      for (MatmulKernel kernel : supported_kernels()) {
        matmul(w.view, x.data(), m, y.data(), kernel);
        for (size_t i = 0; i < y.size(); ++i)
          ASSERT_NEAR(y[i], ref[i], tolerance(kernel, GetParam(), m, cols, ref[i], abs_dot[i]))
              << kernel_name(kernel) << " rows=" << rows << " cols=" << cols << " m=" << m << " i=" << i;
      }
    }
  }
}

// The prefill path (M >= kGemmMinRows: sgemm, or AMX tiles for bf16 weights): several 32-row
// activation blocks, output features in several groups, short last blocks in both dimensions, and
// thread counts that split the groups unevenly.
TEST_P(MatmulTest, PrefillMatchesDoubleReference) {
  const int saved_threads = omp_get_max_threads();
  for (auto [rows, cols] :
       {std::pair<int64_t, int64_t>{16, 64}, {80, 320}, {300, 1024}, {1100, 256}, {45, 96}}) {
    Matrix w = make_matrix(GetParam(), rows, cols, 5);
    for (int64_t m : {kGemmMinRows, int64_t{37}, int64_t{100}}) {
      auto x = random_vector(static_cast<size_t>(m * cols), 6);
      std::vector<float> ref(static_cast<size_t>(m * rows));
      matmul_reference(w.view, x.data(), m, ref.data());
      const std::vector<float> abs_dot = abs_products(w, x, m);
      for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        for (MatmulKernel kernel : supported_kernels()) {
          std::vector<float> y(ref.size(), NAN);
          matmul(w.view, x.data(), m, y.data(), kernel);
          for (size_t i = 0; i < y.size(); ++i)
            ASSERT_NEAR(y[i], ref[i], tolerance(kernel, GetParam(), m, cols, ref[i], abs_dot[i]))
                << kernel_name(kernel) << " rows=" << rows << " cols=" << cols << " m=" << m
                << " threads=" << threads << " i=" << i;
        }
      }
    }
  }
  omp_set_num_threads(saved_threads);
}

void check_batch_invariance(WeightType type, MatmulKernel kernel, int64_t rows, int64_t cols) {
  Matrix w = make_matrix(type, rows, cols, 3);
  const int64_t max_m = kGemmMinRows - 1;  // every small-M window (AMX: up to three A tiles)
  auto x = random_vector(static_cast<size_t>(max_m * cols), 4);
  std::vector<float> single(static_cast<size_t>(max_m * rows));
  for (int64_t r = 0; r < max_m; ++r)
    matmul(w.view, &x[static_cast<size_t>(r * cols)], 1, &single[static_cast<size_t>(r * rows)], kernel);
  const int saved_threads = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (int64_t start = 0; start < 3; ++start) {
      for (int64_t m = 1; start + m <= max_m; ++m) {
        std::vector<float> y(static_cast<size_t>(m * rows));
        matmul(w.view, &x[static_cast<size_t>(start * cols)], m, y.data(), kernel);
        ASSERT_EQ(0,
                  std::memcmp(y.data(), &single[static_cast<size_t>(start * rows)], y.size() * sizeof(float)))
            << kernel_name(kernel) << " cols=" << cols << " threads=" << threads << " start=" << start
            << " m=" << m;
      }
    }
  }
  omp_set_num_threads(saved_threads);
}

// The property greedy MTP relies on: a row's result is bit-identical whether it is computed alone or
// together with other rows (any M, any position inside the batch, any thread count).
TEST_P(MatmulTest, BatchInvariantBitwise) {
  // 300: whole blocks then a scalar tail; 304 = 9 x 32 + 16 = 4 x 64 + 48 and 1072 = 33 x 32 + 16 =
  // 16 x 64 + 48: a partial block of whole vectors on AVX2 and on AVX-512, in short rows (kernels of
  // several output rows) and long ones (one output row at a time). 320 = 10 x 32: AMX tiles (bf16; 75 rows =
  // 4 blocks of 16 and a short one; up to 15 activation rows = 3 A tiles).
  for (MatmulKernel kernel : supported_kernels())
    for (const int64_t cols : {300, 304, 1072, 320}) check_batch_invariance(GetParam(), kernel, 75, cols);
}

// matmul_shared_input: every product bit-identical to its own matmul() call, for decode and verify windows
// (one team over all the matrices) and prefill (separate calls), at several thread counts; matrices of
// 4 rows (the DeltaNet's b and a), partial chunks of 16 rows and a long one.
TEST_P(MatmulTest, SharedInputMatchesSeparateProducts) {
  const int64_t cols = 320;
  std::vector<Matrix> ws;
  for (int64_t rows : {75, 4, 4, 300, 16}) ws.push_back(make_matrix(GetParam(), rows, cols, 40 + rows));
  const int saved_threads = omp_get_max_threads();
  for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{5}, kGemmMinRows + 1}) {
    auto x = random_vector(static_cast<size_t>(m * cols), 41);
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      std::vector<std::vector<float>> shared, separate;
      std::vector<MatmulTarget> targets;
      for (const Matrix& w : ws) {
        shared.emplace_back(static_cast<size_t>(m * w.view.rows), NAN);
        separate.emplace_back(static_cast<size_t>(m * w.view.rows), NAN);
      }
      for (size_t i = 0; i < ws.size(); ++i) targets.push_back({&ws[i].view, shared[i].data()});
      matmul_shared_input(targets, x.data(), m);
      for (size_t i = 0; i < ws.size(); ++i) {
        matmul(ws[i].view, x.data(), m, separate[i].data());
        ASSERT_EQ(0, std::memcmp(shared[i].data(), separate[i].data(), shared[i].size() * sizeof(float)))
            << "matrix " << i << " m=" << m << " threads=" << threads;
      }
    }
  }
  omp_set_num_threads(saved_threads);
}

// Reading a prefix of the rows last changes which thread computes a row and when, never the row's value.
// (Against matmul with as many threads: m >= kGemmMinRows runs OpenBLAS, whose sgemm on some CPUs, AMD EPYC
// among them, rounds differently with a different thread count.)
TEST_P(MatmulTest, PrefixLastMatchesMatmul) {
  const int64_t rows = 300, cols = 320;
  const Matrix w = make_matrix(GetParam(), rows, cols, 50);
  const int saved_threads = omp_get_max_threads();
  for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{5}, kGemmMinRows + 1}) {
    auto x = random_vector(static_cast<size_t>(m * cols), 51);
    std::vector<float> one_thread;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      std::vector<float> expected(static_cast<size_t>(m * rows), NAN);
      matmul(w.view, x.data(), m, expected.data());
      if (threads == 1) one_thread = expected;
      if (m < kGemmMinRows) {  // the small-M kernels: each row's value independent of the thread count
        ASSERT_EQ(0, std::memcmp(one_thread.data(), expected.data(), expected.size() * sizeof(float)))
            << "m=" << m << " threads=" << threads;
      }
      for (int64_t prefix : {0, 1, 16, 17, 150, 299, 300, 400}) {
        std::vector<float> got(expected.size(), NAN);  // every output must be written
        matmul_prefix_last(w.view, x.data(), m, got.data(), prefix);
        ASSERT_EQ(0, std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)))
            << "m=" << m << " threads=" << threads << " prefix=" << prefix;
      }
    }
  }
  omp_set_num_threads(saved_threads);
}

INSTANTIATE_TEST_SUITE_P(AllTypes, MatmulTest,
                         ::testing::Values(WeightType::kF32, WeightType::kF16, WeightType::kBF16));

TEST(Bf16, RoundTripAndRounding) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-2.5f)), -2.5f);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0x1.0p-8f)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0x1.8p-8f)), 1.0f + 0x1.0p-7f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

}  // namespace
}  // namespace mtpx::cpu
