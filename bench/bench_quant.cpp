// Quantized-weight benchmark: decode-shaped products (GEMV) over the Qwen3.5-0.8B matrix mix with bf16
// weights against group-wise affine 8/6/4-bit weights (MLX layout), next to this machine's read bandwidth.
//
// One pass = every matrix of a decode step once: per layer 6144x1024 (in_proj_qkv + z), 2048x1024 (q/gate),
// 1024x2048 (out), 2 x 3584x1024 (gate, up), 1024x3584 (down), times 24 layers, plus the 248320x1024
// lm_head; each layer has its own weights, so a pass streams them all from memory as decode does.
// Rounds interleave the formats and row counts (1, 2, 4 activation rows) so that every format sees the
// same load from the neighbours of this shared machine; reported: the median over rounds.
//
//   bench_quant [--rounds N] [--threads N] [--layers N] [--group-size 32|64|128] [--scales bf16|f16|f32]
//               [--bits 8,6,4] [--json]
#include <fmt/core.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "bench_util.h"
#include "util/bf16.h"

namespace {

using mtpx::cpu::WeightMatrix;
using mtpx::cpu::WeightType;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// splitmix64: cheap deterministic fill, per index (so the parallel fill is reproducible).
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A bf16 of magnitude in [2^-7, 2^-5) with random sign and mantissa: weight-like values.
uint16_t random_bf16(uint64_t r) {
  const uint16_t sign = static_cast<uint16_t>((r >> 20) & 1u) << 15;
  const uint16_t exponent = static_cast<uint16_t>(120 + (r >> 21) % 2) << 7;
  return static_cast<uint16_t>(sign | exponent | (r & 0x7fu));
}

void fill_u64(void* data, size_t bytes, uint64_t seed) {
  auto* p = static_cast<uint64_t*>(data);
  const int64_t n = static_cast<int64_t>(bytes / 8);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] = mix(seed ^ static_cast<uint64_t>(i));
}

// The storage of one matrix in one format.
struct Matrix {
  std::vector<uint64_t> codes;  // bf16 values or packed codes (8-byte words so fill_u64 can write them)
  std::vector<uint16_t> scales, biases;
  WeightMatrix view;
};

Matrix make_matrix(int64_t rows, int64_t cols, int bits, int64_t group_size, WeightType scale_type,
                   uint64_t seed) {
  Matrix m;
  if (bits == 16) {
    m.codes.resize(static_cast<size_t>(rows * cols * 2 / 8));
    auto* h = reinterpret_cast<uint16_t*>(m.codes.data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows * cols; ++i) h[i] = random_bf16(mix(seed ^ static_cast<uint64_t>(i)));
    m.view = {WeightType::kBF16, m.codes.data(), rows, cols};
    return m;
  }
  m.codes.resize(static_cast<size_t>((rows * cols * bits / 8 + 7) / 8));
  fill_u64(m.codes.data(), m.codes.size() * 8, seed);
  const int64_t groups = rows * (cols / group_size);
  const int64_t param_halves = scale_type == WeightType::kF32 ? 2 * groups : groups;
  m.scales.resize(static_cast<size_t>(param_halves));
  m.biases.resize(static_cast<size_t>(param_halves));
  for (int64_t i = 0; i < groups; ++i) {
    // Scales ~1e-3, biases ~-8e-3: the range of a 4-bit group of weights ~N(0, 0.02).
    const float scale =
        1e-3f * (1.0f + static_cast<float>(mix(seed + 2 * static_cast<uint64_t>(i)) % 100) / 100);
    const float bias = -8.0f * scale;
    if (scale_type == WeightType::kF32) {
      std::memcpy(&m.scales[static_cast<size_t>(2 * i)], &scale, 4);
      std::memcpy(&m.biases[static_cast<size_t>(2 * i)], &bias, 4);
    } else {
      const bool bf = scale_type == WeightType::kBF16;
      m.scales[static_cast<size_t>(i)] = bf ? mtpx::f32_to_bf16(scale) : mtpx::f32_to_f16(scale);
      m.biases[static_cast<size_t>(i)] = bf ? mtpx::f32_to_bf16(bias) : mtpx::f32_to_f16(bias);
    }
  }
  m.view.type = WeightType::kAffine;
  m.view.data = m.codes.data();
  m.view.rows = rows;
  m.view.cols = cols;
  m.view.bits = bits;
  m.view.group_size = group_size;
  m.view.scale_type = scale_type;
  m.view.scales = m.scales.data();
  m.view.biases = m.biases.data();
  return m;
}

// One format: every matrix of a pass.
struct Format {
  std::string name;
  int bits = 16;
  std::vector<Matrix> matrices;
  double bytes = 0;  // weight_bytes over a pass
};

// The Qwen3.5-0.8B decode matrix mix (see the file comment), [rows, cols] per layer.
const std::pair<int64_t, int64_t> kLayerShapes[] = {{6144, 1024}, {2048, 1024}, {1024, 2048},
                                                    {3584, 1024}, {3584, 1024}, {1024, 3584}};
constexpr std::pair<int64_t, int64_t> kLmHead{248320, 1024};

