#include "model/gated_deltanet.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "model/input_statistics.h"
#include "util/error.h"

namespace mtpx {

// §4.2, per token:  S = e^g S;  kv = k^T S;  delta = beta (v - kv);  S += k delta^T;  o = q^T S.
void delta_rule_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          int64_t T, int64_t dk, int64_t dv, float* S, float* o, int64_t qk_stride,
                          int64_t v_stride, int64_t o_stride, float* const* snapshots) {
  std::vector<float> scratch(static_cast<size_t>(2 * dv));
  for (int64_t t = 0; t < T; ++t) {
    const float* in = snapshots == nullptr || t == 0 ? S : snapshots[t - 1];
    float* out = snapshots == nullptr ? S : snapshots[t];
    cpu::delta_rule_step(in, out, q + t * qk_stride, k + t * qk_stride, v + t * v_stride, std::exp(g[t]),
                         beta[t], dk, dv, o + t * o_stride, scratch.data());
  }
}

// §4.3, chunks of C (the last one may be shorter: n rows). Within a chunk with cumulative log-decay G and
// incoming state S:
//   A = strictly_lower((beta K) K^T . Dec),  Tinv = (I + A)^-1,  U = Tinv (beta V),  W = Tinv (beta K e^G)
//   Vnew = U - W S;  O = (Q e^G) S + ((Q K^T) . Dec_incl_diag) Vnew;  S = e^{G_last} S + (K e^{G_last - G})^T
//   Vnew
// Every product is a small GEMM (n x n, n x Dk, n x Dv with n <= 64): prefill work, where the order of
// the sums is free (the recurrent form serves decode and verify windows).
void delta_rule_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        int64_t T, int64_t dk, int64_t dv, float* S, float* o, int64_t qk_stride,
                        int64_t v_stride, int64_t o_stride) {
  const int64_t C = kDeltaNetChunkSize;
  std::vector<float> G(C), A(C * C), P(C * C), row(C), kb(C * dk), qg(C * dk), vb(C * dv), W(C * dk),
      U(C * dv);
  for (int64_t c0 = 0; c0 < T; c0 += C) {
    const int64_t n = std::min(C, T - c0);
    const float* K = k + c0 * qk_stride;
    const float* Q = q + c0 * qk_stride;
    const float* V = v + c0 * v_stride;
    const float* b = beta + c0;
    float* O = o + c0 * o_stride;
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) G[i] = acc += g[c0 + i];
    // A[i][j] = -(beta_i k_i . k_j) e^{G_i - G_j} for j < i (the form transformers builds before inverting).
    cpu::gemm(false, true, n, n, dk, 1.0f, K, qk_stride, K, qk_stride, 0.0f, A.data(), n);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        A[i * n + j] = j < i ? -(b[i] * A[i * n + j]) * std::exp(G[i] - G[j]) : 0.0f;
    // Forward substitution, row by row: row_i[:i] += row_i[:i] . A[:i, :i] over the finished rows above
    // (gives (I + A')^-1 - I for A' = -A; finished row m is zero from column m on).
    for (int64_t i = 1; i < n; ++i) {
      float* ri = &A[i * n];
      std::copy_n(ri, i, row.data());
      for (int64_t m = 1; m < i; ++m) cpu::axpy(row[m], &A[m * n], m, ri);
    }
    for (int64_t i = 0; i < n; ++i) A[i * n + i] = 1.0f;  // Tinv = A + I
    // U = Tinv (beta V);  W = Tinv (beta K e^G)
    for (int64_t i = 0; i < n; ++i) {
      const float fk = b[i] * std::exp(G[i]);
      for (int64_t d = 0; d < dk; ++d) kb[i * dk + d] = fk * K[i * qk_stride + d];
      for (int64_t d = 0; d < dv; ++d) vb[i * dv + d] = b[i] * V[i * v_stride + d];
    }
    cpu::gemm(false, false, n, dv, n, 1.0f, A.data(), n, vb.data(), dv, 0.0f, U.data(), dv);
    cpu::gemm(false, false, n, dk, n, 1.0f, A.data(), n, kb.data(), dk, 0.0f, W.data(), dk);
    // Vnew = U - W S (in U)
    cpu::gemm(false, false, n, dv, dk, -1.0f, W.data(), dk, S, dv, 1.0f, U.data(), dv);
    // O = (Q e^G) S + P Vnew,  P[i][j] = (q_i . k_j) e^{G_i - G_j} for j <= i
    cpu::gemm(false, true, n, n, dk, 1.0f, Q, qk_stride, K, qk_stride, 0.0f, P.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) P[i * n + j] = j <= i ? P[i * n + j] * std::exp(G[i] - G[j]) : 0.0f;
      const float eg = std::exp(G[i]);
      for (int64_t d = 0; d < dk; ++d) qg[i * dk + d] = eg * Q[i * qk_stride + d];
    }
    cpu::gemm(false, false, n, dv, dk, 1.0f, qg.data(), dk, S, dv, 0.0f, O, o_stride);
    cpu::gemm(false, false, n, dv, n, 1.0f, P.data(), n, U.data(), dv, 1.0f, O, o_stride);
    // S = e^{G_last} S + sum_i (k_i e^{G_last - G_i}) Vnew_i^T
    const float g_last = G[n - 1];
    for (int64_t i = 0; i < n; ++i) {
      const float f = std::exp(g_last - G[i]);
      for (int64_t d = 0; d < dk; ++d) kb[i * dk + d] = f * K[i * qk_stride + d];
    }
    cpu::gemm(true, false, dk, dv, n, 1.0f, kb.data(), dk, U.data(), dv, std::exp(g_last), S, dv);
  }
}

