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

void decoder_layer_forward_batch(const LayerWeights& layer, const ModelConfig& c,
                                 std::span<const SequenceSlice> sequences, float* x, int64_t N) {
  const int64_t H = c.hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> normed(static_cast<size_t>(N * H)), branch(static_cast<size_t>(N * H));
  for (int64_t r = 0; r < N; ++r)
    cpu::rms_norm(x + r * H, layer.input_norm.data(), eps, H, &normed[static_cast<size_t>(r * H)]);
  // Stacked projections of all rows, then each sequence's rows copied out for its mixer (a few KiB per row).
  auto project = [&](std::span<const cpu::WeightMatrix* const> ws, std::vector<std::vector<float>>& ys) {
    ys.resize(ws.size());
    for (size_t i = 0; i < ws.size(); ++i) ys[i].resize(static_cast<size_t>(N * ws[i]->rows));
    for_invariant_row_blocks(N, [&](int64_t r0, int64_t n) {
      std::vector<cpu::MatmulTarget> targets;
      for (size_t i = 0; i < ws.size(); ++i)
        targets.push_back({ws[i], &ys[i][static_cast<size_t>(r0 * ws[i]->rows)]});
      cpu::matmul_shared_input(targets, &normed[static_cast<size_t>(r0 * H)], n);
    });
  };
  auto rows_of = [](const std::vector<float>& y, int64_t width, const SequenceSlice& s,
                    std::vector<float>& to) {
    std::copy_n(&y[static_cast<size_t>(s.first_row * width)], s.t_count * width, to.begin());
  };
  std::vector<std::vector<float>> ys;
  const cpu::WeightMatrix* out_proj = nullptr;
  int64_t o_width = 0;
  std::vector<float> o;
  if (layer.type == LayerType::kFullAttention) {
    const AttentionWeights& w = *layer.attention;
    const cpu::WeightMatrix* ws[] = {&w.q_proj, &w.k_proj, &w.v_proj};
    project(ws, ys);
    o_width = c.num_attention_heads * c.head_dim;
    o.resize(static_cast<size_t>(N * o_width));
    for (const SequenceSlice& s : sequences) {
      AttentionRows rows(c, s.t_count);
      rows_of(ys[0], w.q_proj.rows, s, rows.qg);
      rows_of(ys[1], w.k_proj.rows, s, rows.k);
      rows_of(ys[2], w.v_proj.rows, s, rows.v);
      attention_mix(w, c, *s.kv, s.p0, s.t_count, s.t_count, rows,
                    &o[static_cast<size_t>(s.first_row * o_width)]);
    }
    out_proj = &w.o_proj;
  } else {
    const DeltaNetWeights& w = *layer.delta_net;
    const cpu::WeightMatrix* ws[] = {&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a};
    project(ws, ys);
    o_width = c.linear_num_value_heads * c.linear_value_head_dim;
    o.resize(static_cast<size_t>(N * o_width));
    for (const SequenceSlice& s : sequences) {
      DeltaNetRows rows(c, s.t_count);
      rows_of(ys[0], w.in_proj_qkv.rows, s, rows.qkv);
      rows_of(ys[1], w.in_proj_z.rows, s, rows.z);
      rows_of(ys[2], w.in_proj_b.rows, s, rows.b);
      rows_of(ys[3], w.in_proj_a.rows, s, rows.a);
      deltanet_mix(w, c, *s.delta, s.t_count, rows, &o[static_cast<size_t>(s.first_row * o_width)],
                   DeltaRuleForm::kRecurrent, s.record_window);
    }
    out_proj = &w.out_proj;
  }
  for_invariant_row_blocks(N, [&](int64_t r0, int64_t n) {
    cpu::matmul(*out_proj, &o[static_cast<size_t>(r0 * o_width)], n, &branch[static_cast<size_t>(r0 * H)]);
  });
  cpu::add_inplace(x, branch.data(), N * H);
  for (int64_t r = 0; r < N; ++r)
    cpu::rms_norm(x + r * H, layer.post_attn_norm.data(), eps, H, &normed[static_cast<size_t>(r * H)]);
  if (layer.moe) {
    // Per sequence: its traffic counts the experts its own rows read.
    for (const SequenceSlice& s : sequences)
      moe_forward(*layer.moe, &normed[static_cast<size_t>(s.first_row * H)], s.t_count,
                  &branch[static_cast<size_t>(s.first_row * H)], nullptr, s.traffic);
  } else {
    for_invariant_row_blocks(N, [&](int64_t r0, int64_t n) {
      mlp_forward(layer.mlp, &normed[static_cast<size_t>(r0 * H)], n, &branch[static_cast<size_t>(r0 * H)]);
    });
  }
  cpu::add_inplace(x, branch.data(), N * H);
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
