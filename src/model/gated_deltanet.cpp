#include "model/gated_deltanet.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "util/error.h"

namespace mtpx {

// §4.2, per token:  S = e^g S;  kv = k^T S;  delta = beta (v - kv);  S += k delta^T;  o = q^T S.
void delta_rule_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          int64_t T, int64_t dk, int64_t dv, float* S, float* o, int64_t qk_stride,
                          int64_t v_stride, int64_t o_stride) {
  std::vector<float> kv(static_cast<size_t>(dv));
  std::vector<float> delta(static_cast<size_t>(dv));
  for (int64_t t = 0; t < T; ++t) {
    const float* qt = q + t * qk_stride;
    const float* kt = k + t * qk_stride;
    const float* vt = v + t * v_stride;
    const float decay = std::exp(g[t]);
    std::fill(kv.begin(), kv.end(), 0.0f);
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * dv;
      for (int64_t j = 0; j < dv; ++j) row[j] *= decay;
      cpu::axpy(kt[i], row, dv, kv.data());
    }
    for (int64_t j = 0; j < dv; ++j)
      delta[static_cast<size_t>(j)] = (vt[j] - kv[static_cast<size_t>(j)]) * beta[t];
    float* ot = o + t * o_stride;
    std::fill_n(ot, dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S + i * dv;
      cpu::axpy(kt[i], delta.data(), dv, row);
      cpu::axpy(qt[i], row, dv, ot);
    }
  }
}

// §4.3, chunks of C (the last one zero-padded: beta = g = 0 rows change nothing). Within a chunk with
// cumulative log-decay G and incoming state S:
//   A = strictly_lower((beta K) K^T . Dec),  Tinv = (I + A)^-1,  U = Tinv (beta V),  W = Tinv (beta K e^G)
//   Vnew = U - W S;  O = (Q e^G) S + ((Q K^T) . Dec_incl_diag) Vnew;  S = e^{G_last} S + (K e^{G_last - G})^T
//   Vnew
void delta_rule_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        int64_t T, int64_t dk, int64_t dv, float* S, float* o, int64_t qk_stride,
                        int64_t v_stride, int64_t o_stride) {
  const int64_t C = kDeltaNetChunkSize;
  std::vector<float> G(C), A(C * C), U(C * dv), W(C * dk), vnew(C * dv), qk(C * C), kb(C * dk), ws(dv);
  for (int64_t c0 = 0; c0 < T; c0 += C) {
    const int64_t n = std::min(C, T - c0);  // real rows; rows n..C-1 are padding (zero)
    float acc = 0.0f;
    for (int64_t i = 0; i < C; ++i) {
      acc += i < n ? g[c0 + i] : 0.0f;
      G[i] = acc;
    }
    auto krow = [&](int64_t i) { return k + (c0 + i) * qk_stride; };
    auto qrow = [&](int64_t i) { return q + (c0 + i) * qk_stride; };
    auto vrow = [&](int64_t i) { return v + (c0 + i) * v_stride; };
    // A[i][j] = -(beta_i k_i . k_j) e^{G_i - G_j} for j < i (the form transformers builds before inverting).
    std::fill(A.begin(), A.end(), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j)
        A[i * C + j] = -(beta[c0 + i] * cpu::dot(krow(i), krow(j), dk)) * std::exp(G[i] - G[j]);
    }
    // Forward substitution: row i += row_i[:i] . A[:i, :i] (gives (I + A')^-1 - I for A' = -A).
    for (int64_t i = 1; i < n; ++i) {
      std::vector<float> row(A.begin() + i * C, A.begin() + i * C + i);
      for (int64_t j = 0; j < i; ++j) {
        float s = 0.0f;
        for (int64_t m = 0; m < i; ++m) s += row[static_cast<size_t>(m)] * A[m * C + j];
        A[i * C + j] = row[static_cast<size_t>(j)] + s;
      }
    }
    for (int64_t i = 0; i < n; ++i) A[i * C + i] = 1.0f;  // Tinv = A + I
    // U = Tinv (beta V);  W = Tinv (beta K e^G)
    for (int64_t i = 0; i < n; ++i) {
      float* u = &U[i * dv];
      float* wr = &W[i * dk];
      std::fill_n(u, dv, 0.0f);
      std::fill_n(wr, dk, 0.0f);
      for (int64_t j = 0; j <= i; ++j) {
        const float a = A[i * C + j];
        cpu::axpy(a * beta[c0 + j], vrow(j), dv, u);
        cpu::axpy(a * beta[c0 + j] * std::exp(G[j]), krow(j), dk, wr);
      }
    }
    // Vnew = U - W S
    for (int64_t i = 0; i < n; ++i) {
      std::fill(ws.begin(), ws.end(), 0.0f);
      for (int64_t d = 0; d < dk; ++d) cpu::axpy(W[i * dk + d], S + d * dv, dv, ws.data());
      for (int64_t j = 0; j < dv; ++j) vnew[i * dv + j] = U[i * dv + j] - ws[static_cast<size_t>(j)];
    }
    // O = (Q e^G) S + ((Q K^T) . Dec) Vnew
    for (int64_t i = 0; i < n; ++i) {
      float* ot = o + (c0 + i) * o_stride;
      std::fill_n(ot, dv, 0.0f);
      const float eg = std::exp(G[i]);
      for (int64_t d = 0; d < dk; ++d) cpu::axpy(qrow(i)[d] * eg, S + d * dv, dv, ot);
      for (int64_t j = 0; j <= i; ++j) {
        const float a = cpu::dot(qrow(i), krow(j), dk) * std::exp(G[i] - G[j]);
        cpu::axpy(a, &vnew[j * dv], dv, ot);
      }
    }
    // S = e^{G_last} S + sum_i (k_i e^{G_last - G_i}) Vnew_i^T
    const float g_last = G[C - 1];
    const float e_last = std::exp(g_last);
    for (int64_t d = 0; d < dk * dv; ++d) S[d] *= e_last;
    for (int64_t i = 0; i < n; ++i) {
      const float f = std::exp(g_last - G[i]);
      for (int64_t d = 0; d < dk; ++d) cpu::axpy(krow(i)[d] * f, &vnew[i * dv], dv, S + d * dv);
    }
  }
}

