// Sampler benchmark: the host's truncate() of one logits row at Qwen's vocabulary, per sampler and per
// kind of row. A trained model's rows are peaked; a random checkpoint's (mtpx synth) are nearly flat, so
// top-p or min-p keeps most of the vocabulary: the case a device's top candidates cannot decide, where the
// row comes back to the host (decode/sampler.h).
//
//   bench_sampler [--vocab 248320] [--rows 16] [--seed 1]
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "decode/sampler.h"

namespace {

using Clock = std::chrono::steady_clock;

struct RowKind {
  std::string name;
  float sigma;  // logits ~ N(0, sigma)
};

struct Sampler {
  std::string name;
  mtpx::SamplerParams params;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mtpx sampler benchmark: truncate() of one row"};
  int64_t vocab = 248320;
  int rows = 16;
  uint32_t seed = 1;
  app.add_option("--vocab", vocab, "ids per row")->check(CLI::Range(int64_t{2}, int64_t{1} << 24));
  app.add_option("--rows", rows, "rows timed per case (the median is reported)")->check(CLI::Range(1, 10000));
  app.add_option("--seed", seed, "random rows' seed");
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;

  const std::vector<RowKind> kinds = {{"peaked (sigma 3)", 3.0f}, {"flat (sigma 0.05)", 0.05f}};
  const std::vector<Sampler> samplers = {
      {"T 0.8, top-k 20", {.temperature = 0.8, .top_k = 20}},
      {"T 0.8, top-p 0.95", {.temperature = 0.8, .top_p = 0.95}},
      {"T 0.8, top-p 0.95, min-p 0.05", {.temperature = 0.8, .top_p = 0.95, .min_p = 0.05}},
      {"T 1, min-p 0.1", {.temperature = 1.0, .min_p = 0.1}},
      {"T 1", {.temperature = 1.0}},
  };
  std::mt19937 rng(seed);
  fmt::print("truncate() of one row of {} ids, median of {} rows\n\n", vocab, rows);
  fmt::print("| row | sampler | ids kept (median) | ms per row |\n|---|---|---|---|\n");
  for (const RowKind& kind : kinds) {
    std::normal_distribution<float> normal(0.0f, kind.sigma);
    std::vector<std::vector<float>> logits(static_cast<size_t>(rows),
                                           std::vector<float>(static_cast<size_t>(vocab)));
    for (auto& row : logits)
      for (float& l : row) l = normal(rng);
    for (const Sampler& s : samplers) {
      std::vector<double> ms;
      std::vector<size_t> kept;
      for (const auto& row : logits) {
        const auto start = Clock::now();
        const mtpx::TokenDistribution d = mtpx::truncate(row, s.params, vocab);
        ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
        kept.push_back(d.ids.size());
      }
      std::nth_element(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 2), ms.end());
      std::nth_element(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(kept.size() / 2), kept.end());
      fmt::print("| {} | {} | {} | {:.2f} |\n", kind.name, s.name, kept[kept.size() / 2], ms[ms.size() / 2]);
    }
  }
  return 0;
}
