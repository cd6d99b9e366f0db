#include "model/decoder_layer.h"

#include <algorithm>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "model/attention.h"
#include "model/gated_deltanet.h"
#include "model/mlp.h"
#include "model/moe.h"
#include "util/error.h"

namespace mtpx {

void decoder_layer_forward(const LayerWeights& layer, const ModelConfig& c, KvCache* kv, DeltaNetState* delta,
                           int64_t p0, float* x, int64_t T, bool record_window, int64_t out_rows,
                           InputStatistics* stats, ExpertTraffic* traffic) {
  const int64_t H = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (out_rows <= 0 || out_rows > T) out_rows = T;
  if (out_rows < T && layer.type != LayerType::kFullAttention)
    fail(ErrorKind::kInternal, "decoder_layer_forward: a DeltaNet layer computes every row");
  std::vector<float> normed(static_cast<size_t>(T * H)), branch(static_cast<size_t>(out_rows * H));
  for (int64_t t = 0; t < T; ++t)
    cpu::rms_norm(x + t * H, layer.input_norm.data(), eps, H, &normed[static_cast<size_t>(t * H)]);
  if (layer.type == LayerType::kFullAttention) {
    gated_attention_forward(*layer.attention, c, *kv, p0, normed.data(), T, branch.data(), out_rows, stats);
  } else {
    gated_deltanet_forward(*layer.delta_net, c, *delta, normed.data(), T, branch.data(), DeltaRuleForm::kAuto,
                           record_window, stats);
  }
  float* out = x + (T - out_rows) * H;  // the rows computed from here on
  cpu::add_inplace(out, branch.data(), out_rows * H);
  for (int64_t t = 0; t < out_rows; ++t)
    cpu::rms_norm(out + t * H, layer.post_attn_norm.data(), eps, H, &normed[static_cast<size_t>(t * H)]);
  if (layer.moe)
    moe_forward(*layer.moe, normed.data(), out_rows, branch.data(), stats, traffic);
  else
    mlp_forward(layer.mlp, normed.data(), out_rows, branch.data(), stats);
  cpu::add_inplace(out, branch.data(), out_rows * H);
}

void norm_and_logits(const ModelConfig& c, const cpu::WeightMatrix& lm_head, const std::vector<float>& norm,
                     const float* x, int64_t T, LogitRows rows, std::vector<float>& hidden,
                     std::vector<float>& logits, int64_t next_prefix_rows) {
  const int64_t H = c.hidden_size, V = lm_head.rows;  // the vocabulary, or a draft vocabulary's prefix
  const float eps = static_cast<float>(c.rms_norm_eps);
  hidden.resize(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t)
    cpu::rms_norm(x + t * H, norm.data(), eps, H, &hidden[static_cast<size_t>(t * H)]);
  switch (rows) {
    case LogitRows::kNone:
      logits.clear();
      break;
    case LogitRows::kLast:
      logits.resize(static_cast<size_t>(V));
      cpu::matmul_prefix_last(lm_head, &hidden[static_cast<size_t>((T - 1) * H)], 1, logits.data(),
                              next_prefix_rows);
      break;
    case LogitRows::kAll:
      logits.resize(static_cast<size_t>(T * V));
      cpu::matmul_prefix_last(lm_head, hidden.data(), T, logits.data(), next_prefix_rows);
      break;
  }
}

void logit_row_argmax(const std::vector<float>& logits, int64_t row_len, int64_t limit,
                      std::vector<int32_t>& argmax) {
  argmax.clear();
  if (limit <= 0) return;
  for (size_t r = 0; r < logits.size() / static_cast<size_t>(row_len); ++r)
    argmax.push_back(
        cpu::argmax_rows_kernel(&logits[r * static_cast<size_t>(row_len)], std::min(limit, row_len)));
}

}  // namespace mtpx