void gated_deltanet_forward(const DeltaNetWeights& w, const ModelConfig& c, DeltaNetState& state,
                            const float* h, int64_t T, float* out, DeltaRuleForm form, bool record_window) {
  const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim;
  const int64_t conv_dim = c.conv_dim(), Kc = c.linear_conv_kernel_dim;
  const int64_t heads_per_key = Hv / Hk;

  std::vector<float> qkv(static_cast<size_t>(T * conv_dim));  // [T, conv_dim] pre-conv
  std::vector<float> z(static_cast<size_t>(T * Hv * Dv));     // [T, Hv, Dv]
  std::vector<float> b(static_cast<size_t>(T * Hv));          // [T, Hv]
  std::vector<float> a(static_cast<size_t>(T * Hv));          // [T, Hv]
  cpu::matmul(w.in_proj_qkv, h, T, qkv.data());
  cpu::matmul(w.in_proj_z, h, T, z.data());
  cpu::matmul(w.in_proj_b, h, T, b.data());
  cpu::matmul(w.in_proj_a, h, T, a.data());

  // Causal depthwise conv over [conv state (Kc-1 rows) ; qkv (T rows)], then SiLU (§4.1).
  std::vector<float> x(static_cast<size_t>(T * conv_dim));  // [T, conv_dim] post-conv
  auto input_row = [&](int64_t r) -> const float* {         // r indexes the concatenation
    return r < Kc - 1 ? &state.conv[static_cast<size_t>(r * conv_dim)]
                      : &qkv[static_cast<size_t>((r - (Kc - 1)) * conv_dim)];
  };
  for (int64_t t = 0; t < T; ++t) {
    float* xt = &x[static_cast<size_t>(t * conv_dim)];
    for (int64_t ch = 0; ch < conv_dim; ++ch) {
      float s = 0.0f;
      for (int64_t j = 0; j < Kc; ++j) s += w.conv1d[static_cast<size_t>(ch * Kc + j)] * input_row(t + j)[ch];
      xt[ch] = cpu::silu(s);
    }
  }
  if (record_window) {
    DeltaNetWindow& win = state.window;
    win.tokens = T;
    win.ssm_before = state.ssm;
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
    state.window.x = x;
    state.window.g = g;
    state.window.beta = beta;
  }
  std::vector<float> o(static_cast<size_t>(T * Hv * Dv));  // [T, Hv, Dv]
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
    float* S = &state.ssm[static_cast<size_t>(hv * Dk * Dv)];
    float* oh = &o[static_cast<size_t>(hv * Dv)];
    if (chunked)
      delta_rule_chunked(q, k, v, gh.data(), bh.data(), T, Dk, Dv, S, oh, conv_dim, conv_dim, Hv * Dv);
    else
      delta_rule_recurrent(q, k, v, gh.data(), bh.data(), T, Dk, Dv, S, oh, conv_dim, conv_dim, Hv * Dv);
  }

  // Gated RMSNorm per value head (plain weight, norm before gate): o = norm(o) * w * silu(z) (§4.4).
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hv = 0; hv < Hv; ++hv) {
      float* oh = &o[static_cast<size_t>((t * Hv + hv) * Dv)];
      const float* zh = &z[static_cast<size_t>((t * Hv + hv) * Dv)];
      cpu::rms_norm(oh, w.norm.data(), eps, Dv, oh);
      for (int64_t d = 0; d < Dv; ++d) oh[d] *= cpu::silu(zh[d]);
    }
  }
  cpu::matmul(w.out_proj, o.data(), T, out);
}

void deltanet_rollback(const ModelConfig& c, DeltaNetState& state, int64_t keep) {
  DeltaNetWindow& win = state.window;
  if (keep < 0 || keep > win.tokens)
    invalid_input("rollback to {} tokens of a {}-token window", keep, win.tokens);
  if (keep == win.tokens) return;  // the state is already the one after the whole window
  const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim;
  const int64_t conv_dim = c.conv_dim(), Kc = c.linear_conv_kernel_dim;
  const int64_t heads_per_key = Hv / Hk;
  state.ssm = win.ssm_before;
  // Replay: the same per-token recurrence, so the result is bit-identical to running `keep` tokens.
  std::vector<float> scratch_o(static_cast<size_t>(keep * Dv));
  for (int64_t hv = 0; hv < Hv; ++hv) {
    const int64_t hk = hv / heads_per_key;
    std::vector<float> gh(static_cast<size_t>(keep)), bh(static_cast<size_t>(keep));
    for (int64_t t = 0; t < keep; ++t) {
      gh[static_cast<size_t>(t)] = win.g[static_cast<size_t>(t * Hv + hv)];
      bh[static_cast<size_t>(t)] = win.beta[static_cast<size_t>(t * Hv + hv)];
    }
    delta_rule_recurrent(&win.x[static_cast<size_t>(hk * Dk)], &win.x[static_cast<size_t>(Hk * Dk + hk * Dk)],
                         &win.x[static_cast<size_t>(2 * Hk * Dk + hv * Dv)], gh.data(), bh.data(), keep, Dk,
                         Dv, &state.ssm[static_cast<size_t>(hv * Dk * Dv)], scratch_o.data(), conv_dim,
                         conv_dim, Dv);
  }
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
