#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cpu/ops.h"
#include "model/input_statistics.h"

namespace mtpx {

namespace {

// cos and sin of the rotary angles of one position, computed once and applied to every head (they were
// computed per head: pow, cos and sin in double for each pair, a few us per token and layer).
struct RopeAngles {
  std::vector<float> cos, sin;  // [rotary_dim / 2]
  RopeAngles(int64_t rotary_dim, double theta, int64_t pos) {
    const int64_t half = rotary_dim / 2;
    cos.resize(static_cast<size_t>(half));
    sin.resize(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      // As transformers computes it: inv_freq and the angle in float32, cos/sin of the float32 angle.
      const float inv_freq = static_cast<float>(
          1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim)));
      const float angle = static_cast<float>(pos) * inv_freq;
      cos[static_cast<size_t>(i)] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin[static_cast<size_t>(i)] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
  void apply(float* x) const {
    const size_t half = cos.size();
    for (size_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = b * cos[i] + a * sin[i];
    }
  }
};

}  // namespace

void apply_partial_rope(float* x, int64_t rotary_dim, double theta, int64_t pos) {
  RopeAngles(rotary_dim, theta, pos).apply(x);
}

namespace {

// Softmax of scores[0..n) in place (max-subtracted), scaled so the weights sum to 1.
void softmax_in_place(float* scores, int64_t n) {
  float max_score = -INFINITY;
  for (int64_t j = 0; j < n; ++j) max_score = std::max(max_score, scores[j]);
  cpu::exp_shifted_in_place(scores, n, max_score);
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += scores[j];
  const float inv_sum = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) scores[j] *= inv_sum;
}

// Decode and verify windows, one (query, head) at a time, in key order, so a row's result does not depend on
// how many rows share the call (batch invariance). Rows p0 .. p0+T-1; qg: [T, nq, 2D] (query | gate);
// o: [T, nq, D].
void attend_rows_per_query(const float* qg, const KvCache& cache, int64_t p0, int64_t T, int64_t nq,
                           int64_t nkv, int64_t D, float scale, float* o) {
  const int64_t group = nq / nkv, max_keys = p0 + T;
#pragma omp parallel if (T * nq * max_keys * D >= (1 << 16))
  {
    std::vector<float> scores(static_cast<size_t>(max_keys));
#pragma omp for schedule(static) collapse(2)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t hq = 0; hq < nq; ++hq) {
        const int64_t n_keys = p0 + t + 1;
        const int64_t hk = hq / group;
        const float* q = &qg[(t * nq + hq) * 2 * D];
        cpu::dot_rows(q, &cache.keys[static_cast<size_t>(hk * D)], nkv * D, n_keys, D, scale, scores.data());
        softmax_in_place(scores.data(), n_keys);
        cpu::weighted_row_sum(scores.data(), &cache.values[static_cast<size_t>(hk * D)], nkv * D, n_keys, D,
                              &o[(t * nq + hq) * D]);
      }
    }
  }
}

