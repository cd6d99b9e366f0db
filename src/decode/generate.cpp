#include "decode/generate.h"

#include <algorithm>
#include <chrono>

#include "decode/speculative.h"
#include "util/error.h"

namespace mtpx {

GenerateResult generate(const Model& model, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  if (prompt.empty()) invalid_input("the prompt is empty");
  if (options.max_tokens < 0) invalid_input("max-tokens must be >= 0, got {}", options.max_tokens);
  validate(options.sampler);
  if (options.draft > 0) return generate_speculative(model, prompt, options, on_token);
  const int64_t vocab_limit = options.vocab_limit > 0
                                  ? std::min(options.vocab_limit, model.config().vocab_size)
                                  : model.config().vocab_size;

  GenerateResult result;
  result.finish_reason = "length";
  result.stats.prompt_tokens = static_cast<int64_t>(prompt.size());
  if (options.max_tokens == 0) return result;

  InferenceState state = model.new_state(static_cast<int64_t>(prompt.size()) + options.max_tokens);
  Rng rng(options.seed);
  ForwardResult forward;

  // Greedy: the pass's own argmax (on a device only that id is copied back), the one-hot truncate() gives.
  const int64_t argmax_limit = options.sampler.greedy() ? vocab_limit : 0;
  // Sampling: on a device only each row's candidates come back where they decide the truncation (device.h).
  // A row sampled whole (temperature alone), or whose top-p prefix ends below its top ids, comes back as
  // those and the mass kept below them; a draw that lands below them is drawn on the device (sampler.h:
  // below_draw()).
  const CandidateRequest sample_request = candidate_request(options.sampler, vocab_limit, true);
  auto t0 = Clock::now();
  trunk_forward(model, options,
                {.state = &state,
                 .tokens = prompt,
                 .rows = LogitRows::kLast,
                 .result = &forward,
                 .argmax_limit = argmax_limit,
                 .sample = sample_request});
  auto next = [&]() {
    if (argmax_limit > 0) return sample(one_hot(forward.argmax[0]), rng);
    if (forward.candidates.present()) {
      const TokenDistribution d = truncate_candidates(
          forward.candidates.row_ids(0), forward.candidates.row_logits(0), options.sampler,
          forward.candidates.row_rest_mass(0), forward.candidates.row_kept_below(0));
      const double u = rng.uniform();
      if (const std::optional<int32_t> id = draw(d, u)) return *id;
      ++result.stats.draws_below;  // below the row's top ids: drawn on the device
      BelowDraw below = below_draw(d, u);
      below.limit = vocab_limit;
      return model.draw_below(state, 0, below);
    }
    // A device sends the row whole where its candidates do not decide the truncation (model/device.h).
    if (sample_request.active() && model.executor() != nullptr) ++result.stats.logit_rows_fetched;
    return sample(truncate(forward.logits, options.sampler, vocab_limit), rng);
  };
  int32_t token = next();
  result.stats.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const ExpertTraffic prompt_experts = state.expert_traffic();

  auto t1 = Clock::now();
  while (true) {
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) != options.stop_ids.end()) {
      result.finish_reason = "stop";
      break;
    }
    if (static_cast<int64_t>(result.tokens.size()) >= options.max_tokens) break;
    if (options.cancelled && options.cancelled()) {
      result.finish_reason = "cancelled";
      break;
    }
    trunk_forward(model, options,
                  {.state = &state,
                   .tokens = std::span<const int32_t>(&token, 1),
                   .rows = LogitRows::kLast,
                   .result = &forward,
                   .argmax_limit = argmax_limit,
                   .sample = sample_request});
    ++result.stats.decode_steps;
    token = next();
  }
  result.stats.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  result.stats.generated_tokens = static_cast<int64_t>(result.tokens.size());
  result.stats.decode_experts = traffic_since(state.expert_traffic(), prompt_experts);
  return result;
}

}  // namespace mtpx
