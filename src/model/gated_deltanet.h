// Gated DeltaNet linear attention (spec §4): projections, causal depthwise conv with its state,
// l2-normalized q/k, the gated delta rule on a float32 recurrent state, gated RMSNorm, out projection.
#pragma once

#include <cstdint>

#include "backend/cpu/matmul.h"
#include "io/model_config.h"
#include "model/state.h"
#include "model/weights.h"

namespace mtpx {

class InputStatistics;

// Windows of at least this many tokens use the chunked form (§4.3); shorter ones (decode and
// speculative verify) use the token-recurrent form (§4.2), whose arithmetic per token does not depend
// on the window length, so a verify row computes exactly what a decode step computes.
inline constexpr int64_t kDeltaNetChunkedMinTokens = cpu::kGemmMinRows;
inline constexpr int64_t kDeltaNetChunkSize = 64;

enum class DeltaRuleForm { kAuto, kRecurrent, kChunked };

// h: [T, H] (already input-normed); updates `state`; out: [T, H]. With `record_window`, state.window
// keeps what deltanet_rollback needs (windows shorter than kDeltaNetChunkedMinTokens only).
void gated_deltanet_forward(const DeltaNetWeights& w, const ModelConfig& config, DeltaNetState& state,
                            const float* h, int64_t t_count, float* out,
                            DeltaRuleForm form = DeltaRuleForm::kAuto, bool record_window = false,
                            InputStatistics* stats = nullptr);  // stats: see input_statistics.h

// Returns the state to what it was after the first `keep` tokens of the recorded window
// (0 <= keep <= window.tokens): the recurrent state that token's snapshot holds, and the conv state
// rebuilt from the kept pre-conv rows.
void deltanet_rollback(const ModelConfig& config, DeltaNetState& state, int64_t keep);

// The gated delta rule for one value head over T tokens, both forms (exposed for tests).
// q, k: [T, Dk] (normalized, q scaled), v: [T, Dv], g: [T] log-decay, beta: [T]; state: [Dk, Dv]
// (updated); o: [T, Dv]. With `snapshots` (recurrent form), `state` is only read and token t's state is
// written to snapshots[t] ([Dk, Dv] each).
void delta_rule_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          int64_t t_count, int64_t dk, int64_t dv, float* state, float* o, int64_t qk_stride,
                          int64_t v_stride, int64_t o_stride, float* const* snapshots = nullptr);
void delta_rule_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        int64_t t_count, int64_t dk, int64_t dv, float* state, float* o, int64_t qk_stride,
                        int64_t v_stride, int64_t o_stride);

}  // namespace mtpx
