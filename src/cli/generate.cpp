// mtpx generate: prompt in, text (streamed) or JSON out.
#include "decode/generate.h"

#include <fmt/core.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/commands.h"
#include "cli/common.h"
#include "io/model_config.h"
#include "model/qwen35.h"
#include "tools/runtime_profile.h"
#include "util/error.h"

namespace mtpx::cli {
namespace {

struct GenerateFlags {
  std::string model;
  std::string prompt;
  std::string prompt_ids;
  int64_t max_tokens = 128;
  std::optional<double> temperature;
  std::optional<int64_t> top_k;
  std::optional<double> top_p;
  std::optional<double> min_p;
  uint64_t seed = 0;
  int threads = 0;
  std::string device = "cpu";
  int64_t samples = 1;
  bool json = false;
  bool mtp = false;
  std::optional<int64_t> draft;
  std::optional<int64_t> draft_vocab;
};

nlohmann::json mtp_json(const MtpStats& m) {
  return {{"draft", m.draft},
          {"draft_vocab", m.draft_vocab},
          {"steps", m.steps},
          {"drafted", m.drafted},
          {"accepted", m.accepted},
          {"acceptance", m.acceptance()},
          {"acceptance_by_position", m.acceptance_by_position()},
          {"mean_accepted_per_step", m.mean_accepted_per_step()}};
}

nlohmann::json result_json(const GenerateResult& r, const std::string& text, const Model& model) {
  nlohmann::json stats = {{"prompt_tokens", r.stats.prompt_tokens},
                          {"generated_tokens", r.stats.generated_tokens},
                          {"prefill_tok_s", r.stats.prefill_tok_s()},
                          {"decode_tok_s", r.stats.decode_tok_s()},
                          {"peak_rss_bytes", peak_rss_bytes()}};
  if (r.stats.mtp.draft > 0) stats["mtp"] = mtp_json(r.stats.mtp);
  if (r.stats.decode_experts.blocks > 0)
    stats["experts"] = {{"per_token", model.config().num_experts_per_tok},
                        {"per_layer_decode_pass", r.stats.decode_experts.experts_per_block()},
                        {"max_per_layer_decode_pass", r.stats.decode_experts.max_per_block}};
  stats.update(device_memory_json(model));
  return {{"tokens", r.tokens}, {"text", text}, {"finish_reason", r.finish_reason}, {"stats", stats}};
}

int run_generate(const GenerateFlags& f) {
  set_threads(f.threads);
  const auto dir = resolve_model_dir(f.model);
  auto model = load_model_on(dir, f.device);
  auto tokenizer = load_tokenizer_if_present(dir);
  const std::string paging = paging_note(*model);
  if (!paging.empty()) std::fprintf(stderr, "note: %s\n", paging.c_str());

  const std::vector<int32_t> prompt =
      resolve_prompt(f.prompt, f.prompt_ids, tokenizer, dir, model->config().vocab_size);

  // Sampler: generation_config.json defaults (greedy when do_sample is false), flags override.
  const GenerationConfig gen = load_generation_config(dir / "generation_config.json");
  GenerateOptions options;
  options.max_tokens = f.max_tokens;
  options.sampler = sampler_defaults(gen);
  if (f.temperature) options.sampler.temperature = *f.temperature;
  if (f.top_k) options.sampler.top_k = *f.top_k;
  if (f.top_p) options.sampler.top_p = *f.top_p;
  if (f.min_p) options.sampler.min_p = *f.min_p;
  validate(options.sampler);
  if (f.mtp) {
    if (model->mtp() == nullptr)
      invalid_input("--mtp: '{}' has no usable MTP head: {}", dir.string(), model->mtp_status().detail);
    // K and the draft vocabulary: the flags; else the tuned runtime profile's (mtpx tune); else kDefaultDraft
    // and all.
    const tools::TunedDecoding d =
        tools::decoding_or_default(tools::tuned_decoding(dir, tools::profile_device(*model)));
    options.draft = f.draft.value_or(d.draft);
    options.draft_vocab = f.draft_vocab.value_or(d.draft_vocab);
  }
  options.stop_ids = gen.eos_token_ids;
  for (int32_t id : model->config().eos_token_ids) options.stop_ids.push_back(id);
  if (tokenizer) options.vocab_limit = tokenizer->vocab_size();

  auto is_stop = [&](int32_t id) {
    return std::find(options.stop_ids.begin(), options.stop_ids.end(), id) != options.stop_ids.end();
  };
  auto text_of = [&](const std::vector<int32_t>& tokens) {
    if (!tokenizer) return std::string();
    std::vector<int32_t> shown(tokens);
    if (!shown.empty() && is_stop(shown.back())) shown.pop_back();
    return tokenizer->decode(shown);
  };

  nlohmann::json all = nlohmann::json::array();
  for (int64_t s = 0; s < f.samples; ++s) {
    options.seed = f.seed + static_cast<uint64_t>(s);
    std::optional<StreamDecoder> stream;
    if (!f.json && tokenizer) stream.emplace(*tokenizer);
    auto on_token = [&](int32_t id) {
      if (f.json) return;
      if (stream) {
        if (!is_stop(id)) std::fputs(stream->push(id).c_str(), stdout);
      } else {
        std::printf("%d ", id);
      }
      std::fflush(stdout);
    };
    GenerateResult r = generate(*model, prompt, options, on_token);
    if (f.json) {
      all.push_back(result_json(r, text_of(r.tokens), *model));
    } else {
      if (stream) std::fputs(stream->flush().c_str(), stdout);
      std::printf("\n");
      std::fflush(stdout);
      std::string mtp;
      if (r.stats.mtp.draft > 0)
        mtp = fmt::format(" | MTP K={} acceptance {:.1f}%, {:.2f} tokens/step", r.stats.mtp.draft,
                          100 * r.stats.mtp.acceptance(),
                          r.stats.mtp.steps > 0 ? static_cast<double>(r.stats.generated_tokens - 1) /
                                                      static_cast<double>(r.stats.mtp.steps)
                                                : 0.0);
      std::fprintf(stderr,
                   "[prompt %lld tok, prefill %.1f tok/s | generated %lld tok, decode %.1f tok/s%s | peak "
                   "RSS %.0f MiB%s%s]\n",
                   static_cast<long long>(r.stats.prompt_tokens), r.stats.prefill_tok_s(),
                   static_cast<long long>(r.stats.generated_tokens), r.stats.decode_tok_s(), mtp.c_str(),
                   static_cast<double>(peak_rss_bytes()) / (1 << 20), device_memory_text(*model).c_str(),
                   paging.empty() ? "" : " | weights larger than memory, paged from the files");
    }
  }
  // Text cut inside a UTF-8 character (max-tokens reached mid-character) is printed with U+FFFD.
  if (f.json)
    std::printf("%s\n", (f.samples == 1 ? all[0] : all)
                            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                            .c_str());
  return 0;
}

}  // namespace

std::function<int()> add_generate_command(CLI::App& app) {
  auto f = std::make_shared<GenerateFlags>();
  app.add_option("--model", f->model, "model directory (default: $MTPX_MODEL or the shipped model)");
  app.add_option("--prompt", f->prompt, "prompt text");
  app.add_option("--prompt-ids", f->prompt_ids, "prompt as comma-separated token ids");
  app.add_option("--max-tokens", f->max_tokens, "most tokens to generate")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--temperature", f->temperature,
                 "sampling temperature (0: greedy; default: the model's generation_config.json)")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--top-k", f->top_k,
                 "keep the k most likely tokens (0: off; default: generation_config.json's)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 22));
  app.add_option("--top-p", f->top_p, "nucleus sampling mass (1: off; default: generation_config.json's)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option(
         "--min-p", f->min_p,
         "drop tokens below min-p times the top probability (0: off; default: generation_config.json's)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", f->seed, "random seed (sample i uses seed + i)")->capture_default_str();
  app.add_option("--threads", f->threads, "worker threads (default: all cores)")->check(CLI::Range(1, 1024));
  app.add_option("--device", f->device, "where the forward passes run: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--samples", f->samples, "independent completions to draw")
      ->check(CLI::Range(int64_t{1}, int64_t{100000}))
      ->capture_default_str();
  app.add_flag("--json", f->json, "print one JSON object (a list with --samples > 1)");
  app.add_flag_callback(
      "--mtp", [f] { f->mtp = true; },
      "speculative decoding with the model's MTP head (default: plain decoding)");
  app.add_flag_callback(
      "--no-mtp", [f] { f->mtp = false; }, "plain decoding (the default)");
  app.add_option("--draft", f->draft,
                 fmt::format("MTP draft depth K (default: the tuned profile's, else {})", kDefaultDraft))
      ->check(CLI::Range(int64_t{1}, kMaxDraft));
  app.add_option("--draft-vocab", f->draft_vocab,
                 "MTP drafts only from the first N token ids (the head's lm_head pass reads N rows; exact at "
                 "any N)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  return [f] { return run_generate(*f); };
}

}  // namespace mtpx::cli
