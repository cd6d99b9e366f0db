// Decode speed of several model directories side by side (e.g. the same synthetic shape in bf16 and
// quantized): rounds of `--tokens` greedy decode steps per model, interleaved so that every model sees
// the same machine; the median per model and its ratio to the first.
//
//   mtpx synth --shape 0.8B --out /tmp/s16 && mtpx synth --shape 0.8B --bits 4 --out /tmp/s4
//   bench_decode_compare --models /tmp/s16,/tmp/s4 [--tokens 32] [--rounds 5] [--threads N]
#include <fmt/core.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <sstream>

#include "bench_util.h"
#include "model/qwen35.h"
#include "tools/bench.h"

int main(int argc, char** argv) {
  std::string models_flag;
  int64_t tokens = 32;
  int rounds = 5, threads = 0;
  CLI::App app{"decode speed of several models, interleaved"};
  app.add_option("--models", models_flag, "comma-separated model directories")->required();
  app.add_option("--tokens", tokens)->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::Range(1, 1024));
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;
  if (threads > 0) omp_set_num_threads(threads);
  std::vector<std::string> dirs;
  std::stringstream ss(models_flag);
  for (std::string d; std::getline(ss, d, ',');) dirs.push_back(d);
  std::vector<std::unique_ptr<mtpx::Model>> models;
  for (const auto& d : dirs) models.push_back(mtpx::Model::load(d));

  std::vector<int32_t> prompt;
  for (int i = 0; i < 16; ++i) prompt.push_back(static_cast<int32_t>((i * 7919 + 11) % 1000));
  std::vector<std::vector<double>> rates(models.size());
  for (int round = 0; round < rounds + 1; ++round) {  // round 0 warms up
    for (size_t m = 0; m < models.size(); ++m) {
      mtpx::InferenceState state = models[m]->new_state(16 + tokens + 8);
      mtpx::ForwardResult r;
      models[m]->forward(state, prompt, mtpx::LogitRows::kLast, r);
      int32_t token = 1;
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < tokens; ++i) {
        models[m]->forward(state, std::span<const int32_t>(&token, 1), mtpx::LogitRows::kLast, r);
        token = static_cast<int32_t>((token * 31 + 7) % 1000);
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (round > 0) rates[m].push_back(static_cast<double>(tokens) / s);
    }
  }
  fmt::print("threads {} | {} decode steps x {} rounds, interleaved; median tok/s\n", omp_get_max_threads(),
             tokens, rounds);
  fmt::print("| model | weights read per token | tok/s | vs first |\n|---|---|---|---|\n");
  const double base = mtpx::tools::median_of(rates[0]);
  for (size_t m = 0; m < models.size(); ++m) {
    const double rate = mtpx::tools::median_of(rates[m]);
    fmt::print("| {} | {:.0f} MiB | {:.2f} | {:.2f}x |\n", dirs[m],
               static_cast<double>(models[m]->weights().matrix_bytes) / (1 << 20), rate, rate / base);
  }
  return 0;
}
