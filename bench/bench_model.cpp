// Speed of plain vs MTP decoding on a real model and held-out prompts (default: the shipped model and
// tests/fixtures/trained_default/heldout_samples.json): tok/s, acceptance by position and tokens per step
// for K = 1..4, greedy and with the model's sampler (T 0.7, top-p 0.95, top-k 20), all in one process.
// The protocol is mtpx bench's (tools::run_bench): every case runs in every repeat, interleaved, so each
// MTP case is compared with the plain run of the same repeat ("vs AR" is the median of those paired
// ratios; the machines these run on drift by 20-30% within a minute).
//
//   bench_model [--model DIR] [--samples FILE] [--tokens 64] [--prompts 20] [--threads N] [--repeats 3]
//               [--max-draft 4] [--draft-vocab N]   (N: MTP drafts from the first N ids, GenerateOptions)
#include <fmt/core.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "model/qwen35.h"
#include "tools/bench.h"

int main(int argc, char** argv) {
  std::string model_dir = std::string(MTPX_SOURCE_DIR) + "/models/default";
  std::string samples_file =
      std::string(MTPX_SOURCE_DIR) + "/tests/fixtures/trained_default/heldout_samples.json";
  int64_t tokens = 64, prompts = 20, max_draft = 4, draft_vocab = 0;
  int threads = 0, repeats = 3;
  CLI::App app{"mtpx AR vs MTP on a real model"};
  app.add_option("--model", model_dir);
  app.add_option("--samples", samples_file);
  app.add_option("--tokens", tokens)->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  app.add_option("--prompts", prompts)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::Range(1, 1024));
  app.add_option("--repeats", repeats)->check(CLI::Range(1, 1000));
  app.add_option("--max-draft", max_draft)->check(CLI::Range(int64_t{1}, int64_t{8}));
  app.add_option("--draft-vocab", draft_vocab)->check(CLI::PositiveNumber);
  if (const int code = mtpx::bench::parse_arguments(app, argc, argv); code >= 0) return code;
  if (threads > 0) omp_set_num_threads(threads);
  auto model = mtpx::Model::load(model_dir);
  model->use_device("cpu");  // the CPU kernels' weight tiles, before any timed pass

  mtpx::tools::BenchProtocol protocol;
  std::ifstream in(samples_file);
  const nlohmann::json samples = nlohmann::json::parse(in);
  for (const auto& s : samples["samples"])
    if (static_cast<int64_t>(protocol.prompts.size()) < prompts)
      protocol.prompts.push_back(s["prompt_ids"].get<std::vector<int32_t>>());
  protocol.max_tokens = tokens;
  protocol.runs = repeats;
  std::vector<mtpx::tools::BenchCase> cases;
  for (const auto& [name, sampler] :
       {std::pair{"greedy", mtpx::SamplerParams{.temperature = 0.0}},
        std::pair{"T0.7/p0.95/k20", mtpx::SamplerParams{.temperature = 0.7, .top_k = 20, .top_p = 0.95}}})
    for (int64_t k = 0; k <= max_draft; ++k) cases.push_back({name, sampler, k, k > 0 ? draft_vocab : 0});
  const auto results = mtpx::tools::run_bench(*model, protocol, cases);

  fmt::print("model {} | threads {} | {} prompts x {} tokens, median of {} repeats | draft vocabulary {}\n",
             model_dir, omp_get_max_threads(), protocol.prompts.size(), tokens, repeats,
             draft_vocab > 0 ? std::to_string(draft_vocab) : "all");
  fmt::print(
      "| sampler | K | tok/s | min-max | vs AR (paired) | acceptance | by position | tokens/step "
      "|\n|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : results) {
    const auto& ar = *std::find_if(results.begin(), results.end(), [&](const auto& x) {
      return x.spec.sampler_name == r.spec.sampler_name && x.spec.draft == 0;
    });
    std::vector<double> ratios;
    for (size_t i = 0; i < r.tok_s.size(); ++i) ratios.push_back(r.tok_s[i] / ar.tok_s[i]);
    std::string by_position;
    for (double a : r.acceptance_by_position) by_position += fmt::format("{:.2f} ", a);
    fmt::print("| {} | {} | {:.0f} | {:.0f}-{:.0f} | {:.2f} | {} | {}| {:.2f} |\n", r.spec.sampler_name,
               r.spec.draft ? std::to_string(r.spec.draft) : "AR", r.median_tok_s, r.min_tok_s, r.max_tok_s,
               mtpx::tools::median_of(ratios), r.spec.draft ? fmt::format("{:.3f}", r.mtp.acceptance()) : "-",
               by_position, r.tokens_per_step);
  }
  return 0;
}
