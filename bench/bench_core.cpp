// Core benchmark: decode and prefill speed of the CPU engine on a randomly initialized model with the
// real Qwen3.5-0.8B shape (spec §9), next to this machine's measured memory read bandwidth and fp32
// GEMM rate (OpenBLAS sgemm), plus the verify-cost curve c(K) = time(K+1 rows) / time(1 row).
//
//   bench_core [--decode-tokens N] [--prefill-tokens N] [--threads N] [--shape 0.8B|tiny] [--json]
#include <cblas.h>
#include <fmt/core.h>
#include <immintrin.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "bench_util.h"
#include "model/qwen35.h"
#include "model/shapes.h"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Sum of a float array with wide loads and independent accumulators, so the loop is bound by memory,
// not by the add latency; with `prefetch`, each 128-byte step also hints the lines 4 KiB ahead, as the
// matmul kernels do (the hardware prefetchers stop at page boundaries), so the yardstick is the better of
// the two ways to read.
__attribute__((target("avx2"))) float sum_avx2(const float* p, size_t n, bool prefetch) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i) + 4096, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i) + 4096 + 64, _MM_HINT_T0);
    }
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  float s = 0;
  for (float x : lanes) s += x;
  return s;
}

// One streaming read of a buffer much larger than the caches, all threads: bytes per second.
double read_bandwidth_once(const std::vector<float>& buffer, bool prefetch) {
  auto t = Clock::now();
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t threads = static_cast<size_t>(omp_get_num_threads()),
                 me = static_cast<size_t>(omp_get_thread_num());
    const size_t chunk = buffer.size() / threads / 32 * 32;
    total += sum_avx2(buffer.data() + me * chunk, chunk, prefetch);
  }
  const double secs = seconds_since(t);
  if (total < 0) std::puts("");  // keep the sum alive
  return static_cast<double>(buffer.size() * sizeof(float)) / secs;
}

