// Group-wise affine quantized weights (WeightType::kAffine): the kernels against the double reference,
// their batch invariance, the quantizer against MLX's own output (tests/fixtures/quant_goldens, made by
// scripts/make_quant_goldens.py) and the quantization error bound.
#include "backend/cpu/quant_matmul.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "util/bf16.h"
#include "util/error.h"

namespace mtpx::cpu {
namespace {

// A quantized matrix with its storage.
struct AffineMatrix {
  std::vector<float> dense;  // the float32 weights it was quantized from
  std::vector<uint32_t> packed;
  std::vector<float> scales_f32, biases_f32;
  std::vector<uint16_t> scales_16, biases_16;  // f16 / bf16 storage
  WeightMatrix view;
};

std::vector<float> normal_values(size_t n, uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

AffineMatrix make_affine(int64_t rows, int64_t cols, int bits, int64_t group_size, WeightType scale_type,
                         uint64_t seed) {
  AffineMatrix a;
  a.dense = normal_values(static_cast<size_t>(rows * cols), seed, 0.05f);
  const size_t groups = static_cast<size_t>(rows * (cols / group_size));
  a.packed.resize(static_cast<size_t>(rows * cols * bits / 32));
  a.scales_f32.resize(groups);
  a.biases_f32.resize(groups);
  quantize_affine(a.dense.data(), rows, cols, bits, group_size, a.packed.data(), a.scales_f32.data(),
                  a.biases_f32.data());
  a.view.type = WeightType::kAffine;
  a.view.data = a.packed.data();
  a.view.rows = rows;
  a.view.cols = cols;
  a.view.bits = bits;
  a.view.group_size = group_size;
  a.view.scale_type = scale_type;
  if (scale_type == WeightType::kF32) {
    a.view.scales = a.scales_f32.data();
    a.view.biases = a.biases_f32.data();
  } else {
    auto narrow = [&](float f) { return scale_type == WeightType::kBF16 ? f32_to_bf16(f) : f32_to_f16(f); };
    for (size_t i = 0; i < groups; ++i) {
      a.scales_16.push_back(narrow(a.scales_f32[i]));
      a.biases_16.push_back(narrow(a.biases_f32[i]));
    }
    a.view.scales = a.scales_16.data();
    a.view.biases = a.biases_16.data();
  }
  return a;
}

std::vector<AffineKernel> supported_affine_kernels() {
  std::vector<AffineKernel> kernels;
  for (AffineKernel k : {AffineKernel::kScalar, AffineKernel::kAvx2, AffineKernel::kAvx2Int8,
                         AffineKernel::kAvx512, AffineKernel::kAvx512Vnni})
    if (affine_kernel_supported(k)) kernels.push_back(k);
  return kernels;
}

const char* kernel_name(AffineKernel k) {
  return k == AffineKernel::kAvx512Vnni ? "avx512-vnni"
         : k == AffineKernel::kAvx512   ? "avx512"
         : k == AffineKernel::kAvx2Int8 ? "avx2-int8"
         : k == AffineKernel::kAvx2     ? "avx2"
                                        : "scalar";
}

// Whether kernel k runs w with int8 activations (quant_matmul.h: 4 bits, columns a multiple of 128).
bool int8_activations(AffineKernel k, const WeightMatrix& w) {
  return (k == AffineKernel::kAvx512Vnni || k == AffineKernel::kAvx2Int8) && w.bits == 4 && w.cols % 128 == 0;
}

// The bound quant_matmul.h gives for int8 activations, computed here from its definition: per run of 32
// values of a row s = max|x| / 127, each x moves by at most s / 2, and it enters the scale term only:
// sum_k |scale_g(k) * q_k| * s_k / 2.
std::vector<double> int8_activation_bound(const WeightMatrix& w, const std::vector<float>& x, int64_t m) {
  std::vector<double> bound(static_cast<size_t>(m * w.rows));
  const int64_t groups = w.cols / w.group_size;
  for (int64_t r = 0; r < m; ++r) {
    std::vector<double> half_step(static_cast<size_t>(w.cols));
    for (int64_t k0 = 0; k0 < w.cols; k0 += 32) {
      double peak = 0;
      for (int64_t k = k0; k < k0 + 32; ++k)
        peak = std::max(peak, std::abs(double{x[static_cast<size_t>(r * w.cols + k)]}));
      for (int64_t k = k0; k < k0 + 32; ++k) half_step[static_cast<size_t>(k)] = peak / 127.0 / 2.0;
    }
    for (int64_t o = 0; o < w.rows; ++o) {
      double b = 0;
      for (int64_t k = 0; k < w.cols; ++k) {
        const size_t g = static_cast<size_t>(o * groups + k / w.group_size);
        const double scale = w.scale_type == WeightType::kF32 ? static_cast<const float*>(w.scales)[g]
                             : w.scale_type == WeightType::kBF16
                                 ? bf16_to_f32(static_cast<const uint16_t*>(w.scales)[g])
                                 : f16_to_f32(static_cast<const uint16_t*>(w.scales)[g]);
        b += std::abs(scale * affine_code(w, o, k)) * half_step[static_cast<size_t>(k)];
      }
      bound[static_cast<size_t>(r * w.rows + o)] = b;
    }
  }
  return bound;
}

// sum_k |x[r, k] * w[o, k]| with the dequantized weights: the scale of y[r, o]'s rounding error.
std::vector<double> abs_product_sums(const WeightMatrix& w, const std::vector<float>& x, int64_t m) {
  std::vector<float> row(static_cast<size_t>(w.cols));
  std::vector<double> sums(static_cast<size_t>(m * w.rows));
  for (int64_t o = 0; o < w.rows; ++o) {
    weight_row_to_f32(w, o, row.data());
    for (int64_t r = 0; r < m; ++r) {
      double s = 0;
      for (int64_t k = 0; k < w.cols; ++k)
        s += std::abs(static_cast<double>(x[static_cast<size_t>(r * w.cols + k)]) *
                      row[static_cast<size_t>(k)]);
      sums[static_cast<size_t>(r * w.rows + o)] = s;
    }
  }
  return sums;
}

class QuantMatmulTest : public ::testing::TestWithParam<int> {};

// Every kernel family this CPU has, every group size, odd output counts, column counts that are odd
// multiples of the group, decode / verify-window / prefill row counts, all three scale dtypes.
TEST_P(QuantMatmulTest, MatchesDoubleReference) {
  const int bits = GetParam();
  const WeightType scale_types[] = {WeightType::kBF16, WeightType::kF16, WeightType::kF32};
  int variant = 0;
  for (int64_t group_size : {32, 64, 128}) {
    for (auto [rows, groups] : {std::pair<int64_t, int64_t>{1, 1}, {7, 3}, {37, 4}, {13, 9}}) {
      const int64_t cols = groups * group_size;
      const WeightType scale_type = scale_types[variant++ % 3];
      AffineMatrix a =
          make_affine(rows, cols, bits, group_size, scale_type, 100 + static_cast<uint64_t>(variant));
      std::vector<int64_t> row_counts;
      for (int64_t m = 1; m <= 17; ++m) row_counts.push_back(m);
      row_counts.push_back(40);
      for (int64_t m : row_counts) {
        const auto x = normal_values(static_cast<size_t>(m * cols), 7 + static_cast<uint64_t>(m));
        std::vector<float> ref(static_cast<size_t>(m * rows));
        matmul_reference(a.view, x.data(), m, ref.data());
        const auto tolerance = abs_product_sums(a.view, x, m);
        const auto int8_bound = int8_activation_bound(a.view, x, m);
        auto check = [&](const std::vector<float>& y, AffineKernel k, const char* what) {
          const bool int8 = int8_activations(k, a.view);
          for (size_t i = 0; i < y.size(); ++i)
            ASSERT_LE(std::abs(static_cast<double>(y[i]) - ref[i]),
                      1e-5 * tolerance[i] + (int8 ? int8_bound[i] : 0.0) + 1e-30)
                << what << " bits=" << bits << " group=" << group_size << " rows=" << rows << " cols=" << cols
                << " m=" << m << " i=" << i << " y=" << y[i] << " ref=" << ref[i];
        };
        std::vector<float> y(ref.size());
        matmul(a.view, x.data(), m, y.data());  // through matmul.h's dispatch
        check(y, affine_default_kernel(), "matmul");
        for (AffineKernel k : supported_affine_kernels()) {
          std::fill(y.begin(), y.end(), NAN);
          affine_matmul(a.view, x.data(), m, y.data(), k);
          check(y, k, kernel_name(k));
        }
      }
    }
  }
}

// The property greedy MTP relies on (see matmul.h): for M < kGemmMinRows a row's result is bit-identical
// whether it is computed alone or inside a window, at any position, with any thread count.
TEST_P(QuantMatmulTest, BatchInvariantBitwise) {
  const int bits = GetParam();
  const int64_t max_m = kGemmMinRows - 1 + 2;  // windows of 1..15 rows starting at rows 0..2
  for (int64_t group_size : {32, 64, 128}) {
    const int64_t rows = 75, cols = 3 * 128;
    AffineMatrix a = make_affine(rows, cols, bits, group_size, WeightType::kBF16, 11);
    const auto x = normal_values(static_cast<size_t>(max_m * cols), 12);
    for (AffineKernel k : supported_affine_kernels()) {
      std::vector<float> single(static_cast<size_t>(max_m * rows));
      for (int64_t r = 0; r < max_m; ++r)
        affine_matmul(a.view, &x[static_cast<size_t>(r * cols)], 1, &single[static_cast<size_t>(r * rows)],
                      k);
      const int saved_threads = omp_get_max_threads();
      for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        for (int64_t start = 0; start < 3; ++start)
          for (int64_t m = 1; m < kGemmMinRows && start + m <= max_m; ++m) {
            std::vector<float> y(static_cast<size_t>(m * rows));
            affine_matmul(a.view, &x[static_cast<size_t>(start * cols)], m, y.data(), k);
            ASSERT_EQ(0, std::memcmp(y.data(), &single[static_cast<size_t>(start * rows)],
                                     y.size() * sizeof(float)))
                << kernel_name(k) << " bits=" << bits << " group=" << group_size << " threads=" << threads
                << " start=" << start << " m=" << m;
          }
      }
      omp_set_num_threads(saved_threads);
    }
  }
}

// The int8 tiles' arithmetic apart from the activation rounding: activations that int8 holds exactly (whole
// numbers in [-127, 127], each run of 32 reaching +-127, so s = 1) give the float result, while general
// activations do move the result (the int8 path really runs) and stay within the bound.
TEST(QuantMatmul, Int8ActivationsAreExactOnIntegersAndBoundedOtherwise) {
  int families = 0;
  for (AffineKernel kernel : {AffineKernel::kAvx512Vnni, AffineKernel::kAvx2Int8}) {
    if (!affine_kernel_supported(kernel)) continue;
    ++families;
    for (int64_t group_size : {32, 64, 128}) {
      const int64_t rows = 45, cols = 640, m = 3;
      AffineMatrix a = make_affine(rows, cols, 4, group_size, WeightType::kBF16, 21);
      std::mt19937 rng(5);
      std::uniform_int_distribution<int> whole(-127, 127);
      std::vector<float> integers(static_cast<size_t>(m * cols));
      for (size_t i = 0; i < integers.size(); ++i)
        integers[i] = i % 32 == 7 ? (i % 64 == 7 ? 127.0f : -127.0f) : static_cast<float>(whole(rng));
      const auto general = normal_values(static_cast<size_t>(m * cols), 6);
      for (const std::vector<float>* x : {static_cast<const std::vector<float>*>(&integers), &general}) {
        std::vector<double> ref(static_cast<size_t>(m * rows));
        std::vector<float> ref_f(ref.size()), y(ref.size());
        matmul_reference(a.view, x->data(), m, ref_f.data());
        affine_matmul(a.view, x->data(), m, y.data(), kernel);
        const auto tolerance = abs_product_sums(a.view, *x, m);
        const auto bound = int8_activation_bound(a.view, *x, m);
        double worst_excess = 0;  // the largest error beyond the float kernels' tolerance
        for (size_t i = 0; i < y.size(); ++i) {
          const double err = std::abs(static_cast<double>(y[i]) - ref_f[i]);
          worst_excess = std::max(worst_excess, err / (1e-5 * tolerance[i]));
          ASSERT_LE(err, 1e-5 * tolerance[i] + (x == &general ? bound[i] : 0.0))
              << kernel_name(kernel) << " group=" << group_size << " i=" << i
              << (x == &general ? " general" : " integers");
        }
        if (x == &general) {
          EXPECT_GT(worst_excess, 10.0) << "the int8 path did not round the activations";
        }
      }
    }
  }
  if (families == 0) GTEST_SKIP() << "no AVX2 or AVX-512 VNNI here";
}

INSTANTIATE_TEST_SUITE_P(Bits, QuantMatmulTest, ::testing::Values(2, 3, 4, 5, 6, 8),
                         [](const ::testing::TestParamInfo<int>& bits) {
                           // (not "b" + to_string: GCC 12's -Wrestrict false positive in a unity build)
                           std::string name = "b";
                           name += std::to_string(bits.param);
                           return name;
                         });

// weight_row_to_f32 decodes code k of row o to fma(scale, q, bias), whatever the kernel family.
TEST(QuantMatmul, RowToF32DecodesEveryCode) {
  for (int bits : {2, 3, 4, 5, 6, 8})
    for (WeightType scale_type : {WeightType::kBF16, WeightType::kF16, WeightType::kF32}) {
      const int64_t rows = 5, cols = 256, group_size = 64, groups = cols / group_size;
      AffineMatrix a = make_affine(rows, cols, bits, group_size, scale_type, 21);
      std::vector<float> out(static_cast<size_t>(cols));
      for (int64_t o = 0; o < rows; ++o) {
        weight_row_to_f32(a.view, o, out.data());
        for (int64_t k = 0; k < cols; ++k) {
          const size_t g = static_cast<size_t>(o * groups + k / group_size);
          const float scale = scale_type == WeightType::kF32    ? a.scales_f32[g]
                              : scale_type == WeightType::kBF16 ? bf16_to_f32(a.scales_16[g])
                                                                : f16_to_f32(a.scales_16[g]);
          const float bias = scale_type == WeightType::kF32    ? a.biases_f32[g]
                             : scale_type == WeightType::kBF16 ? bf16_to_f32(a.biases_16[g])
                                                               : f16_to_f32(a.biases_16[g]);
          const float want = std::fma(scale, static_cast<float>(affine_code(a.view, o, k)), bias);
          ASSERT_EQ(out[static_cast<size_t>(k)], want) << "bits=" << bits << " row=" << o << " k=" << k;
        }
      }
    }
}

TEST(QuantMatmul, RejectsUnsupportedLayouts) {
  AffineMatrix a = make_affine(4, 128, 4, 64, WeightType::kBF16, 1);
  std::vector<float> x(128), y(4);
  WeightMatrix bad = a.view;
  bad.bits = 7;
  EXPECT_THROW(matmul(bad, x.data(), 1, y.data()), Error);
  bad = a.view;
  bad.group_size = 16;
  EXPECT_THROW(matmul(bad, x.data(), 1, y.data()), Error);
  bad = a.view;
  bad.cols = 96;  // not a whole number of groups of 64
  EXPECT_THROW(matmul(bad, x.data(), 1, y.data()), Error);
  std::vector<uint32_t> packed(64);
  std::vector<float> scales(8), biases(8);
  EXPECT_THROW(quantize_affine(x.data(), 1, 128, 1, 64, packed.data(), scales.data(), biases.data()), Error);
  EXPECT_THROW(quantize_affine(x.data(), 1, 100, 4, 32, packed.data(), scales.data(), biases.data()), Error);
}

// ---------------------------------------------------------------------------------------------
// The quantizer against mx.quantize (MLX 0.32.4, mode "affine").

const std::filesystem::path kGoldens =
    std::filesystem::path(MTPX_SOURCE_DIR) / "tests" / "fixtures" / "quant_goldens";

template <typename T>
std::vector<T> read_tensor(const SafetensorsFile& f, const std::string& name, std::vector<int64_t>* shape) {
  const TensorView* t = f.find(name);
  if (t == nullptr) throw std::runtime_error(f.path().string() + " lacks " + name);
  if (shape != nullptr) *shape = t->shape;
  std::vector<T> out(t->nbytes / sizeof(T));
  std::memcpy(out.data(), t->data, t->nbytes);
  return out;
}

// Codes, scales and biases identical bit for bit: the quantizer performs MLX's float32 operations in the
// same order (with round-half-to-even), so even rounding ties (row 7 of the input) come out the same.
TEST(QuantizeAffine, MatchesMlxGoldens) {
  SafetensorsFile input(kGoldens / "input.safetensors");
  std::vector<int64_t> shape;
  const auto w = read_tensor<float>(input, "w", &shape);
  ASSERT_EQ(shape.size(), 2u);
  const int64_t rows = shape[0], cols = shape[1];
  int cases = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kGoldens)) {
    if (entry.path().filename() == "input.safetensors" || entry.path().extension() != ".safetensors")
      continue;
    ++cases;
    SafetensorsFile golden(entry.path());
    std::vector<int64_t> packed_shape, scale_shape;
    const auto packed = read_tensor<uint32_t>(golden, "packed", &packed_shape);
    const auto scales = read_tensor<float>(golden, "scales", &scale_shape);
    const auto biases = read_tensor<float>(golden, "biases", nullptr);
    const int bits = static_cast<int>(packed_shape[1] * 32 / cols);
    const int64_t group_size = cols / scale_shape[1];
    const std::string name = entry.path().filename().string();
    ASSERT_EQ(name, "b" + std::to_string(bits) + "_g" + std::to_string(group_size) + ".safetensors");

    std::vector<uint32_t> got_packed(packed.size());
    std::vector<float> got_scales(scales.size()), got_biases(biases.size());
    quantize_affine(w.data(), rows, cols, bits, group_size, got_packed.data(), got_scales.data(),
                    got_biases.data());
    for (size_t i = 0; i < scales.size(); ++i) {
      EXPECT_EQ(std::bit_cast<uint32_t>(got_scales[i]), std::bit_cast<uint32_t>(scales[i]))
          << name << " scale " << i << ": " << got_scales[i] << " vs MLX " << scales[i];
      EXPECT_EQ(std::bit_cast<uint32_t>(got_biases[i]), std::bit_cast<uint32_t>(biases[i]))
          << name << " bias " << i << ": " << got_biases[i] << " vs MLX " << biases[i];
    }
    // Compare code by code (clearer failures than whole words); this also pins the packing order.
    WeightMatrix mine{WeightType::kAffine, got_packed.data(), rows, cols, bits, group_size, WeightType::kF32,
                      got_scales.data(),   got_biases.data()};
    WeightMatrix mlx = mine;
    mlx.data = packed.data();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k)
        ASSERT_EQ(affine_code(mine, r, k), affine_code(mlx, r, k)) << name << " row " << r << " code " << k;
    EXPECT_EQ(got_packed, packed) << name;
  }
  EXPECT_GE(cases, 7);
}

