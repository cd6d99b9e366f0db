// mtpx bench: the published speed protocol (tools/bench.h) on one model: a fixed prompt, one warm-up,
// N runs, median and spread; plain decoding and MTP paired in the same run, greedy and with the model's
// default sampler; peak memory. --synthetic-acceptance A measures speculative speed at a chosen
// acceptance on models whose head is random (synth checkpoints).
#include "tools/bench.h"

#include <fmt/core.h>
#include <omp.h>

#include <nlohmann/json.hpp>
#include <optional>

#include "cli/commands.h"
#include "cli/common.h"
#include "io/model_config.h"
#include "tools/progress.h"
#include "tools/prompts.h"
#include "tools/runtime_profile.h"
#include "util/error.h"

namespace mtpx::cli {
namespace {

struct BenchFlags {
  std::string model;
  std::string prompt;
  std::string prompt_ids;
  int64_t max_tokens = 400;
  std::optional<int> runs;      // exactly this many (unless --max-runs says more)
  std::optional<int> max_runs;  // else at least kMinRuns, then until the medians settle, at most this
  std::optional<int64_t> draft;
  std::optional<int64_t> draft_vocab;
  double synthetic_acceptance = -1.0;
  bool json = false;
  int threads = 0;
  std::string device = "cpu";
  uint64_t seed = 0;
};

// Without --runs: at least this many runs, then more until every median settles (at most kMaxRuns).
constexpr int kMinRuns = 7;
constexpr int kMaxRuns = 25;

int run_bench_command(const BenchFlags& f) {
  set_threads(f.threads);
  const auto dir = resolve_model_dir(f.model);
  auto model = load_model_on(dir, f.device);
  const auto tokenizer = load_tokenizer_if_present(dir);
  std::vector<int32_t> prompt;
  if (f.prompt.empty() && f.prompt_ids.empty())
    prompt = tools::builtin_prompt_ids(tokenizer, model->config().vocab_size, 1)[0];
  else
    prompt = resolve_prompt(f.prompt, f.prompt_ids, tokenizer, dir, model->config().vocab_size);

  const GenerationConfig gen = load_generation_config(dir / "generation_config.json");
  const tools::TunedDecoding tuned =
      tools::decoding_or_default(tools::tuned_decoding(dir, tools::profile_device(*model)));
  int64_t draft = f.draft.value_or(tuned.draft);
  const int64_t draft_vocab = f.draft_vocab.value_or(tuned.draft_vocab);
  const bool mtp = model->mtp() != nullptr;
  if (f.draft && !mtp)
    invalid_input("--draft: '{}' has no usable MTP head: {}", dir.string(), model->mtp_status().detail);

  std::vector<tools::BenchCase> cases = {{"greedy", SamplerParams{.temperature = 0.0}, 0}};
  if (mtp) cases.push_back({"greedy", SamplerParams{.temperature = 0.0}, draft, draft_vocab});
  const SamplerParams s = sampler_defaults(gen);
  if (!s.greedy() && f.synthetic_acceptance < 0) {
    cases.push_back({"default", s, 0});
    if (mtp) cases.push_back({"default", s, draft, draft_vocab});
  }
  tools::BenchProtocol protocol;
  protocol.prompts = {prompt};
  protocol.max_tokens = f.max_tokens;
  protocol.runs = f.runs.value_or(kMinRuns);
  protocol.max_runs = f.max_runs.value_or(f.runs ? *f.runs : kMaxRuns);
  protocol.seed = f.seed;
  if (protocol.max_runs < protocol.runs)
    invalid_input("--max-runs ({}) must be at least --runs ({})", protocol.max_runs, protocol.runs);
  protocol.synthetic_acceptance = f.synthetic_acceptance;
  if (f.synthetic_acceptance >= 0 && !mtp)
    invalid_input("--synthetic-acceptance: '{}' has no MTP head to draft with", dir.string());

  tools::ProgressBar bar("bench");
  const auto results = tools::run_bench(*model, protocol, cases, [&](double x) { bar.update(x); });
  bar.finish();

  // Why the runs stopped: the number asked for, every median settled, or the most runs allowed.
  const int runs_done = static_cast<int>(results.front().tok_s.size());
  const std::string stop = protocol.max_runs == protocol.runs ? "runs"
                           : runs_done < protocol.max_runs    ? "settled"
                                                              : "max_runs";
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& r : results) {
    const auto& ar = *std::find_if(results.begin(), results.end(), [&](const tools::BenchResult& x) {
      return x.spec.sampler_name == r.spec.sampler_name && x.spec.draft == 0;
    });
    nlohmann::json row = {{"sampler", r.spec.sampler_name},
                          {"draft", r.spec.draft},
                          {"tok_s_median", r.median_tok_s},
                          {"tok_s_min", r.min_tok_s},
                          {"tok_s_max", r.max_tok_s},
                          {"tok_s_runs", r.tok_s},
                          {"spread", (r.max_tok_s - r.min_tok_s) / r.median_tok_s},
                          {"speedup_vs_plain", r.median_tok_s / ar.median_tok_s}};
    if (r.spec.draft > 0) {
      row["acceptance"] = r.mtp.acceptance();
      row["acceptance_by_position"] = r.acceptance_by_position;
      row["tokens_per_step"] = r.tokens_per_step;
    }
    // A MoE trunk: the distinct experts a decode pass reads per layer (k for one row; a verify window of
    // K+1 rows reads up to (K+1) k, and that is its cost over a decode step).
    if (r.decode_experts.blocks > 0) row["experts_per_layer_pass"] = r.decode_experts.experts_per_block();
    rows.push_back(row);
  }
  nlohmann::json report = {
      {"model", dir.string()},
      {"protocol",
       {{"prompt_tokens", prompt.size()},
        {"max_tokens", f.max_tokens},
        {"runs", runs_done},
        {"min_runs", protocol.runs},
        {"max_runs", protocol.max_runs},
        {"stopped_by", stop},
        {"warmup", true},
        {"statistic", "median over runs of decode tok/s (tokens after the first / decode seconds)"},
        {"synthetic_acceptance",
         f.synthetic_acceptance >= 0 ? nlohmann::json(f.synthetic_acceptance) : nlohmann::json()}}},
      {"threads", omp_get_max_threads()},
      {"results", rows},
      {"peak_rss_bytes", peak_rss_bytes()}};
  report.update(device_memory_json(*model));
  if (f.json) {
    fmt::print("{}\n", report.dump(2));
    return 0;
  }
  fmt::print("mtpx bench | {} | prompt {} tokens, {} new tokens, median of {} runs ({}){}\n", dir.string(),
             prompt.size(), f.max_tokens, runs_done,
             stop == "runs"      ? "as asked"
             : stop == "settled" ? "each median settled within 1%"
                                 : "the most allowed; medians still moving",
             f.synthetic_acceptance >= 0
                 ? fmt::format(", synthetic acceptance {:.2f}", f.synthetic_acceptance)
                 : "");
  fmt::print(
      "| sampler | decoding | tok/s (median) | min-max | spread | vs plain | acceptance | by position | "
      "tokens/step |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& row : rows) {
    std::string by_position;
    if (row.contains("acceptance_by_position"))
      for (double a : row["acceptance_by_position"]) by_position += fmt::format("{:.2f} ", a);
    fmt::print(
        "| {} | {} | {:.1f} | {:.1f}-{:.1f} | {:.0f}% | {:.2f}x | {} | {}| {} |\n",
        row["sampler"].get<std::string>(),
        row["draft"].get<int64_t>() > 0 ? fmt::format("MTP K={}", row["draft"].get<int64_t>()) : "plain",
        row["tok_s_median"].get<double>(), row["tok_s_min"].get<double>(), row["tok_s_max"].get<double>(),
        100.0 * row["spread"].get<double>(), row["speedup_vs_plain"].get<double>(),
        row.contains("acceptance") ? fmt::format("{:.3f}", row["acceptance"].get<double>()) : "-",
        by_position,
        row.contains("tokens_per_step") ? fmt::format("{:.2f}", row["tokens_per_step"].get<double>())
                                        : "1.00");
  }
  std::string experts;
  for (const auto& row : rows)
    if (row.contains("experts_per_layer_pass"))
      experts +=
          fmt::format("{}{} {:.1f}", experts.empty() ? "" : ", ",
                      row["draft"].get<int64_t>() > 0 ? fmt::format("K={}", row["draft"].get<int64_t>())
                                                      : std::string("plain"),
                      row["experts_per_layer_pass"].get<double>());
  if (!experts.empty())
    fmt::print("distinct experts read per layer and decode pass ({} per token): {}\n",
               model->config().num_experts_per_tok, experts);
  fmt::print("peak memory {:.1f} MiB{}\n", static_cast<double>(peak_rss_bytes()) / (1 << 20),
             device_memory_text(*model));
  return 0;
}

}  // namespace

