// Gated full attention (spec §3): per-head [query | gate] projection, zero-centered q/k RMSNorm,
// partial NeoX RoPE over the first rotary_dim dims, grouped-query causal softmax attention over the
// KV cache, sigmoid output gate, output projection.
#pragma once

#include <cstdint>
#include <vector>

#include "io/model_config.h"
#include "model/state.h"
#include "model/weights.h"

namespace mtpx {

class InputStatistics;

// h: [T, H] (already input-normed) at positions p0 .. p0+T-1; appends T rows to `cache` at those
// positions; out: [out_rows, H], the outputs of the last out_rows rows (1 <= out_rows <= T). The rows
// before those only write their keys and values: their queries, attention and output projection are
// skipped (a layer whose earlier rows nobody reads, as the MTP head's when only the last row drafts). Row t
// attends to cache positions 0 .. p0+t, in order, so its output does not depend on T (batch-invariant).
void gated_attention_forward(const AttentionWeights& w, const ModelConfig& config, KvCache& cache, int64_t p0,
                             const float* h, int64_t t_count, float* out, int64_t out_rows,
                             InputStatistics* stats = nullptr);  // stats: see input_statistics.h

// gated_attention_forward in its two parts, for passes that multiply the rows of several sequences at once
// (Model::forward_batch): the projections, which are row-wise (x W^T), and the mixing over one sequence's
// cache. AttentionRows holds one sequence's projected rows: [T, nq, 2D] query | gate, [T, nkv, D] keys and
// values.
struct AttentionRows {
  AttentionRows(const ModelConfig& config, int64_t t_count);
  std::vector<float> qg, k, v;
};
void attention_project(const AttentionWeights& w, const ModelConfig& config, const float* h, int64_t t_count,
                       int64_t out_rows, AttentionRows& rows);
// Norms, RoPE, the cache write, the attention and the output gate (q and k are normalized in place);
// o: [out_rows, nq, D], the o_proj input.
void attention_mix(const AttentionWeights& w, const ModelConfig& config, KvCache& cache, int64_t p0,
                   int64_t t_count, int64_t out_rows, AttentionRows& rows, float* o);

// In-place rotation of the first rotary_dim dims of one head vector x[D] at position `pos`:
// pairs (i, i + rotary_dim/2), angle pos * theta^(-2i/rotary_dim) (§3.1).
void apply_partial_rope(float* x, int64_t rotary_dim, double theta, int64_t pos);

}  // namespace mtpx
