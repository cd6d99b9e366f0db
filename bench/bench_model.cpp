// Speed of plain vs MTP decoding on a real model and held-out prompts (default: the shipped model and
// tests/fixtures/trained_default/heldout_samples.json): tok/s, acceptance by position and tokens per step
// for K = 1..4, greedy and with the model's sampler (T 0.7, top-p 0.95, top-k 20), all in one process.
//
//   bench_model [--model DIR] [--samples FILE] [--tokens 64] [--prompts 20] [--threads N] [--repeats 3]
#include <fmt/core.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "decode/generate.h"
#include "model/qwen35.h"

int main(int argc, char** argv) {
  std::string model_dir = std::string(MTPX_SOURCE_DIR) + "/models/default";
  std::string samples_file =
      std::string(MTPX_SOURCE_DIR) + "/tests/fixtures/trained_default/heldout_samples.json";
  int64_t tokens = 64, prompts = 20;
  int threads = 0, repeats = 3;
  CLI::App app{"mtpx AR vs MTP on a real model"};
  app.add_option("--model", model_dir);
  app.add_option("--samples", samples_file);
  app.add_option("--tokens", tokens)->check(CLI::PositiveNumber);
  app.add_option("--prompts", prompts)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::Range(1, 1024));
  app.add_option("--repeats", repeats)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (threads > 0) omp_set_num_threads(threads);
  auto model = mtpx::Model::load(model_dir);
  std::ifstream in(samples_file);
  auto samples = nlohmann::json::parse(in)["samples"];
  std::vector<std::vector<int32_t>> prompt_list;
  for (const auto& s : samples)
    if (static_cast<int64_t>(prompt_list.size()) < prompts)
      prompt_list.push_back(s["prompt_ids"].get<std::vector<int32_t>>());

  struct Row {
    std::string sampler;
    int64_t k;
    double tok_s, acceptance, tokens_per_step;
    std::vector<double> by_position;
  };
  std::vector<Row> rows;
  for (int sampled = 0; sampled < 2; ++sampled) {
    for (int64_t k = 0; k <= 4; ++k) {
      // Median over repeats of (generated tokens after the first) / decode time, summed over prompts.
      std::vector<double> rates;
      mtpx::MtpStats total;
      total.drafted_by_position.assign(static_cast<size_t>(std::max<int64_t>(k, 1)), 0);
      total.accepted_by_position = total.drafted_by_position;
      int64_t produced = 0, steps = 0;
      for (int rep = 0; rep < repeats; ++rep) {
        double seconds = 0;
        int64_t count = 0;
        for (size_t p = 0; p < prompt_list.size(); ++p) {
          mtpx::GenerateOptions o;
          o.max_tokens = tokens;
          o.draft = k;
          o.seed = p;
          o.sampler = sampled ? mtpx::SamplerParams{.temperature = 0.7, .top_k = 20, .top_p = 0.95}
                              : mtpx::SamplerParams{.temperature = 0.0};
          const mtpx::GenerateResult r = mtpx::generate(*model, prompt_list[p], o);
          seconds += r.stats.decode_seconds;
          count += r.stats.generated_tokens - 1;
          if (rep == 0 && k > 0) {
            total.drafted += r.stats.mtp.drafted, total.accepted += r.stats.mtp.accepted;
            for (size_t i = 0; i < r.stats.mtp.drafted_by_position.size(); ++i) {
              total.drafted_by_position[i] += r.stats.mtp.drafted_by_position[i];
              total.accepted_by_position[i] += r.stats.mtp.accepted_by_position[i];
            }
            produced += r.stats.generated_tokens - 1, steps += r.stats.mtp.steps;
          }
        }
        rates.push_back(static_cast<double>(count) / seconds);
      }
      std::sort(rates.begin(), rates.end());
      Row row{sampled ? "T0.7/p0.95/k20" : "greedy",
              k,
              rates[rates.size() / 2],
              total.acceptance(),
              steps ? static_cast<double>(produced) / static_cast<double>(steps) : 1.0,
              {}};
      for (size_t i = 0; k > 0 && i < total.drafted_by_position.size(); ++i)
        row.by_position.push_back(total.drafted_by_position[i] ? double(total.accepted_by_position[i]) /
                                                                     double(total.drafted_by_position[i])
                                                               : 0.0);
      rows.push_back(row);
    }
  }
  fmt::print("model {} | threads {} | {} prompts x {} tokens, median of {} repeats\n", model_dir,
             omp_get_max_threads(), prompt_list.size(), tokens, repeats);
  fmt::print(
      "| sampler | K | tok/s | vs AR | acceptance | by position | tokens/step "
      "|\n|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    const Row& ar = *std::find_if(rows.begin(), rows.end(),
                                  [&](const Row& x) { return x.sampler == r.sampler && x.k == 0; });
    std::string pos;
    for (double a : r.by_position) pos += fmt::format("{:.2f} ", a);
    fmt::print("| {} | {} | {:.0f} | {:.2f} | {} | {}| {:.2f} |\n", r.sampler,
               r.k ? std::to_string(r.k) : "AR", r.tok_s, r.tok_s / ar.tok_s,
               r.k ? fmt::format("{:.3f}", r.acceptance) : "-", pos, r.tokens_per_step);
  }
  return 0;
}
