// Speculative decoding with the model's native MTP head (spec §6-§7).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "decode/generate.h"
#include "decode/sampler.h"

namespace mtpx {

// Accept or reject K draft tokens against the target (Leviathan et al. 2023, "Fast Inference from
// Transformers via Speculative Decoding"; Chen et al. 2023). draft_dists[i] is q_{i+1}, the distribution
// d_{i+1} was sampled from; target_dists[i] is p_{i+1}, the trunk's distribution at the same position
// (K+1 of them: the last is for the bonus token). Both come from truncate() with the same sampler, so
// the two sides are truncated identically.
//   accepted:  d_i is kept with probability min(1, p_i(d_i) / q_i(d_i));
//   recovered: at the first rejection, the replacement is sampled from normalize(max(p_i - q_i, 0));
//   bonus:     when all K are kept, one more token is sampled from p_{K+1}.
// Greedy sampling is the one-hot case of the same rule: keep d_i iff it is the target's argmax.
// Rows sampled whole may come listed in part (a device's top ids, TokenDistribution::unlisted > 0):
// `whole(target, i)` then returns row i of the targets (target) or of the drafts listed whole, and is
// asked only when an id below the listed ones, or the residual, needs it. The draws are the same as from
// the whole rows (sampler.h: draw()).
// Returns the tokens to emit: the accepted drafts, then the recovered or bonus token.
using WholeRow = std::function<const TokenDistribution&(bool target, size_t row)>;
std::vector<int32_t> accept_drafts(std::span<const int32_t> drafts,
                                   std::span<const TokenDistribution> draft_dists,
                                   std::span<const TokenDistribution> target_dists, Rng& rng,
                                   const WholeRow& whole = {});

// normalize(max(p - q, 0)); falls back to p when the difference has no mass (p == q up to rounding).
TokenDistribution residual_distribution(const TokenDistribution& p, const TokenDistribution& q);

GenerateResult generate_speculative(const Model& model, std::span<const int32_t> prompt,
                                    const GenerateOptions& options,
                                    const std::function<void(int32_t)>& on_token);

}  // namespace mtpx
