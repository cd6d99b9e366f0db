// Gated DeltaNet linear attention (spec §4): projections, causal depthwise conv with its state,
// l2-normalized q/k, the gated delta rule on a float32 recurrent state, gated RMSNorm, out projection.
#pragma once

#include <cstdint>
#include <vector>

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

// gated_deltanet_forward in its two parts, for passes that multiply the rows of several sequences at once
// (Model::forward_batch): the input projections, which are row-wise, and the conv, the delta rule and the
// gated norm on one sequence's state. DeltaNetRows holds one sequence's projected rows.
struct DeltaNetRows {
  DeltaNetRows(const ModelConfig& config, int64_t t_count);
  std::vector<float> qkv;  // [T, conv_dim] pre-conv
  std::vector<float> z;    // [T, Hv, Dv]
  std::vector<float> b;    // [T, Hv]
  std::vector<float> a;    // [T, Hv]
};
void deltanet_project(const DeltaNetWeights& w, const float* h, int64_t t_count, DeltaNetRows& rows);
// o: [T, Hv, Dv], the out_proj input.
void deltanet_mix(const DeltaNetWeights& w, const ModelConfig& config, DeltaNetState& state, int64_t t_count,
                  const DeltaNetRows& rows, float* o, DeltaRuleForm form = DeltaRuleForm::kAuto,
                  bool record_window = false);

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