// |dequant(quantize(w)) - w| <= |scale| / 2 for every value the grid covers. The grid [bias, bias + n*scale]
// can stop short of the far end of the range by up to one step (scale is stretched so that the edge is
// exact, see quant_matmul.h); values there get the end code and an error of at most |scale|.
TEST(QuantizeAffine, DequantizedWithinHalfAStep) {
  for (int bits : {2, 3, 4, 5, 6, 8})
    for (int64_t group_size : {32, 64, 128}) {
      const int64_t rows = 6, cols = 512, groups = cols / group_size;
      auto w = normal_values(static_cast<size_t>(rows * cols), 31 + static_cast<uint64_t>(bits), 0.5f);
      for (int64_t k = 0; k < cols; ++k) {
        w[static_cast<size_t>(cols + k)] += 3.0f;                     // all positive
        w[static_cast<size_t>(2 * cols + k)] = 0.0f;                  // zeros: exact
        w[static_cast<size_t>(3 * cols + k)] = -0.75f;                // one value: exact
        w[static_cast<size_t>(4 * cols + k)] *= 1e-3f;                // small
        if (k % 7 == 0) w[static_cast<size_t>(5 * cols + k)] = 0.0f;  // exact zeros inside a range
      }
      AffineMatrix a;
      a.packed.resize(static_cast<size_t>(rows * cols * bits / 32));
      a.scales_f32.resize(static_cast<size_t>(rows * groups));
      a.biases_f32.resize(a.scales_f32.size());
      quantize_affine(w.data(), rows, cols, bits, group_size, a.packed.data(), a.scales_f32.data(),
                      a.biases_f32.data());
      const WeightMatrix view{
          WeightType::kAffine, a.packed.data(),    rows, cols, bits, group_size, WeightType::kF32,
          a.scales_f32.data(), a.biases_f32.data()};
      const uint32_t max_code = (1u << bits) - 1;
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        weight_row_to_f32(view, r, row.data());
        for (int64_t k = 0; k < cols; ++k) {
          const size_t i = static_cast<size_t>(r * cols + k);
          const double scale = std::abs(a.scales_f32[static_cast<size_t>(r * groups + k / group_size)]);
          const double err = std::abs(static_cast<double>(row[static_cast<size_t>(k)]) - w[i]);
          const uint32_t code = affine_code(view, r, k);
          const double steps = (code == 0 || code == max_code) ? 1.0 : 0.5;
          const double tiny = 1e-6 * (std::abs(w[i]) + 1e-30);
          ASSERT_LE(err, steps * scale * (1 + 1e-5) + tiny)
              << "bits=" << bits << " group=" << group_size << " row=" << r << " k=" << k << " w=" << w[i]
              << " code=" << code << " scale=" << scale;
          if (r == 2 || r == 3) {
            ASSERT_EQ(row[static_cast<size_t>(k)], w[i]);
          }
        }
      }
    }
}

