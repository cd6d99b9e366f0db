// One engine step for several sequences: Model::forward_batch (every sequence's rows in one pass) against
// the same rows run one sequence at a time (what the server's scheduler does today), side by side in
// rounds. Each sequence decodes one row per step (or a verify window of --rows rows).
//
//   bench_batch_step [--model DIR | --shape 0.8B] [--sequences 1,2,4,8] [--rows 1] [--steps 16]
//                    [--rounds 5] [--threads N]
#include <fmt/core.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <memory>
#include <sstream>
#include <vector>

#include "bench_util.h"
#include "model/qwen35.h"
#include "model/shapes.h"

namespace {

using Clock = std::chrono::steady_clock;

// Seconds for `steps` steps of `n` sequences, each adding `rows` rows per step, batched or one by one.
double run(const mtpx::Model& model, int64_t n, int64_t rows, int64_t steps, bool batched) {
  const int64_t V = model.config().vocab_size;
  std::vector<mtpx::InferenceState> states;
  std::vector<mtpx::ForwardResult> results(static_cast<size_t>(n));
  std::vector<int32_t> prompt;
  for (int i = 0; i < 32; ++i) prompt.push_back(static_cast<int32_t>((i * 7919 + 11) % (V - 3)));
  for (int64_t i = 0; i < n; ++i) {
    states.push_back(model.new_state(32 + rows * steps + 8));
    model.forward(states.back(), prompt, mtpx::LogitRows::kLast, results[static_cast<size_t>(i)]);
  }
  std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(n), std::vector<int32_t>(rows, 1));
  const mtpx::LogitRows logit_rows = rows > 1 ? mtpx::LogitRows::kAll : mtpx::LogitRows::kLast;
  const auto t0 = Clock::now();
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<mtpx::SequenceForward> batch;
    for (int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<size_t>(i);
      for (int32_t& t : tokens[k]) t = static_cast<int32_t>((t * 31 + s + i) % (V - 3));
      batch.push_back({.state = &states[k],
                       .tokens = tokens[k],
                       .rows = logit_rows,
                       .result = &results[k],
                       .argmax_limit = V});
    }
    if (batched)
      model.forward_batch(batch);
    else
      for (const auto& b : batch) model.forward(*b.state, b.tokens, b.rows, *b.result, false, b.argmax_limit);
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, shape, sequences_flag = "1,2,4,8";
  int64_t rows = 1, steps = 16;
  int rounds = 5, threads = 0;
  CLI::App app{"batched engine steps vs one sequence at a time"};
  app.add_option("--model", model_dir, "model directory (default: the shipped model)");
  app.add_option("--shape", shape, "a synthetic shape instead (mtpx synth's names: 0.8B, 9B, ...)");
  app.add_option("--sequences", sequences_flag, "comma-separated sequence counts");
  app.add_option("--rows", rows, "rows per sequence per step (1: decode; K+1: a verify window)")
      ->check(CLI::Range(1, 15));
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::Range(1, 1024));
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;
  if (threads > 0) omp_set_num_threads(threads);
  const auto model =
      !shape.empty() ? mtpx::Model::synthetic(mtpx::shape_config(shape), 1)
                     : mtpx::Model::load(model_dir.empty() ? MTPX_SOURCE_DIR "/models/default" : model_dir);
  std::vector<int64_t> counts;
  std::stringstream ss(sequences_flag);
  for (std::string c; std::getline(ss, c, ',');) counts.push_back(std::stoll(c));
  fmt::print("{} | {} threads | {} row(s) per sequence per step, {} steps, median of {} rounds\n",
             shape.empty() ? (model_dir.empty() ? "models/default" : model_dir) : shape,
             threads > 0 ? threads : omp_get_max_threads(), rows, steps, rounds);
  fmt::print("| sequences | one by one: step ms | batched: step ms | speedup | aggregate rows/s batched |\n");
  fmt::print("|---|---|---|---|---|\n");
  for (const int64_t n : counts) {
    std::vector<double> solo, together;
    run(*model, n, rows, 2, true);  // warm-up
    for (int r = 0; r < rounds; ++r) {
      solo.push_back(run(*model, n, rows, steps, false));
      together.push_back(run(*model, n, rows, steps, true));
    }
    std::sort(solo.begin(), solo.end());
    std::sort(together.begin(), together.end());
    const double s = solo[solo.size() / 2] / static_cast<double>(steps);
    const double b = together[together.size() / 2] / static_cast<double>(steps);
    fmt::print("| {} | {:.3f} | {:.3f} | {:.2f}x | {:.0f} |\n", n, s * 1e3, b * 1e3, s / b,
               static_cast<double>(n * rows) / b);
  }
  return 0;
}