// The same per KV head: the queries of its query heads in every row of the window, through the multi-query
// kernels (each query bit-identical to its own call, so the two ways give the same bits). Each key and
// value row is read once per KV head and window instead of once per query: at a 4096-token context the
// cache no longer fits L2, and a 4-row verify pass of the shipped model took 2.8x a decode step
// (BENCHMARKS.md, session 13). The threads split each KV head's keys for the scores and its dims for the
// weighted sums (every chain stays whole), so a model with few KV heads still keeps many cores busy.
void attend_rows_per_kv_head(const float* qg, const KvCache& cache, int64_t p0, int64_t T, int64_t nq,
                             int64_t nkv, int64_t D, float scale, float* o) {
  constexpr int64_t kKeysPerTask = 256, kDimsPerTask = 64;
  const int64_t group = nq / nkv, max_keys = p0 + T, queries = T * group;
  const int64_t key_tasks = (max_keys + kKeysPerTask - 1) / kKeysPerTask;
  // Off whole 8-float vectors a part of the dims would take another kernel than the whole.
  const int64_t dim_tasks = D % 8 == 0 ? (D + kDimsPerTask - 1) / kDimsPerTask : 1;
  std::vector<float> scores(static_cast<size_t>(nkv * queries * max_keys));
  // Query i of KV head hk: row i / group of the window, query head hk * group + i % group.
  auto head_row = [&](int64_t hk, int64_t i) { return (i / group) * nq + hk * group + i % group; };
  auto n_keys = [&](int64_t i) { return p0 + i / group + 1; };
  auto weights = [&](int64_t hk, int64_t i) {
    return &scores[static_cast<size_t>((hk * queries + i) * max_keys)];
  };
  const bool parallel = T * nq * max_keys * D >= (1 << 16);
#pragma omp parallel if (parallel)
  {
    std::vector<const float*> in(static_cast<size_t>(queries)), w(static_cast<size_t>(queries));
    std::vector<float*> out(static_cast<size_t>(queries));
    std::vector<int64_t> n(static_cast<size_t>(queries));
    // Scores: keys [j0, j0 + kKeysPerTask) of KV head hk for all its queries.
#pragma omp for schedule(static) collapse(2)
    for (int64_t hk = 0; hk < nkv; ++hk)
      for (int64_t task = 0; task < key_tasks; ++task) {
        const int64_t j0 = task * kKeysPerTask;
        for (int64_t i = 0; i < queries; ++i) {
          in[static_cast<size_t>(i)] = &qg[head_row(hk, i) * 2 * D];
          n[static_cast<size_t>(i)] = std::clamp<int64_t>(n_keys(i) - j0, 0, kKeysPerTask);
          out[static_cast<size_t>(i)] = weights(hk, i) + j0;
        }
        cpu::dot_rows_multi(in, n, &cache.keys[static_cast<size_t>(j0 * nkv * D + hk * D)], nkv * D, D, scale,
                            out);
      }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nkv * queries; ++r) {
      softmax_in_place(&scores[static_cast<size_t>(r * max_keys)], n_keys(r % queries));
    }
    // Weighted sums: dims [c0, c0 + kDimsPerTask) of KV head hk for all its queries, over all their keys.
#pragma omp for schedule(static) collapse(2)
    for (int64_t hk = 0; hk < nkv; ++hk)
      for (int64_t task = 0; task < dim_tasks; ++task) {
        const int64_t c0 = task * kDimsPerTask, dims = dim_tasks == 1 ? D : std::min(kDimsPerTask, D - c0);
        for (int64_t i = 0; i < queries; ++i) {
          w[static_cast<size_t>(i)] = weights(hk, i);
          n[static_cast<size_t>(i)] = n_keys(i);
          out[static_cast<size_t>(i)] = &o[head_row(hk, i) * D + c0];
        }
        cpu::weighted_row_sum_multi(w, n, &cache.values[static_cast<size_t>(hk * D + c0)], nkv * D, dims,
                                    out);
      }
  }
}

// Contexts from which the shared reads pay: below it a head's keys and values sit in L2 anyway, and the
// per-query loop measured 1-2% faster on the held-out samples (contexts of 64-128 tokens).
constexpr int64_t kSharedKvMinKeys = 512;

void attend_rows(const float* qg, const KvCache& cache, int64_t p0, int64_t T, int64_t nq, int64_t nkv,
                 int64_t D, float scale, float* o) {
  if (p0 + T >= kSharedKvMinKeys)
    attend_rows_per_kv_head(qg, cache, p0, T, nq, nkv, D, scale, o);
  else
    attend_rows_per_query(qg, cache, p0, T, nq, nkv, D, scale, o);
}

// Prefill: blocks of queries per head as two GEMMs, scores = Q K^T and o = P V (P masked causally).
void attend_blocks(const float* qg, const KvCache& cache, int64_t p0, int64_t T, int64_t nq, int64_t nkv,
                   int64_t D, float scale, float* o) {
  constexpr int64_t kBlock = 64;
  const int64_t group = nq / nkv, blocks = (T + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic) collapse(2)
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t hq = 0; hq < nq; ++hq) {
        const int64_t t0 = b * kBlock, rows = std::min(kBlock, T - t0), n = p0 + t0 + rows;
        const int64_t hk = hq / group;
        scores.resize(static_cast<size_t>(rows * n));
        cpu::gemm(false, true, rows, n, D, scale, &qg[(t0 * nq + hq) * 2 * D], nq * 2 * D,
                  &cache.keys[hk * D], nkv * D, 0.0f, scores.data(), n);
        for (int64_t i = 0; i < rows; ++i) {
          float* si = &scores[static_cast<size_t>(i * n)];
          const int64_t n_keys = p0 + t0 + i + 1;
          softmax_in_place(si, n_keys);
          std::fill(si + n_keys, si + n, 0.0f);
        }
        cpu::gemm(false, false, rows, D, n, 1.0f, scores.data(), n, &cache.values[hk * D], nkv * D, 0.0f,
                  &o[(t0 * nq + hq) * D], nq * D);
      }
    }
  }
}

}  // namespace

AttentionRows::AttentionRows(const ModelConfig& c, int64_t T)
    : qg(static_cast<size_t>(T * c.num_attention_heads * 2 * c.head_dim)),
      k(static_cast<size_t>(T * c.num_kv_heads * c.head_dim)),
      v(static_cast<size_t>(T * c.num_kv_heads * c.head_dim)) {}