DeltaNetRows::DeltaNetRows(const ModelConfig& c, int64_t T)
    : qkv(static_cast<size_t>(T * c.conv_dim())),
      z(static_cast<size_t>(T * c.linear_num_value_heads * c.linear_value_head_dim)),
      b(static_cast<size_t>(T * c.linear_num_value_heads)),
      a(static_cast<size_t>(T * c.linear_num_value_heads)) {}

void deltanet_project(const DeltaNetWeights& w, const float* h, int64_t T, DeltaNetRows& rows) {
  const cpu::MatmulTarget in_proj[] = {{&w.in_proj_qkv, rows.qkv.data()},
                                       {&w.in_proj_z, rows.z.data()},
                                       {&w.in_proj_b, rows.b.data()},
                                       {&w.in_proj_a, rows.a.data()}};
  cpu::matmul_shared_input(in_proj, h, T);
}

void deltanet_mix(const DeltaNetWeights& w, const ModelConfig& c, DeltaNetState& state, int64_t T,
                  const DeltaNetRows& rows, float* o_out, DeltaRuleForm form, bool record_window) {
  const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim;
  const int64_t conv_dim = c.conv_dim(), Kc = c.linear_conv_kernel_dim;
  const int64_t heads_per_key = Hv / Hk;
  const std::vector<float>& qkv = rows.qkv;
  const std::vector<float>& z = rows.z;
  const std::vector<float>& b = rows.b;
  const std::vector<float>& a = rows.a;

  // Causal depthwise conv over [conv state (Kc-1 rows) ; qkv (T rows)], then SiLU (§4.1). Per channel the
  // taps are summed in order j = 0..Kc-1 from 0, whatever T is; the taps are read tap-major (transposed at
  // load) so that the channel loop runs over contiguous memory.
  std::vector<float> x(static_cast<size_t>(T * conv_dim));  // [T, conv_dim] post-conv
  auto input_row = [&](int64_t r) -> const float* {         // r indexes the concatenation
    return r < Kc - 1 ? &state.conv[static_cast<size_t>(r * conv_dim)]
                      : &qkv[static_cast<size_t>((r - (Kc - 1)) * conv_dim)];
  };
  const std::vector<float>& taps = w.conv1d_by_tap;       // [Kc, conv_dim]
  const bool many_rows = T >= kDeltaNetChunkedMinTokens;  // prefill: worth a thread team
#pragma omp parallel for schedule(static) if (many_rows)
  for (int64_t t = 0; t < T; ++t) {
    float* xt = &x[static_cast<size_t>(t * conv_dim)];
    std::fill_n(xt, conv_dim, 0.0f);
    for (int64_t j = 0; j < Kc; ++j) {
      const float* in = input_row(t + j);
      const float* tap = &taps[static_cast<size_t>(j * conv_dim)];
      for (int64_t ch = 0; ch < conv_dim; ++ch) xt[ch] += tap[ch] * in[ch];
    }
    cpu::silu_in_place(xt, conv_dim);
  }
  if (record_window) {
    DeltaNetWindow& win = state.window;
    win.tokens = T;
    win.conv_before = state.conv;
    win.qkv = qkv;
  }
  // New conv state: the last Kc-1 rows of the concatenation.
  {
    std::vector<float> next(state.conv.size());
    for (int64_t r = 0; r < Kc - 1; ++r)
      std::copy_n(input_row(T + r), conv_dim, &next[static_cast<size_t>(r * conv_dim)]);
    state.conv.swap(next);
  }

  // q, k: l2-normalized per key head, q scaled by Dk^-1/2; beta = sigmoid(b); g = -e^A_log softplus(a +
  // dt_bias).
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  std::vector<float> beta(static_cast<size_t>(T * Hv)), g(static_cast<size_t>(T * Hv));
#pragma omp parallel for schedule(static) if (many_rows)
  for (int64_t t = 0; t < T; ++t) {
    float* xt = &x[static_cast<size_t>(t * conv_dim)];
    for (int64_t hk = 0; hk < Hk; ++hk) {
      float* qh = xt + hk * Dk;
      float* kh = xt + Hk * Dk + hk * Dk;
      cpu::l2_normalize(qh, 1e-6f, Dk);
      cpu::l2_normalize(kh, 1e-6f, Dk);
      for (int64_t d = 0; d < Dk; ++d) qh[d] *= q_scale;
    }
    for (int64_t hv = 0; hv < Hv; ++hv) {
      const size_t i = static_cast<size_t>(t * Hv + hv);
      beta[i] = cpu::sigmoid(b[i]);
      g[i] = -std::exp(w.a_log[static_cast<size_t>(hv)]) *
             cpu::softplus(a[i] + w.dt_bias[static_cast<size_t>(hv)]);
    }
  }

  const bool chunked =
      form == DeltaRuleForm::kChunked || (form == DeltaRuleForm::kAuto && T >= kDeltaNetChunkedMinTokens);
  if (record_window) {
    if (chunked) invalid_input("a recorded (rollback) window must use the recurrent form: {} tokens", T);
    // Token 0 updates the state in place, as a decode step does; token t >= 1 writes slot t. (Writing a
    // slot first reads its lines from L3, about 0.55 us per 16 KiB head state on this machine's cores:
    // the first token's slot cost ~15 us per verify pass of the shipped model.) A rollback always keeps
    // the first token, so the state before the window is not needed.
    DeltaNetWindow& win = state.window;
    if (static_cast<int64_t>(win.ssm_after.size()) < T) win.ssm_after.resize(static_cast<size_t>(T));
    for (int64_t t = 1; t < T; ++t) win.ssm_after[static_cast<size_t>(t)].resize(state.ssm.size());
  }
  float* o = o_out;  // [T, Hv, Dv]; the chunked form accumulates into it
  std::fill_n(o, T * Hv * Dv, 0.0f);
#pragma omp parallel for schedule(static) if (Hv > 1 && T * Dk * Dv * Hv >= (1 << 15))
  for (int64_t hv = 0; hv < Hv; ++hv) {
    const int64_t hk = hv / heads_per_key;
    std::vector<float> gh(static_cast<size_t>(T)), bh(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      gh[static_cast<size_t>(t)] = g[static_cast<size_t>(t * Hv + hv)];
      bh[static_cast<size_t>(t)] = beta[static_cast<size_t>(t * Hv + hv)];
    }
    const float* q = &x[static_cast<size_t>(hk * Dk)];
    const float* k = &x[static_cast<size_t>(Hk * Dk + hk * Dk)];
    const float* v = &x[static_cast<size_t>(2 * Hk * Dk + hv * Dv)];
    const size_t offset = static_cast<size_t>(hv * Dk * Dv);
    float* oh = &o[static_cast<size_t>(hv * Dv)];
    if (record_window) {
      std::vector<float*> snapshots(static_cast<size_t>(T));
      snapshots[0] = &state.ssm[offset];
      for (int64_t t = 1; t < T; ++t)
        snapshots[static_cast<size_t>(t)] = &state.window.ssm_after[static_cast<size_t>(t)][offset];
      delta_rule_recurrent(q, k, v, gh.data(), bh.data(), T, Dk, Dv, &state.ssm[offset], oh, conv_dim,
                           conv_dim, Hv * Dv, snapshots.data());
    } else if (chunked) {
      delta_rule_chunked(q, k, v, gh.data(), bh.data(), T, Dk, Dv, &state.ssm[offset], oh, conv_dim, conv_dim,
                         Hv * Dv);
    } else {
      delta_rule_recurrent(q, k, v, gh.data(), bh.data(), T, Dk, Dv, &state.ssm[offset], oh, conv_dim,
                           conv_dim, Hv * Dv);
    }
  }
  if (record_window) {
    // Token 0's state moves to slot 0 and the last token's becomes the state (two swaps, no copy; for a
    // one-token window they cancel).
    state.window.ssm_after[0].swap(state.ssm);
    state.ssm.swap(state.window.ssm_after[static_cast<size_t>(T - 1)]);
  }

  // Gated RMSNorm per value head (plain weight, norm before gate): o = norm(o) * w * silu(z) (§4.4).
  const float eps = static_cast<float>(c.rms_norm_eps);
#pragma omp parallel for schedule(static) if (many_rows)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hv = 0; hv < Hv; ++hv) {
      float* oh = &o[static_cast<size_t>((t * Hv + hv) * Dv)];
      const float* zh = &z[static_cast<size_t>((t * Hv + hv) * Dv)];
      cpu::rms_norm(oh, w.norm.data(), eps, Dv, oh);
      cpu::swiglu(zh, oh, Dv, oh);
    }
  }
}

