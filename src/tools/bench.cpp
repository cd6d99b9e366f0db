#include "tools/bench.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "util/error.h"

namespace mtpx::tools {

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<BenchResult> run_bench(const Model& model, const BenchProtocol& p,
                                   const std::vector<BenchCase>& cases,
                                   const std::function<void(double)>& progress) {
  if (p.prompts.empty()) invalid_input("bench: no prompts");
  if (p.runs < 1) invalid_input("bench: --runs must be at least 1");
  const bool synthetic = p.synthetic_acceptance >= 0.0;
  if (synthetic && p.synthetic_acceptance > 1.0) invalid_input("--synthetic-acceptance must be in [0, 1]");
  for (const BenchCase& c : cases)
    if (synthetic && c.sampler.temperature > 0.0)
      invalid_input(
          "--synthetic-acceptance measures greedy decoding only (the drafts follow the greedy output)");

  auto options_for = [&](const BenchCase& c, size_t prompt, int64_t max_tokens) {
    GenerateOptions o;
    o.max_tokens = max_tokens;
    o.sampler = c.sampler;
    o.seed = p.seed + prompt;
    o.draft = c.draft;
    o.draft_vocab = c.draft_vocab;
    o.stop_ids = p.stop_ids;
    return o;
  };

  // Synthetic acceptance needs each prompt's greedy continuation (the output MTP must reproduce).
  std::vector<std::vector<int32_t>> greedy_continuation(p.prompts.size());
  if (synthetic)
    for (size_t i = 0; i < p.prompts.size(); ++i)
      greedy_continuation[i] =
          generate(model, p.prompts[i],
                   options_for({"greedy", SamplerParams{.temperature = 0.0}, 0}, i, p.max_tokens))
              .tokens;

  if (p.warmup) {
    for (const BenchCase& c : cases)
      generate(model, p.prompts[0], options_for(c, 0, std::min<int64_t>(p.max_tokens, 16)));
  }

  std::vector<BenchResult> results(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    results[i].spec = cases[i];
    const size_t k = static_cast<size_t>(std::max<int64_t>(cases[i].draft, 1));
    results[i].mtp.draft = cases[i].draft;
    results[i].mtp.drafted_by_position.assign(k, 0);
    results[i].mtp.accepted_by_position.assign(k, 0);
  }
  const int most_runs = std::max(p.runs, p.max_runs);
  const double total_steps = static_cast<double>(most_runs) * static_cast<double>(cases.size());
  std::vector<int64_t> produced_first_run(cases.size(), 0);
  // Whether adding each of the last two runs moved every case's median by at most the tolerance.
  auto medians_settled = [&] {
    for (const BenchResult& r : results) {
      const size_t n = r.tok_s.size();
      if (n < 3) return false;
      const double now = median_of(r.tok_s);
      const double before = median_of({r.tok_s.begin(), r.tok_s.end() - 1});
      const double before_that = median_of({r.tok_s.begin(), r.tok_s.end() - 2});
      if (std::abs(now - before) > p.settle_tolerance * now ||
          std::abs(before - before_that) > p.settle_tolerance * now)
        return false;
    }
    return true;
  };
  for (int run = 0; run < most_runs; ++run) {
    if (run >= p.runs && medians_settled()) break;
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const BenchCase& c = cases[ci];
      BenchResult& r = results[ci];
      double seconds = 0.0;
      int64_t tokens = 0;
      for (size_t pi = 0; pi < p.prompts.size(); ++pi) {
        GenerateOptions o = options_for(c, pi, p.max_tokens);
        std::mt19937_64 coin(p.seed * 7919 + pi * 104729 + static_cast<uint64_t>(run));
        if (synthetic && c.draft > 0) {
          const std::vector<int32_t>& truth = greedy_continuation[pi];
          const size_t prompt_len = p.prompts[pi].size();
          const int64_t vocab = model.config().vocab_size;
          o.draft_hook = [&, prompt_len, vocab](std::span<const int32_t> context,
                                                std::vector<int32_t>& drafts) {
            std::bernoulli_distribution accept(p.synthetic_acceptance);
            const size_t done = context.size() - prompt_len;
            for (size_t d = 0; d < drafts.size(); ++d) {
              const size_t at = done + d;
              const int32_t right = at < truth.size() ? truth[at] : 0;
              drafts[d] = accept(coin) ? right : static_cast<int32_t>((right + 1) % vocab);
            }
          };
        }
        const GenerateResult g = generate(model, p.prompts[pi], o);
        seconds += g.stats.decode_seconds;
        tokens += g.stats.generated_tokens - 1;
        if (run == 0) {
          MtpStats& m = r.mtp;
          m.steps += g.stats.mtp.steps;
          m.drafted += g.stats.mtp.drafted;
          m.accepted += g.stats.mtp.accepted;
          for (size_t d = 0; d < g.stats.mtp.drafted_by_position.size(); ++d) {
            m.drafted_by_position[d] += g.stats.mtp.drafted_by_position[d];
            m.accepted_by_position[d] += g.stats.mtp.accepted_by_position[d];
          }
          produced_first_run[ci] += g.stats.generated_tokens - 1;
          r.draws_below += g.stats.draws_below;
          r.logit_rows_fetched += g.stats.logit_rows_fetched;
          r.logit_values_fetched += g.stats.logit_values_fetched;
          const ExpertTraffic& e = g.stats.decode_experts;
          r.decode_experts.blocks += e.blocks, r.decode_experts.rows += e.rows;
          r.decode_experts.expert_reads += e.expert_reads;
          r.decode_experts.max_per_block = std::max(r.decode_experts.max_per_block, e.max_per_block);
        }
      }
      r.tok_s.push_back(seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0);
      if (progress)
        progress((run * static_cast<double>(cases.size()) + static_cast<double>(ci) + 1) / total_steps);
    }
  }
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    BenchResult& r = results[ci];
    r.median_tok_s = median_of(r.tok_s);
    r.min_tok_s = *std::min_element(r.tok_s.begin(), r.tok_s.end());
    r.max_tok_s = *std::max_element(r.tok_s.begin(), r.tok_s.end());
    if (r.spec.draft > 0) {
      r.tokens_per_step = r.mtp.steps > 0
                              ? static_cast<double>(produced_first_run[ci]) / static_cast<double>(r.mtp.steps)
                              : 1.0;
      r.acceptance_by_position = r.mtp.acceptance_by_position();
    }
  }
  return results;
}

}  // namespace mtpx::tools