std::function<int()> add_bench_command(CLI::App& app) {
  auto f = std::make_shared<BenchFlags>();
  app.add_option("--model", f->model, "model directory (default: $MTPX_MODEL or the shipped model)");
  app.add_option("--prompt", f->prompt, "prompt text (default: the built-in prompt)");
  app.add_option("--prompt-ids", f->prompt_ids, "prompt as comma-separated token ids");
  app.add_option("--max-tokens", f->max_tokens, "tokens to generate per run")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--runs", f->runs,
                 fmt::format("measured runs after one warm-up (default: at least {}, then until every median "
                             "moves by under 1% per run, at most {})",
                             kMinRuns, kMaxRuns))
      ->check(CLI::Range(1, 1000));
  app.add_option("--max-runs", f->max_runs,
                 "with --runs: keep going until the medians settle, up to this many")
      ->check(CLI::Range(1, 1000));
  app.add_option("--draft", f->draft,
                 fmt::format("MTP draft depth K (default: the tuned profile's, else {})", kDefaultDraft))
      ->check(CLI::Range(int64_t{1}, int64_t{8}));
  app.add_option("--draft-vocab", f->draft_vocab,
                 "MTP drafts only from the first N token ids (the head's lm_head pass reads N rows; exact at "
                 "any N)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--synthetic-acceptance", f->synthetic_acceptance,
                 "replace the head's drafts by the right token with this probability (greedy only)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_flag("--json", f->json, "print the report as JSON");
  app.add_option("--seed", f->seed, "sampling seed")->capture_default_str();
  app.add_option("--threads", f->threads, "worker threads (default: all cores)")->check(CLI::Range(1, 1024));
  app.add_option("--device", f->device, "where the forward passes run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  return [f] { return run_bench_command(*f); };
}

}  // namespace mtpx::cli
