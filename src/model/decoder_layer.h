// The pieces the trunk and the MTP head share: one decoder layer, and the final norm + lm_head.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "backend/cpu/matmul.h"
#include "io/model_config.h"
#include "model/state.h"
#include "model/weights.h"

namespace mtpx {

class InputStatistics;

enum class LogitRows { kNone, kLast, kAll };

// One decoder layer (spec §2), in place on the residual stream x [T, H] at positions p0..p0+T-1:
//   x += mixer(RMSNorm1p(x));  x += MLP(RMSNorm1p(x))   (MLP: SwiGLU, or the MoE block of model/moe.h)
// The mixer is gated full attention over `kv` for full-attention layers, Gated DeltaNet on `delta`
// otherwise (record_window: keep what a rollback needs).
// out_rows > 0 (full attention only): only the last out_rows rows of x are computed; the rows before them
// only write their keys and values to `kv` (x keeps their input there). The MTP head drafts from its last
// row, so its other rows (the accepted tokens it catches up on, a prompt) need nothing else.
void decoder_layer_forward(const LayerWeights& layer, const ModelConfig& config, KvCache* kv,
                           DeltaNetState* delta, int64_t p0, float* x, int64_t t_count,
                           bool record_window = false, int64_t out_rows = 0,
                           InputStatistics* stats = nullptr,   // stats: see input_statistics.h
                           ExpertTraffic* traffic = nullptr);  // MoE layers count their experts in it

// Products of `rows` rows in blocks of fewer than cpu::kGemmMinRows rows: each block takes the small-M
// kernels, whose rows are computed alone (matmul.h: batch invariance), whatever else shares the pass.
template <class F>
void for_invariant_row_blocks(int64_t rows, F f) {
  constexpr int64_t kBlock = cpu::kGemmMinRows - 1;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) f(r0, std::min(kBlock, rows - r0));
}

// One sequence's share of a layer pass over the rows of several sequences: rows [first_row, first_row + T)
// of x, at positions p0 .. p0+T-1 of its own cache and DeltaNet state.
struct SequenceSlice {
  KvCache* kv = nullptr;
  DeltaNetState* delta = nullptr;
  int64_t p0 = 0;
  int64_t first_row = 0;
  int64_t t_count = 0;  // 1 .. cpu::kGemmMinRows - 1
  bool record_window = false;
  ExpertTraffic* traffic = nullptr;
};
// decoder_layer_forward for several sequences at once, x: [rows, H] (the slices' rows, in order). The
// row-wise parts (norms, projections, MLP) run over all rows in invariant blocks, so every weight is read
// once per block rather than once per sequence; attention and the delta rule run per sequence on its own
// state. Each sequence's rows come out bit-identical to a decoder_layer_forward of its rows alone.
void decoder_layer_forward_batch(const LayerWeights& layer, const ModelConfig& config,
                                 std::span<const SequenceSlice> sequences, float* x, int64_t rows);

// hidden = RMSNorm1p(x, norm) for all T rows; logits = hidden @ lm_head^T for the rows asked for.
// next_prefix_rows > 0: the next product reads lm_head rows [0, next_prefix_rows) (the MTP head's draft
// vocabulary), so this one reads them last (cpu::matmul_prefix_last); the logits are the same.
void norm_and_logits(const ModelConfig& config, const cpu::WeightMatrix& lm_head,
                     const std::vector<float>& norm, const float* x, int64_t t_count, LogitRows rows,
                     std::vector<float>& hidden, std::vector<float>& logits, int64_t next_prefix_rows = 0);

// argmax[r] = the argmax over ids < limit of logit row r ([rows, row_len] logits; cpu::argmax_rows_kernel,
// the same index as cpu::argmax), for every row; empty when limit <= 0.
void logit_row_argmax(const std::vector<float>& logits, int64_t row_len, int64_t limit,
                      std::vector<int32_t>& argmax);

}  // namespace mtpx