std::vector<float> make_read_buffer() {
  const size_t n = size_t{1} << 28;  // 1 GiB of floats
  std::vector<float> buffer(n);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(i & 7);
  return buffer;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double measure_sgemm_flops() {
  const int m = 512, n = 4096, k = 4096;
  std::vector<float> a(static_cast<size_t>(m) * k, 0.5f), b(static_cast<size_t>(k) * n, 0.25f),
      c(static_cast<size_t>(m) * n);
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    auto t = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f,
                c.data(), n);
    best = std::max(best, 2.0 * m * n * k / seconds_since(t));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t decode_tokens = 32, prefill_tokens = 512;
  int threads = 0;
  std::string shape = "0.8B";
  bool json = false;
  CLI::App app{"mtpx core benchmark"};
  app.add_option("--decode-tokens", decode_tokens)->check(CLI::PositiveNumber);
  app.add_option("--prefill-tokens", prefill_tokens)->check(CLI::Range(int64_t{16}, int64_t{1} << 16));
  app.add_option("--threads", threads)->check(CLI::Range(1, 1024));
  app.add_option("--shape", shape);
  app.add_flag("--json", json);
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;
  if (threads > 0) omp_set_num_threads(threads);

  auto t_init = Clock::now();
  auto model = mtpx::Model::synthetic(mtpx::shape_config(shape), 1);
  model->use_device("cpu");  // the CPU kernels' weight tiles, part of the init time
  const double init_s = seconds_since(t_init);
  const auto& w = model->weights();
  const double bytes_per_token = static_cast<double>(w.matrix_bytes);

  std::vector<int32_t> prompt(static_cast<size_t>(prefill_tokens));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919) % 1000);
  mtpx::ForwardResult r;

  // Prefill (last-row logits, as generation does) against sgemm, paired like decode below: each of three
  // rounds measures the sgemm rate and then times one prefill, and the median round's ratio is reported.
  // One warm-up on a short prompt first.
  {
    auto s = model->new_state(64);
    model->forward(s, std::span<const int32_t>(prompt.data(), 16), mtpx::LogitRows::kLast, r);
  }
  std::vector<double> round_gemm, round_prefill_s, round_prefill_fraction;
  for (int round = 0; round < 3; ++round) {
    const double round_rate = measure_sgemm_flops();
    auto state = model->new_state(prefill_tokens + 16);
    const auto t = Clock::now();
    model->forward(state, prompt, mtpx::LogitRows::kLast, r);
    const double secs = seconds_since(t);
    round_gemm.push_back(round_rate);
    round_prefill_s.push_back(secs);
    round_prefill_fraction.push_back(mtpx::bench::matmul_flops(w, prefill_tokens, 1) / secs / round_rate);
  }
  const double gemm = median(round_gemm);
  const double prefill_s = median(round_prefill_s);
  const double prefill_flops = mtpx::bench::matmul_flops(w, prefill_tokens, 1) / prefill_s;
  const double prefill_fraction = median(round_prefill_fraction);

  // Decode from a 16-token context against memory bandwidth, paired: each round streams the 1 GiB read
  // buffer (best of 4 passes: 2 plain, 2 with software prefetch) and then times decode_tokens steps, so the
  // ratio of a round compares the two under the same load from neighbours on this shared machine. Reported:
  // the median round.
  const std::vector<float> read_buffer = make_read_buffer();
  std::vector<double> round_bandwidth, round_decode_s, round_fraction;
  for (int round = 0; round < 5; ++round) {
    const double bw =
        std::max({read_bandwidth_once(read_buffer, false), read_bandwidth_once(read_buffer, true),
                  read_bandwidth_once(read_buffer, false), read_bandwidth_once(read_buffer, true)});
    auto dstate = model->new_state(16 + decode_tokens + 16);
    model->forward(dstate, std::span<const int32_t>(prompt.data(), 16), mtpx::LogitRows::kLast, r);
    int32_t token = 1;
    model->forward(dstate, std::span<const int32_t>(&token, 1), mtpx::LogitRows::kLast, r);  // warm-up
    const auto t = Clock::now();
    for (int64_t i = 0; i < decode_tokens; ++i) {
      token = static_cast<int32_t>((token * 31 + 7) % 1000);
      model->forward(dstate, std::span<const int32_t>(&token, 1), mtpx::LogitRows::kLast, r);
    }
    const double step_s = seconds_since(t) / static_cast<double>(decode_tokens);
    round_bandwidth.push_back(bw);
    round_decode_s.push_back(step_s);
    round_fraction.push_back(bytes_per_token / step_s / bw);
  }
  const double bandwidth = median(round_bandwidth);
  const double decode_s = median(round_decode_s);
  const double decode_bw = bytes_per_token / decode_s;
  const double decode_fraction = median(round_fraction);

  // Verify cost: K+1 rows (all logits, as verification needs) vs one decode row, same context length.
  std::vector<double> verify_cost;
  for (int64_t k = 1; k <= 4; ++k) {
    std::vector<int32_t> window(static_cast<size_t>(k + 1), 5);
    const int reps = std::max<int64_t>(3, decode_tokens / 8);
    double best_multi = 1e30, best_single = 1e30;
    for (int rep = 0; rep < reps; ++rep) {
      auto s1 = model->new_state(32);
      model->forward(s1, std::span<const int32_t>(prompt.data(), 16), mtpx::LogitRows::kNone, r);
      auto s2 = model->new_state(32);
      model->forward(s2, std::span<const int32_t>(prompt.data(), 16), mtpx::LogitRows::kNone, r);
      auto t1 = Clock::now();
      model->forward(s1, std::span<const int32_t>(window.data(), 1), mtpx::LogitRows::kAll, r);
      best_single = std::min(best_single, seconds_since(t1));
      auto t2 = Clock::now();
      model->forward(s2, window, mtpx::LogitRows::kAll, r);
      best_multi = std::min(best_multi, seconds_since(t2));
    }
    verify_cost.push_back(best_multi / best_single);
  }

  nlohmann::json out = {
      {"shape", shape},
      {"threads", omp_get_max_threads()},
      {"simd", mtpx::cpu::simd_path()},
      {"weight_bytes", bytes_per_token},
      {"init_seconds", init_s},
      {"memory_read_gb_s", bandwidth / 1e9},
      {"sgemm_gflop_s", gemm / 1e9},
      {"decode_tok_s", 1.0 / decode_s},
      {"decode_weight_gb_s", decode_bw / 1e9},
      {"decode_fraction_of_bandwidth", decode_fraction},
      {"decode_fraction_per_round", round_fraction},
      {"prefill_tokens", prefill_tokens},
      {"prefill_tok_s", static_cast<double>(prefill_tokens) / prefill_s},
      {"prefill_gflop_s", prefill_flops / 1e9},
      {"prefill_fraction_of_sgemm", prefill_fraction},
      {"prefill_fraction_per_round", round_prefill_fraction},
      {"verify_cost_c1_to_c4", verify_cost},
  };
  if (json) {
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  fmt::print("shape {} | threads {} | simd {} | weights {:.0f} MiB (init {:.1f} s)\n", shape,
             omp_get_max_threads(), mtpx::cpu::simd_path(), bytes_per_token / (1 << 20), init_s);
  fmt::print("machine: memory read {:.1f} GB/s, OpenBLAS sgemm {:.1f} GFLOP/s\n", bandwidth / 1e9,
             gemm / 1e9);
  fmt::print(
      "decode : {:.2f} tok/s, {:.1f} GB/s of weights = {:.0f}% of measured bandwidth (median of 5 paired "
      "rounds:",
      1.0 / decode_s, decode_bw / 1e9, 100 * decode_fraction);
  for (double f : round_fraction) fmt::print(" {:.0f}%", 100 * f);
  fmt::print(")\n");
  fmt::print(
      "prefill: {} tokens at {:.1f} tok/s, {:.1f} GFLOP/s = {:.0f}% of sgemm (median of 3 paired rounds:",
      prefill_tokens, static_cast<double>(prefill_tokens) / prefill_s, prefill_flops / 1e9,
      100 * prefill_fraction);
  for (double f : round_prefill_fraction) fmt::print(" {:.0f}%", 100 * f);
  fmt::print(")\n");
  fmt::print(
      "verify cost c(K) = time(K+1 rows)/time(1 row): c(1)={:.2f} c(2)={:.2f} c(3)={:.2f} c(4)={:.2f}\n",
      verify_cost[0], verify_cost[1], verify_cost[2], verify_cost[3]);
  return 0;
}
