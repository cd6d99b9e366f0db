// Turning logits into a next token. One function, truncate(), turns logits into the truncated,
// renormalized distribution the sampler draws from; speculative decoding must pass both the draft's and
// the target's logits through this same function, so the two sides are never truncated differently.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "io/model_config.h"
#include "model/device.h"

namespace mtpx {

struct SamplerParams {
  double temperature = 1.0;  // <= 0: greedy (argmax)
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // 1: off
  double min_p = 0.0;        // 0: off

  bool greedy() const { return temperature <= 0.0; }
};

// The sampler a checkpoint ships (generation_config.json): its settings, greedy when do_sample is false.
SamplerParams sampler_defaults(const GenerationConfig& config);

// Validates ranges; throws mtpx::Error (kInvalidInput) naming the parameter.
void validate(const SamplerParams& params);

// A probability distribution over a subset of the vocabulary, sorted by probability (descending, ties
// by lower id first); probabilities sum to 1. Tokens not listed have probability 0. Exceptions:
// - truncate() of a long row (over 4096 ids) without top-k that keeps ids below its top ones (temperature
//   alone, or a top-p prefix reaching below them) sorts only its top ids (at least 1024); the others kept
//   follow in id order (sorting them took 30 ms per row at Qwen's vocabulary). Any order is as exact:
//   draw() walks the list.
// - truncate_candidates() of a device's top ids of a row sampled whole, or of one whose top-p prefix ends
//   below them, lists only those, with their share of what the row keeps, and `unlisted` is the share of
//   the ids kept below them (the row's truncate() lists those after these).
struct TokenDistribution {
  std::vector<int32_t> ids;
  std::vector<float> probs;
  double unlisted = 0.0;
  // With unlisted > 0, how the row weighs each of its ids, listed or not: exp(logit * inv_temperature -
  // max_scaled) / total, the probability truncate() of the whole row gives it (up to the order of the sum
  // in `total`); the unlisted ids are those whose logit is < below (the lowest listed) and >= at_least
  // (the others: 0).
  struct RowScale {
    double inv_temperature = 0.0, max_scaled = 0.0, total = 0.0;
    float below = 0.0f, at_least = -std::numeric_limits<float>::infinity();
  } scale;

  float prob(int32_t id) const;  // 0 for an id not listed
  // The probability of an id of a row listed in part from its logit (-infinity: an id the row excludes, 0).
  float prob_of_logit(float logit) const;
};

// softmax(logits / T), then, in Hugging Face's order: top-k (keep tokens whose logit is >= the k-th
// largest), top-p (keep the smallest prefix of the sorted tokens whose mass reaches p; at least one),
// min-p (drop tokens with p < min_p * p_max), then renormalize. Greedy gives the one-hot argmax.
// Only ids < vocab_limit are eligible (embedding rows past the tokenizer's vocabulary are padding).
TokenDistribution truncate(std::span<const float> logits, const SamplerParams& params, int64_t vocab_limit);

// truncate() from a device's candidates (model/device.h: CandidateRequest), what it sends back for
// sampling instead of the whole row: the result is truncate()'s on the full row.
// - With top-k (0 < top_k < vocab_limit): `ids` are every id < vocab_limit whose logit is >= the top_k-th
//   largest of those (ties included), `logits` theirs, rest_mass 0.
// - Without: `ids` are every id < vocab_limit whose logit is >= some threshold, and rest_mass the sum of
//   exp((logit - max) / T) over the ids below it (max: the row's largest logit). It counts in top-p's
//   total; top-p's prefix must end inside the ids or min-p must drop some of them (an mtpx::Error,
//   kInternal, when neither does: the ids below would be needed), unless the row is sampled whole
//   (temperature alone) or `kept_below` says where top-p's prefix ends below the ids (its mass > 0;
//   CandidateRequest::decides_kept_below()): then the result lists the ids and `unlisted` is the share of
//   the ids kept below them.
TokenDistribution truncate_candidates(std::span<const int32_t> ids, std::span<const float> logits,
                                      const SamplerParams& params, double rest_mass = 0.0,
                                      KeptBelow kept_below = {});

// What a device is asked to send back for sampling with `params` over ids < vocab_limit (none for greedy:
// the passes' argmax serves it). rows_on_request: the caller can fetch a pass's logits afterwards
// (Model::fetch_logits), so a row sampled whole comes back as its top ids and the rest's mass too.
CandidateRequest candidate_request(const SamplerParams& params, int64_t vocab_limit,
                                   bool rows_on_request = false);

// The largest logit's id among ids < vocab_limit (lowest id on ties).
int32_t argmax(std::span<const float> logits, int64_t vocab_limit);

// The distribution that gives `id` probability 1: what truncate() returns for a greedy sampler. Greedy
// decoding on a device takes its argmax from the forward pass (ForwardResult::argmax, the same function
// computed where the logits are) and goes through this, so no [rows, V] logits are copied to the host.
TokenDistribution one_hot(int32_t id);

// Seeded random numbers; the same seed gives the same stream on every machine.
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }  // [0, 1)

 private:
  std::mt19937_64 engine_;
};

// The id at u in [0, 1) of the distribution's inverse CDF, walking its list in order; nullopt when u lands
// in its unlisted share. The row's full distribution (truncate()) lists the same ids first in the same
// order (a device's top ids are at most 1024, among truncate()'s top ids), so drawing from it with the
// same u gives the same id, or one of the unlisted ones where this gave nullopt.
std::optional<int32_t> draw(const TokenDistribution& distribution, double u);

// Where a draw at u that landed below a row's listed ids (draw() gave nullopt) goes: among the ids below,
// in id order, at the weight (u - the listed probabilities' sum) * total, each weighing as RowScale says.
// Together with draw() that is the inverse CDF of the row listed as its top ids, then the others in id
// order: as exact a draw as truncate()'s order gives, and a device makes it without copying the row
// (DeviceExecutor::draw_below). The caller sets the limit.
BelowDraw below_draw(const TokenDistribution& distribution, double u);

// Draws one id from a fully listed distribution (draw() at a uniform u).
int32_t sample(const TokenDistribution& distribution, Rng& rng);

}  // namespace mtpx