// The least-squares quantizer against MLX's rule, both stored as a checkpoint stores them (scales and
// biases in bf16), unweighted and with column weights (calibration): its (weighted) squared
// reconstruction error is never larger in any group (it starts from MLX's choice and keeps a candidate
// only when it is better), is smaller overall, its parameters are exact bf16 values, and its codes are the
// rounding of each value for those parameters.
TEST(QuantizeAffineLeastSquares, NeverWorseThanMlxPerGroupAndBetterOverall) {
  for (bool weighted : {false, true})
    for (int bits : {3, 4, 6, 8})
      for (int64_t group_size : {32, 64, 128}) {
        SCOPED_TRACE(testing::Message()
                     << "weighted " << weighted << " bits " << bits << " group " << group_size);
        const int64_t rows = 8, cols = 512, groups = cols / group_size;
        auto w = normal_values(static_cast<size_t>(rows * cols), 77 + static_cast<uint64_t>(bits), 0.05f);
        for (int64_t k = 0; k < cols; k += 37) w[static_cast<size_t>(k)] *= 8.0f;     // outliers in row 0
        for (int64_t k = 0; k < cols; ++k) w[static_cast<size_t>(cols + k)] = 0.25f;  // a constant row
        std::vector<float> column_weights(static_cast<size_t>(cols), 1.0f);
        if (weighted) {  // spread over two orders of magnitude, as activation mean squares are
          const auto z = normal_values(static_cast<size_t>(cols), 5, 1.0f);
          for (int64_t k = 0; k < cols; ++k)
            column_weights[static_cast<size_t>(k)] = std::exp(1.5f * z[static_cast<size_t>(k)]);
        }
        auto quantize = [&](bool least_squares, bool round_params) {
          AffineMatrix a;
          a.packed.resize(static_cast<size_t>(rows * cols * bits / 32));
          a.scales_f32.resize(static_cast<size_t>(rows * groups));
          a.biases_f32.resize(a.scales_f32.size());
          if (least_squares)
            quantize_affine_least_squares(w.data(), rows, cols, bits, group_size, a.packed.data(),
                                          a.scales_f32.data(), a.biases_f32.data(),
                                          weighted ? column_weights.data() : nullptr);
          else
            quantize_affine(w.data(), rows, cols, bits, group_size, a.packed.data(), a.scales_f32.data(),
                            a.biases_f32.data());
          for (size_t i = 0; round_params && i < a.scales_f32.size(); ++i) {  // stored in bf16
            a.scales_f32[i] = bf16_to_f32(f32_to_bf16(a.scales_f32[i]));
            a.biases_f32[i] = bf16_to_f32(f32_to_bf16(a.biases_f32[i]));
          }
          return a;
        };
        const AffineMatrix mlx = quantize(false, true), lsq = quantize(true, true),
                           raw = quantize(true, false);
        // The returned parameters were already bf16: rounding them again changed nothing.
        ASSERT_EQ(raw.scales_f32, lsq.scales_f32);
        ASSERT_EQ(raw.biases_f32, lsq.biases_f32);
        auto group_errors = [&](const AffineMatrix& a) {
          const WeightMatrix view{
              WeightType::kAffine, a.packed.data(),    rows, cols, bits, group_size, WeightType::kF32,
              a.scales_f32.data(), a.biases_f32.data()};
          std::vector<double> e(static_cast<size_t>(rows * groups));
          std::vector<float> row(static_cast<size_t>(cols));
          for (int64_t r = 0; r < rows; ++r) {
            weight_row_to_f32(view, r, row.data());
            for (int64_t k = 0; k < cols; ++k) {
              const double d =
                  static_cast<double>(row[static_cast<size_t>(k)]) - w[static_cast<size_t>(r * cols + k)];
              e[static_cast<size_t>(r * groups + k / group_size)] +=
                  column_weights[static_cast<size_t>(k)] * d * d;
            }
          }
          return e;
        };
        const auto e_mlx = group_errors(mlx), e_lsq = group_errors(lsq);
        double total_mlx = 0, total_lsq = 0;
        for (size_t g = 0; g < e_mlx.size(); ++g) {
          // MLX's codes were rounded for its unrounded parameters; the search's baseline recomputes them
          // for the bf16 ones, which can only help. (A tolerance for float summation order.)
          ASSERT_LE(e_lsq[g], e_mlx[g] * (1 + 1e-9) + 1e-18) << "group " << g;
          total_mlx += e_mlx[g], total_lsq += e_lsq[g];
        }
        EXPECT_LT(total_lsq, 0.97 * total_mlx);
        // Codes: each value's nearest grid point for its group's parameters.
        const WeightMatrix view{
            WeightType::kAffine,   lsq.packed.data(),    rows, cols, bits, group_size, WeightType::kF32,
            lsq.scales_f32.data(), lsq.biases_f32.data()};
        const float max_code = static_cast<float>((1 << bits) - 1);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k) {
            const size_t g = static_cast<size_t>(r * groups + k / group_size);
            const float want =
                std::clamp(std::nearbyint((w[static_cast<size_t>(r * cols + k)] - lsq.biases_f32[g]) /
                                          lsq.scales_f32[g]),
                           0.0f, max_code);
            ASSERT_EQ(affine_code(view, r, k), static_cast<uint32_t>(want)) << "row " << r << " k " << k;
          }
      }
}

}  // namespace
}  // namespace mtpx::cpu
