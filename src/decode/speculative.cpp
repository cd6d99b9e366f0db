#include "decode/speculative.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <unordered_map>

#include "model/mtp_head.h"
#include "model/qwen35.h"
#include "util/error.h"

namespace mtpx {

static_assert(kMaxDraft <= kKeptLogitRows, "a slot per draft for the head's rows kept on a device");

TokenDistribution residual_distribution(const TokenDistribution& p, const TokenDistribution& q) {
  // q's probability by id: a hash map for truncated rows, a dense table for rows sampled whole (a map of
  // 248,320 entries took milliseconds).
  constexpr size_t kDenseFrom = 4096;
  std::unordered_map<int32_t, float> q_map;
  std::vector<float> q_dense;
  if (q.ids.size() < kDenseFrom) {
    q_map.reserve(q.ids.size());
    for (size_t i = 0; i < q.ids.size(); ++i) q_map[q.ids[i]] = q.probs[i];
  } else {
    q_dense.assign(static_cast<size_t>(*std::max_element(q.ids.begin(), q.ids.end())) + 1, 0.0f);
    for (size_t i = 0; i < q.ids.size(); ++i) q_dense[static_cast<size_t>(q.ids[i])] = q.probs[i];
  }
  auto q_prob = [&](int32_t id) -> double {
    if (q_dense.empty()) {
      auto it = q_map.find(id);
      return it == q_map.end() ? 0.0 : it->second;
    }
    return static_cast<size_t>(id) < q_dense.size() ? q_dense[static_cast<size_t>(id)] : 0.0;
  };
  TokenDistribution r;
  double total = 0.0;
  for (size_t i = 0; i < p.ids.size(); ++i) {
    const double diff = static_cast<double>(p.probs[i]) - q_prob(p.ids[i]);
    if (diff > 0.0) {
      r.ids.push_back(p.ids[i]);
      r.probs.push_back(static_cast<float>(diff));
      total += diff;
    }
  }
  if (total <= 0.0) return p;  // p == q: a rejection had probability 0, any token of p is exact
  for (float& x : r.probs) x = static_cast<float>(x / total);
  return r;
}

double SampledRow::prob(int32_t id) const {
  const float p = listed.prob(id);
  if (p > 0.0f || listed.unlisted <= 0.0) return p;
  if (logit) return listed.prob_of_logit(logit(id));
  return listed_whole().prob(id);
}

int32_t SampledRow::draw(double u) const {
  if (const std::optional<int32_t> id = mtpx::draw(listed, u)) return *id;
  if (draw_below) return draw_below(below_draw(listed, u));
  return *mtpx::draw(listed_whole(), u);
}

const TokenDistribution& SampledRow::listed_whole() const {
  if (listed.unlisted <= 0.0) return listed;
  if (!whole) fail(ErrorKind::kInternal, "accept_drafts: a row listed in part and no way to complete it");
  return whole();
}

int32_t draw_residual(const SampledRow& p, const SampledRow& q, Rng& rng) {
  if (p.listed.unlisted <= 0.0 && q.listed.unlisted <= 0.0)
    return sample(residual_distribution(p.listed, q.listed), rng);
  for (int i = 0; i < kResidualProposals; ++i) {
    const int32_t y = p.draw(rng.uniform());
    const double py = p.prob(y), qy = q.prob(y);
    if (rng.uniform() * py < py - qy) return y;  // u < 1 - q(y) / p(y), without dividing
  }
  return sample(residual_distribution(p.listed_whole(), q.listed_whole()), rng);
}

std::vector<int32_t> accept_drafts(std::span<const int32_t> drafts,
                                   std::span<const TokenDistribution> draft_dists,
                                   std::span<const TokenDistribution> target_dists, Rng& rng,
                                   const RowsBelow& below) {
  if (draft_dists.size() != drafts.size() || target_dists.size() != drafts.size() + 1)
    fail(ErrorKind::kInternal, "accept_drafts: {} drafts, {} draft and {} target distributions",
         drafts.size(), draft_dists.size(), target_dists.size());
  auto row = [&](bool target, size_t i) {
    SampledRow r{target ? target_dists[i] : draft_dists[i], {}, {}, {}};
    if (below.logit) r.logit = [&below, target, i](int32_t id) { return below.logit(target, i, id); };
    if (below.draw)
      r.draw_below = [&below, target, i](const BelowDraw& d) { return below.draw(target, i, d); };
    if (below.whole)
      r.whole = [&below, target, i]() -> const TokenDistribution& { return below.whole(target, i); };
    return r;
  };
  std::vector<int32_t> emitted;
  for (size_t i = 0; i < drafts.size(); ++i) {
    const SampledRow p_row = row(true, i), q_row = row(false, i);
    const double p = p_row.prob(drafts[i]);
    const double q = q_row.prob(drafts[i]);  // > 0: the draft was sampled from q
    if (rng.uniform() * q < p) {             // u < min(1, p/q), without dividing
      emitted.push_back(drafts[i]);          // accepted
      continue;
    }
    emitted.push_back(draw_residual(p_row, q_row, rng));
    return emitted;  // recovered
  }
  emitted.push_back(row(true, drafts.size()).draw(rng.uniform()));  // bonus
  return emitted;
}

GenerateResult generate_speculative(const Model& model, std::span<const int32_t> prompt,
                                    const GenerateOptions& options,
                                    const std::function<void(int32_t)>& on_token) {
  using Clock = std::chrono::steady_clock;
  const int64_t K = options.draft;
  if (K < 1 || K > kMaxDraft) invalid_input("--draft must be in [1, {}], got {}", kMaxDraft, K);
  if (model.mtp() == nullptr)
    invalid_input("--mtp: the model has no usable MTP head ({})", model.mtp_status().detail);
  const ModelConfig& c = model.config();
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const int64_t vocab_limit = options.vocab_limit > 0 ? std::min(options.vocab_limit, V) : V;
  const int64_t n = static_cast<int64_t>(prompt.size());

  GenerateResult result;
  result.finish_reason = "length";
  result.stats.prompt_tokens = n;
  result.stats.mtp.draft = K;
  result.stats.mtp.drafted_by_position.assign(static_cast<size_t>(K), 0);
  result.stats.mtp.accepted_by_position.assign(static_cast<size_t>(K), 0);
  if (options.max_tokens == 0) return result;

  const int64_t capacity = n + options.max_tokens + K + 2;
  InferenceState state = model.new_state(capacity);
  MtpState head_state = new_mtp_state(model, capacity);
  Rng rng(options.seed);
  auto distribution = [&](const float* logits) {
    return truncate(std::span<const float>(logits, static_cast<size_t>(V)), options.sampler, vocab_limit);
  };
  // Drafts come from the head's logits over the draft vocabulary (ids < draft_ids) through the same
  // truncation. That q is exactly the distribution each draft is sampled from, and accept_drafts needs
  // nothing more of q for the output to follow the target p exactly (a token q cannot propose is reached
  // through the residual); a smaller draft vocabulary changes only how often drafts are accepted.
  if (options.draft_vocab < 0) invalid_input("--draft-vocab must be positive, got {}", options.draft_vocab);
  const int64_t draft_ids = options.draft_vocab > 0 ? std::min(options.draft_vocab, vocab_limit) : V;
  const int64_t head_logit_ids = draft_ids < V ? draft_ids : 0;  // 0: the head computes all V logits
  result.stats.mtp.draft_vocab = head_logit_ids;
  auto draft_distribution = [&](const float* logits) {
    return truncate(std::span<const float>(logits, static_cast<size_t>(draft_ids)), options.sampler,
                    std::min(draft_ids, vocab_limit));
  };
  // Greedy: truncate() of a row is the one-hot of its argmax, so the passes return their rows' argmax
  // (the same function, computed where the logits are: a device copies one id per row, not V floats).
  const bool greedy = options.sampler.greedy();
  const int64_t target_argmax = greedy ? vocab_limit : 0,
                draft_argmax = greedy ? std::min(draft_ids, vocab_limit) : 0;
  // Sampling: a device returns each row's candidates instead of the row where they decide its truncation
  // (the same truncation, truncate_candidates); the CPU returns the logits. A row sampled whole (temperature
  // alone), or whose top-p prefix ends below its top ids, comes back as those and the mass kept below,
  // listed in part: the trunk's rows stay on the device
  // until the next pass, each head row is kept there in its draft's slot (the next pass overwrites the
  // head's logits), and accept_drafts reaches below their top ids through `below`.
  const CandidateRequest target_request = candidate_request(options.sampler, vocab_limit, true),
                         draft_request =
                             candidate_request(options.sampler, std::min(draft_ids, vocab_limit), true);
  auto target_row = [&](const ForwardResult& r, int64_t row) {
    if (greedy) return one_hot(r.argmax[static_cast<size_t>(row)]);
    if (r.candidates.present())
      return truncate_candidates(r.candidates.row_ids(row), r.candidates.row_logits(row), options.sampler,
                                 r.candidates.row_rest_mass(row), r.candidates.row_kept_below(row));
    return distribution(&r.logits[static_cast<size_t>(row * V)]);
  };
  auto head_row = [&](const MtpResult& r) {
    if (greedy) return one_hot(r.argmax[0]);
    if (r.candidates.present())
      return truncate_candidates(r.candidates.row_ids(0), r.candidates.row_logits(0), options.sampler,
                                 r.candidates.row_rest_mass(0), r.candidates.row_kept_below(0));
    return draft_distribution(r.logits.data());
  };
  // Emits one token; false once generation is over (stop token or max_tokens).
  auto emit = [&](int32_t token) {
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) != options.stop_ids.end()) {
      result.finish_reason = "stop";
      return false;
    }
    return static_cast<int64_t>(result.tokens.size()) < options.max_tokens;
  };

  // Rows listed in part reach below their top ids on the device (RowsBelow): the trunk's rows of its last
  // pass, the head's in the slot each draft's pass kept (keep_head_logits): one id's logit, a draw below the
  // top, or (a residual whose proposals gave up) the whole row, listed once per step.
  ForwardResult trunk;
  std::vector<std::optional<TokenDistribution>> whole_targets, whole_drafts;
  std::vector<float> fetched;
  const int64_t draft_limit = std::min(draft_ids, vocab_limit);
  RowsBelow below;
  below.logit = [&](bool target, size_t i, int32_t id) {
    if (id >= (target ? vocab_limit : draft_limit)) return -std::numeric_limits<float>::infinity();
    ++result.stats.logit_values_fetched;
    const std::span<const int32_t> one(&id, 1);
    if (target)
      model.fetch_logits(state, static_cast<int64_t>(i), one, fetched);
    else
      fetch_head_logits(model, head_state, static_cast<int64_t>(i), one, fetched);
    return fetched[0];
  };
  below.draw = [&](bool target, size_t i, BelowDraw d) {
    ++result.stats.draws_below;
    d.limit = target ? vocab_limit : draft_limit;
    return target ? model.draw_below(state, static_cast<int64_t>(i), d)
                  : draw_below_head(model, head_state, static_cast<int64_t>(i), d);
  };
  below.whole = [&](bool target, size_t i) -> const TokenDistribution& {
    std::optional<TokenDistribution>& d = target ? whole_targets[i] : whole_drafts[i];
    if (d) return *d;
    ++result.stats.logit_rows_fetched;
    if (!target) {
      fetch_head_logits(model, head_state, static_cast<int64_t>(i), {}, fetched);
      return *(d = draft_distribution(fetched.data()));
    }
    model.fetch_logits(state, static_cast<int64_t>(i), {}, fetched);
    return *(d = distribution(fetched.data()));
  };
  // A draw from a row listed perhaps in part, below its listed ids on the device.
  auto draw_row = [&](const TokenDistribution& d, bool target, size_t i) {
    const SampledRow r{d, {}, [&](const BelowDraw& b) { return below.draw(target, i, b); }, {}};
    return r.draw(rng.uniform());
  };

  // Prefill the trunk; the first token comes from its last row, exactly as in plain decoding.
  auto t0 = Clock::now();
  trunk_forward(model, options,
                {.state = &state,
                 .tokens = prompt,
                 .rows = LogitRows::kLast,
                 .result = &trunk,
                 .argmax_limit = target_argmax,
                 .head_logit_ids = head_logit_ids,
                 .sample = target_request});
  whole_targets.assign(1, std::nullopt);
  int32_t last = draw_row(target_row(trunk, 0), true, 0);
  // Prefill the head over the prompt (spec §6.3): row t = (h_t, x_{t+1}) at position t, t = 0..n-1.
  MtpResult head;
  {
    std::vector<int32_t> shifted(prompt.begin() + 1, prompt.end());
    shifted.push_back(last);
    head_forward(model, options,
                 {.state = &head_state,
                  .hidden = trunk.hidden,
                  .tokens = shifted,
                  .p0 = 0,
                  .rows = LogitRows::kLast,
                  .result = &head,
                  .logit_ids = head_logit_ids,
                  .argmax_limit = draft_argmax,
                  .sample = draft_request});
  }
  result.stats.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const ExpertTraffic prompt_experts = state.expert_traffic();

  auto t1 = Clock::now();
  bool going = emit(last);
  std::vector<int32_t> drafts;
  std::vector<TokenDistribution> draft_dists, target_dists;
  while (going) {
    if (options.cancelled && options.cancelled()) {
      result.finish_reason = "cancelled";
      break;
    }
    // Draft d_1..d_k: the first from the head's last row, then chained on the head's own output (§6.3).
    const int64_t P = state.position();  // position of `last`
    const int64_t remaining = options.max_tokens - static_cast<int64_t>(result.tokens.size());
    const int64_t k = std::min(K, remaining - 1);  // never draft past max_tokens
    drafts.clear();
    draft_dists.clear();
    whole_drafts.assign(static_cast<size_t>(k), std::nullopt);
    std::vector<float> head_hidden(head.hidden.end() - H, head.hidden.end());
    for (int64_t i = 0; i < k; ++i) {
      if (i > 0) {
        head_forward(model, options,
                     {.state = &head_state,
                      .hidden = head_hidden,
                      .tokens = std::span<const int32_t>(&drafts.back(), 1),
                      .p0 = P + i - 1,
                      .rows = LogitRows::kLast,
                      .result = &head,
                      .logit_ids = head_logit_ids,
                      .argmax_limit = draft_argmax,
                      .sample = draft_request});
        head_hidden.assign(head.hidden.begin(), head.hidden.end());
      }
      draft_dists.push_back(head_row(head));
      if (draft_dists.back().unlisted > 0.0) keep_head_logits(model, head_state, i);
      drafts.push_back(draw_row(draft_dists.back(), false, static_cast<size_t>(i)));
    }

    if (options.draft_hook) {
      std::vector<int32_t> context(prompt.begin(), prompt.end());
      context.insert(context.end(), result.tokens.begin(), result.tokens.end());
      const std::vector<int32_t> proposed = drafts;
      options.draft_hook(context, drafts);
      for (size_t i = 0; i < drafts.size(); ++i)
        if (drafts[i] != proposed[i]) draft_dists[i] = TokenDistribution{{drafts[i]}, {1.0f}};
    }

    // Verify [last, d_1..d_k] in one trunk pass, recorded so it can be cut back to the accepted prefix.
    std::vector<int32_t> window{last};
    window.insert(window.end(), drafts.begin(), drafts.end());
    trunk_forward(model, options,
                  {.state = &state,
                   .tokens = window,
                   .rows = LogitRows::kAll,
                   .result = &trunk,
                   .record_window = true,
                   .argmax_limit = target_argmax,
                   .head_logit_ids = head_logit_ids,
                   .sample = target_request});
    whole_targets.assign(static_cast<size_t>(k + 1), std::nullopt);
    target_dists.clear();
    for (int64_t i = 0; i <= k; ++i) target_dists.push_back(target_row(trunk, i));
    const std::vector<int32_t> emitted = accept_drafts(drafts, draft_dists, target_dists, rng, below);
    const int64_t accepted = static_cast<int64_t>(emitted.size()) - 1;

    MtpStats& s = result.stats.mtp;
    ++s.steps;
    s.drafted += k;
    s.accepted += accepted;
    for (int64_t i = 0; i < k; ++i) ++s.drafted_by_position[static_cast<size_t>(i)];
    for (int64_t i = 0; i < accepted; ++i) ++s.accepted_by_position[static_cast<size_t>(i)];

    // Roll the trunk back to [last, d_1..d_a]; the emitted y is the next step's `last`.
    model.rollback(state, accepted + 1);
    for (int32_t token : emitted)
      if (!(going = emit(token))) break;
    if (!going) break;
    last = emitted.back();
    // Commit the head rows P..P+a from the trunk's hiddens (overwriting draft-time KV); its last row
    // drafts the next d_1.
    head_forward(
        model, options,
        {.state = &head_state,
         .hidden = std::span<const float>(trunk.hidden.data(), static_cast<size_t>((accepted + 1) * H)),
         .tokens = emitted,
         .p0 = P,
         .rows = LogitRows::kLast,
         .result = &head,
         .logit_ids = head_logit_ids,
         .argmax_limit = draft_argmax,
         .sample = draft_request});
  }
  result.stats.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  result.stats.decode_steps = result.stats.mtp.steps;
  result.stats.generated_tokens = static_cast<int64_t>(result.tokens.size());
  result.stats.decode_experts = traffic_since(state.expert_traffic(), prompt_experts);
  return result;
}

}  // namespace mtpx