void gated_deltanet_forward(const DeltaNetWeights& w, const ModelConfig& c, DeltaNetState& state,
                            const float* h, int64_t T, float* out, DeltaRuleForm form, bool record_window,
                            InputStatistics* stats) {
  DeltaNetRows rows(c, T);
  deltanet_project(w, h, T, rows);
  std::vector<float> o(static_cast<size_t>(T * c.linear_num_value_heads * c.linear_value_head_dim));
  deltanet_mix(w, c, state, T, rows, o.data(), form, record_window);
  cpu::matmul(w.out_proj, o.data(), T, out);
  if (stats != nullptr) {
    for (const cpu::WeightMatrix* p : {&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a})
      stats->add(*p, h, T);
    stats->add(w.out_proj, o.data(), T);
  }
}

void deltanet_rollback(const ModelConfig& c, DeltaNetState& state, int64_t keep) {
  DeltaNetWindow& win = state.window;
  if (keep < 1 || keep > win.tokens)
    invalid_input("rollback to {} tokens of a {}-token window (at least 1)", keep, win.tokens);
  if (keep == win.tokens) return;  // the state is already the one after the whole window
  const int64_t conv_dim = c.conv_dim(), Kc = c.linear_conv_kernel_dim;
  // The state after `keep` tokens, exactly as the window's recurrence left it. (The slot given up takes the
  // window's final state; a later rollback to fewer tokens reads other slots.)
  state.ssm.swap(win.ssm_after[static_cast<size_t>(keep - 1)]);
  // Conv state: the last Kc-1 rows of [conv_before ; qkv rows 0..keep-1].
  for (int64_t r = 0; r < Kc - 1; ++r) {
    const int64_t src = keep + r;  // index into the concatenation
    const float* row = src < Kc - 1 ? &win.conv_before[static_cast<size_t>(src * conv_dim)]
                                    : &win.qkv[static_cast<size_t>((src - (Kc - 1)) * conv_dim)];
    std::copy_n(row, conv_dim, &state.conv[static_cast<size_t>(r * conv_dim)]);
  }
  win.tokens = keep;
}

}  // namespace mtpx