double time_pass(const Format& f, const float* x, int64_t m, float* y) {
  auto t = Clock::now();
  for (const Matrix& w : f.matrices) mtpx::cpu::matmul(w.view, x, m, y);
  return seconds_since(t);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 7, threads = 2, layers = 24;
  int64_t group_size = 64;
  std::string scales = "bf16";
  std::vector<int> bits_list{8, 6, 4};
  bool json = false;
  CLI::App app{"mtpx quantized GEMV benchmark (bf16 vs affine 8/6/4-bit on the 0.8B decode matrix mix)"};
  app.add_option("--rounds", rounds, "interleaved rounds (median reported)")->check(CLI::Range(1, 1000));
  app.add_option("--threads", threads)->check(CLI::Range(1, 1024));
  app.add_option("--layers", layers)->check(CLI::Range(0, 1000));
  app.add_option("--group-size", group_size)->check(CLI::IsMember({32, 64, 128}));
  app.add_option("--scales", scales, "scale/bias dtype")->check(CLI::IsMember({"bf16", "f16", "f32"}));
  app.add_option("--bits", bits_list, "affine widths")
      ->delimiter(',')
      ->check(CLI::IsMember({2, 3, 4, 5, 6, 8}));
  app.add_flag("--json", json);
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;
  omp_set_num_threads(threads);
  const WeightType scale_type = scales == "f32"   ? WeightType::kF32
                                : scales == "f16" ? WeightType::kF16
                                                  : WeightType::kBF16;

  std::vector<Format> formats;
  formats.push_back({"bf16", 16, {}, 0});
  for (int b : bits_list) formats.push_back({fmt::format("q{}", b), b, {}, 0});
  auto t_init = Clock::now();
  uint64_t seed = 1;
  int64_t max_dim = 0;
  for (Format& f : formats) {
    auto add = [&](int64_t rows, int64_t cols) {
      f.matrices.push_back(make_matrix(rows, cols, f.bits, group_size, scale_type, seed++ << 40));
      f.bytes += static_cast<double>(mtpx::cpu::weight_bytes(f.matrices.back().view));
      max_dim = std::max({max_dim, rows, cols});
    };
    for (int l = 0; l < layers; ++l)
      for (auto [rows, cols] : kLayerShapes) add(rows, cols);
    add(kLmHead.first, kLmHead.second);
  }
  const double init_s = seconds_since(t_init);

  constexpr int64_t kMaxRows = 4;
  std::vector<float> x(static_cast<size_t>(kMaxRows * max_dim)), y(static_cast<size_t>(kMaxRows * max_dim));
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(static_cast<int64_t>(mix(i) % 2001) - 1000) / 1000.0f;
  const int64_t row_counts[] = {1, 2, 4};
  for (const Format& f : formats) time_pass(f, x.data(), 1, y.data());  // warm-up (page faults, caches)

  // seconds[format][row count index] per round.
  std::vector<std::vector<std::vector<double>>> seconds(formats.size(), std::vector<std::vector<double>>(3));
  for (int round = 0; round < rounds; ++round)
    for (size_t ri = 0; ri < 3; ++ri)
      for (size_t fi = 0; fi < formats.size(); ++fi)
        seconds[fi][ri].push_back(time_pass(formats[fi], x.data(), row_counts[ri], y.data()));

  const double bf16_s = median(seconds[0][0]);
  nlohmann::json out = {{"threads", threads},     {"simd", mtpx::cpu::simd_path()},
                        {"layers", layers},       {"group_size", group_size},
                        {"scales", scales},       {"rounds", rounds},
                        {"init_seconds", init_s}, {"formats", nlohmann::json::array()}};
  for (size_t fi = 0; fi < formats.size(); ++fi) {
    const double s1 = median(seconds[fi][0]), s2 = median(seconds[fi][1]), s4 = median(seconds[fi][2]);
    out["formats"].push_back({{"name", formats[fi].name},
                              {"bytes_per_pass", formats[fi].bytes},
                              {"pass_ms", 1e3 * s1},
                              {"gb_s", formats[fi].bytes / s1 / 1e9},
                              {"passes_per_s", 1.0 / s1},
                              {"speed_vs_bf16", bf16_s / s1},
                              {"two_rows_vs_one", s2 / s1},
                              {"four_rows_vs_one", s4 / s1},
                              {"pass_ms_per_round", seconds[fi][0]}});
  }
  if (json) {
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  fmt::print(
      "0.8B decode matrix mix: {} layers + lm_head | threads {} | simd {} | affine group {} with {} scales | "
      "median of {} rounds (init {:.1f} s)\n",
      layers, threads, mtpx::cpu::simd_path(), group_size, scales, rounds, init_s);
  fmt::print(
      "| format | MB per pass | ms per pass | GB/s | passes/s (tok/s-eq) | speed vs bf16 | 2 rows / 1 | 4 "
      "rows / 1 |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (const auto& f : out["formats"])
    fmt::print("| {} | {:.0f} | {:.1f} | {:.1f} | {:.1f} | {:.2f}x | {:.2f} | {:.2f} |\n",
               f["name"].get<std::string>(), f["bytes_per_pass"].get<double>() / 1e6,
               f["pass_ms"].get<double>(), f["gb_s"].get<double>(), f["passes_per_s"].get<double>(),
               f["speed_vs_bf16"].get<double>(), f["two_rows_vs_one"].get<double>(),
               f["four_rows_vs_one"].get<double>());
  return 0;
}