void attention_project(const AttentionWeights& w, const ModelConfig& c, const float* h, int64_t T,
                       int64_t out_rows, AttentionRows& rows) {
  const int64_t skip = T - out_rows;  // rows that only fill the cache
  if (skip > 0 && T >= cpu::kGemmMinRows) {
    // A prompt pass of the MTP head: the queries of the last rows only.
    const cpu::MatmulTarget kv[] = {{&w.k_proj, rows.k.data()}, {&w.v_proj, rows.v.data()}};
    cpu::matmul_shared_input(kv, h, T);
    cpu::matmul(w.q_proj, h + skip * c.hidden_size, out_rows,
                &rows.qg[static_cast<size_t>(skip * c.num_attention_heads * 2 * c.head_dim)]);
  } else {
    // Decode and verify windows: one thread team for all three (the extra query rows cost little).
    const cpu::MatmulTarget qkv[] = {
        {&w.q_proj, rows.qg.data()}, {&w.k_proj, rows.k.data()}, {&w.v_proj, rows.v.data()}};
    cpu::matmul_shared_input(qkv, h, T);
  }
}

void attention_mix(const AttentionWeights& w, const ModelConfig& c, KvCache& cache, int64_t p0, int64_t T,
                   int64_t out_rows, AttentionRows& rows, float* o) {
  const int64_t D = c.head_dim, nq = c.num_attention_heads, nkv = c.num_kv_heads;
  const int64_t skip = T - out_rows;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float>& qg = rows.qg;
  std::vector<float>& k = rows.k;
  const std::vector<float>& v = rows.v;

  // The cache grows with the positions used (std::vector doubles its capacity): a state's memory follows
  // the tokens processed, not the prompt + max_tokens it was created for.
  const size_t used = static_cast<size_t>((p0 + T) * nkv * D);
  if (cache.keys.size() < used) {
    cache.keys.resize(used);
    cache.values.resize(used);
  }

  // q/k norm and RoPE; keys and values go to the cache at their positions.
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = p0 + t;
    const RopeAngles rope(c.rotary_dim, c.rope_theta, pos);
    for (int64_t hq = 0; t >= skip && hq < nq; ++hq) {
      float* q = &qg[static_cast<size_t>((t * nq + hq) * 2 * D)];
      cpu::rms_norm(q, w.q_norm.data(), eps, D, q);
      rope.apply(q);
    }
    for (int64_t hk = 0; hk < nkv; ++hk) {
      float* kk = &k[static_cast<size_t>((t * nkv + hk) * D)];
      cpu::rms_norm(kk, w.k_norm.data(), eps, D, kk);
      rope.apply(kk);
    }
    std::copy_n(&k[static_cast<size_t>(t * nkv * D)], nkv * D,
                &cache.keys[static_cast<size_t>(pos * nkv * D)]);
    std::copy_n(&v[static_cast<size_t>(t * nkv * D)], nkv * D,
                &cache.values[static_cast<size_t>(pos * nkv * D)]);
  }

  // o[t, hq] = softmax(q k^T / sqrt(D)) v over positions 0..p0+t, then * sigmoid(gate); for the last
  // out_rows rows only.
  const float* qg_out = &qg[static_cast<size_t>(skip * nq * 2 * D)];
  if (out_rows >= cpu::kGemmMinRows)
    attend_blocks(qg_out, cache, p0 + skip, out_rows, nq, nkv, D, scale, o);
  else
    attend_rows(qg_out, cache, p0 + skip, out_rows, nq, nkv, D, scale, o);
  for (int64_t t = 0; t < out_rows; ++t)
    for (int64_t hq = 0; hq < nq; ++hq) {
      float* od = &o[static_cast<size_t>((t * nq + hq) * D)];
      const float* gate = &qg_out[static_cast<size_t>((t * nq + hq) * 2 * D + D)];
      cpu::mul_sigmoid(gate, D, od);
    }
}

void gated_attention_forward(const AttentionWeights& w, const ModelConfig& c, KvCache& cache, int64_t p0,
                             const float* h, int64_t T, float* out, int64_t out_rows,
                             InputStatistics* stats) {
  const int64_t skip = T - out_rows;
  AttentionRows rows(c, T);
  attention_project(w, c, h, T, out_rows, rows);
  std::vector<float> o(
      static_cast<size_t>(out_rows * c.num_attention_heads * c.head_dim));  // [out_rows, nq, D]
  attention_mix(w, c, cache, p0, T, out_rows, rows, o.data());
  cpu::matmul(w.o_proj, o.data(), out_rows, out);
  if (stats != nullptr) {
    stats->add(w.q_proj, h + skip * c.hidden_size, out_rows);
    stats->add(w.k_proj, h, T);
    stats->add(w.v_proj, h, T);
    stats->add(w.o_proj, o.data(), out_rows);
  }
}

}  // namespace mtpx
