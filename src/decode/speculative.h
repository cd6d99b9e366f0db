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
// Rows sampled whole may come listed in part (a device's top ids, TokenDistribution::unlisted > 0); `below`
// then reaches under the listed ids of row i of the targets (target) or of the drafts, only where needed.
// Returns the tokens to emit: the accepted drafts, then the recovered or bonus token.
struct RowsBelow {
  // The row's logit of `id` (-infinity for an id it excludes: past its vocabulary limit): one id's
  // probability (the accept test, the residual's proposals).
  std::function<float(bool target, size_t row, int32_t id)> logit;
  // A draw below the listed ids (sampler.h: below_draw(); the callee sets the row's limit).
  std::function<int32_t(bool target, size_t row, const BelowDraw& draw)> draw;
  // The row listed whole (truncate()): a draw below the listed ids when `draw` is not given, and the
  // residual when its proposals give up (draw_residual).
  std::function<const TokenDistribution&(bool target, size_t row)> whole;
};
std::vector<int32_t> accept_drafts(std::span<const int32_t> drafts,
                                   std::span<const TokenDistribution> draft_dists,
                                   std::span<const TokenDistribution> target_dists, Rng& rng,
                                   const RowsBelow& below = {});

// A row of accept_drafts: its listed distribution and the ways below it (RowsBelow, bound to the row).
struct SampledRow {
  const TokenDistribution& listed;
  std::function<float(int32_t id)> logit;
  std::function<int32_t(const BelowDraw& draw)> draw_below;
  std::function<const TokenDistribution&()> whole;

  double prob(int32_t id) const;  // listed, else from its logit (else from the whole row)
  int32_t draw(double u) const;   // draw() from the listed ids, else below them (else from the whole row)
  const TokenDistribution& listed_whole() const;  // `listed` when it lists the whole row, else whole()
};

// A draw from the residual normalize(max(p - q, 0)). Rows listed whole: from residual_distribution. Rows
// listed in part: by rejection from p (y ~ p kept with probability max(0, 1 - q(y) / p(y)), so that y has
// the law p(y) max(0, 1 - q(y) / p(y)) = max(0, p(y) - q(y)) up to normalization), which needs p's top ids
// and a few logits instead of both whole rows; after kResidualProposals rejected proposals, the residual of
// the whole rows (as exact: each outcome is the residual's law). A rejection at a row happens with
// probability m = sum max(0, q - p), the residual's mass, and its proposals then keep one with probability
// m each, so whole rows are needed at most m (1 - m)^N <= 1 / (e N) of the time (N proposals).
inline constexpr int kResidualProposals = 64;
int32_t draw_residual(const SampledRow& p, const SampledRow& q, Rng& rng);

// normalize(max(p - q, 0)); falls back to p when the difference has no mass (p == q up to rounding).
TokenDistribution residual_distribution(const TokenDistribution& p, const TokenDistribution& q);

GenerateResult generate_speculative(const Model& model, std::span<const int32_t> prompt,
                                    const GenerateOptions& options,
                                    const std::function<void(int32_t)>& on_token);

}  // namespace mtpx
