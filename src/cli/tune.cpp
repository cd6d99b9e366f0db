// mtpx tune: measure plain decoding and MTP at K = 1..max here, save the fastest K (if it beats plain
// decoding by the margin) as the model's runtime profile, with an SVG chart (tools/tune.h).
#include "tools/tune.h"

#include <fmt/core.h>

#include <cstdio>

#include "cli/commands.h"
#include "cli/common.h"
#include "io/model_config.h"
#include "tools/checkpoint.h"
#include "tools/progress.h"
#include "tools/prompts.h"
#include "tools/runtime_profile.h"
#include "util/error.h"

namespace mtpx::cli {
namespace {

struct TuneFlags {
  std::string model;
  tools::TuneOptions options;
  bool json = false;
  int threads = 0;
  std::string device = "cpu";
};

int run_tune(TuneFlags f) {
  set_threads(f.threads);
  const auto dir = resolve_model_dir(f.model);
  auto model = load_model_on(dir, f.device);
  if (model->mtp() == nullptr)
    invalid_input("tune: '{}' has no usable MTP head ({}); see mtpx inspect and mtpx graft", dir.string(),
                  model->mtp_status().detail);
  const auto tokenizer = load_tokenizer_if_present(dir);
  tools::TuneOptions& o = f.options;
  o.sampler = o.sampler_name == "default"
                  ? sampler_defaults(load_generation_config(dir / "generation_config.json"))
                  : SamplerParams{.temperature = 0.0};
  const auto prompts = tools::builtin_prompt_ids(tokenizer, model->config().vocab_size, o.prompts);
  tools::ProgressBar bar("tune");
  const nlohmann::json profile =
      tools::tune_draft_depth(*model, prompts, o, [&](double x) { bar.update(x); });
  bar.finish();
  const auto path = tools::save_runtime_profile(dir, profile, tools::profile_device(*model));
  auto svg = path;
  svg.replace_extension(".svg");
  tools::write_text_file(svg, tools::tune_chart_svg(profile));
  std::fprintf(stderr, "tune: wrote the profile to %s and its chart to %s\n", path.c_str(), svg.c_str());
  if (f.json) {
    fmt::print("{}\n", profile.dump(2));
    return 0;
  }
  fmt::print(
      "| K | draft vocabulary | tok/s (median) | min-max | vs plain | acceptance by position | tokens/step "
      "|\n|---|---|---|---|---|---|---|\n");
  for (const auto& e : profile["evidence"]) {
    std::string by_position;
    if (e.contains("acceptance_by_position"))
      for (double a : e["acceptance_by_position"]) by_position += fmt::format("{:.2f} ", a);
    const int64_t vocab = e.value("draft_vocab", int64_t{0});
    fmt::print(
        "| {} | {} | {:.1f} | {:.1f}-{:.1f} | {:.2f}x | {}| {} |\n",
        e["draft"].get<int64_t>() ? std::to_string(e["draft"].get<int64_t>()) : "plain",
        e["draft"].get<int64_t>() == 0 ? "-"
        : vocab > 0                    ? std::to_string(vocab)
                                       : "all",
        e["tok_s"].get<double>(), e["tok_s_min"].get<double>(), e["tok_s_max"].get<double>(),
        e["speedup"].get<double>(), by_position,
        e.contains("tokens_per_step") ? fmt::format("{:.2f}", e["tokens_per_step"].get<double>()) : "1.00");
  }
  std::string experts;
  for (const auto& e : profile["evidence"])
    if (e.contains("experts_per_layer_pass") && e.value("draft_vocab", int64_t{0}) == 0)
      experts += fmt::format("{}{} {:.1f}", experts.empty() ? "" : ", ",
                             e["draft"].get<int64_t>() > 0 ? fmt::format("K={}", e["draft"].get<int64_t>())
                                                           : std::string("plain"),
                             e["experts_per_layer_pass"].get<double>());
  if (!experts.empty()) fmt::print("distinct experts read per layer and decode pass: {}\n", experts);
  fmt::print("recommendation: {}\n", profile["recommendation"].get<std::string>());
  return 0;
}

}  // namespace

std::function<int()> add_tune_command(CLI::App& app) {
  auto f = std::make_shared<TuneFlags>();
  app.add_option("--model", f->model, "model directory (default: $MTPX_MODEL or the shipped model)");
  app.add_option("--max-draft", f->options.max_draft, "largest draft depth K to try")
      ->check(CLI::Range(int64_t{1}, int64_t{8}))
      ->capture_default_str();
  app.add_option("--sampler", f->options.sampler_name,
                 "greedy, or default (the model's generation_config sampler)")
      ->check(CLI::IsMember({"greedy", "default"}))
      ->capture_default_str();
  app.add_option("--max-tokens", f->options.max_tokens, "tokens per prompt")
      ->check(CLI::Range(int64_t{8}, int64_t{100000}))
      ->capture_default_str();
  app.add_option("--runs", f->options.runs, "measured runs")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--margin", f->options.margin, "fraction by which MTP must beat plain decoding")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--synthetic-acceptance", f->options.synthetic_acceptance,
                 "drafts right with this probability (random-weight models; greedy only)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option(
         "--draft-vocab", f->options.draft_vocabs,
         "draft vocabularies to try beside the whole one, comma-separated (0: none; default: 32768 for "
         "vocabularies of 131072 ids or more, half the vocabulary for 2048 or more)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_flag("--json", f->json, "print the profile as JSON");
  app.add_option("--threads", f->threads, "worker threads (default: all cores)")->check(CLI::Range(1, 1024));
  app.add_option("--device", f->device, "where the forward passes run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  return [f] { return run_tune(*f); };
}

}  // namespace mtpx::cli
