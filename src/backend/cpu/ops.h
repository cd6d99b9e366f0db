// Small row-wise float32 operations. Each row is processed alone, in a fixed order (batch-invariant).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

namespace mtpx::cpu {

// out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i], over n elements. `weight` already holds the
// effective multiplier (for the zero-centered Qwen3.5 norm, 1 + w is folded in at load time).
// out may alias x.
void rms_norm(const float* x, const float* weight, float eps, int64_t n, float* out);

// x[i] /= sqrt(sum(x^2) + eps)  (the l2norm of the Gated DeltaNet q and k).
void l2_normalize(float* x, float eps, int64_t n);

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// log(1 + e^x) as torch.nn.functional.softplus (threshold 20: linear above).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Elementwise activations over rows, vectorized (a polynomial e^x within about 1e-7 relative error of
// std::exp, instead of one libm call per element):
// swiglu: out[i] = silu(gate[i]) * up[i];  silu_in_place: x[i] = silu(x[i]);  mul_sigmoid: x[i] *=
// sigmoid(gate[i]).
void swiglu(const float* gate, const float* up, int64_t n, float* out);
// x[i] = e^(x[i] - shift) (attention's softmax numerators), with the same polynomial e^x.
void exp_shifted_in_place(float* x, int64_t n, float shift);
void silu_in_place(float* x, int64_t n);
void mul_sigmoid(const float* gate, int64_t n, float* x);

// x[i] += y[i]
void add_inplace(float* x, const float* y, int64_t n);

// Dot product in a fixed order (double-free, 8 interleaved partial sums).
float dot(const float* a, const float* b, int64_t n);

// y[i] += a * x[i]
void axpy(float a, const float* x, int64_t n, float* y);

// One token of the gated delta rule for one head (spec §4.2) on a state [dk, dv] row-major, from S_in to
// S_out (the same array for an update in place, or another: a verify window keeps each token's state):
//   S = decay S_in;  kv = k^T S;  delta = beta (v - kv);  S_out = S + k delta^T;  o = q^T S_out
// in a fixed order (rows i = 0..dk-1 in turn, per element), so a token gives the same bits whether it runs
// alone or inside a verify window. scratch: 2 dv floats.
void delta_rule_step(const float* S_in, float* S_out, const float* q, const float* k, const float* v,
                     float decay, float beta, int64_t dk, int64_t dv, float* o, float* scratch);

// Attention over a KV cache, one query at a time. rows[j] = rows + j * stride.
// dot_rows:          out[j] = scale * (q . rows[j]) for j < n;
// weighted_row_sum:  out[i] = sum_j weights[j] * rows[j][i], j = 0..n-1 in order, for i < d.
// Each output is computed by the same operations whatever n is (what makes a verify row equal a decode
// step); several keys or dims are in flight at once, so the FMA latency chains overlap.
void dot_rows(const float* q, const float* rows, int64_t stride, int64_t n, int64_t d, float scale,
              float* out);
void weighted_row_sum(const float* weights, const float* rows, int64_t stride, int64_t n, int64_t d,
                      float* out);

// The same for several queries over the same rows (the query heads of one KV head, and the rows of a verify
// window): query i reads rows j < n[i]. Every output is bit-identical to dot_rows / weighted_row_sum of that
// query alone, but each row is read from memory once for all the queries (the others find it in L1): at a
// long context the KV cache no longer fits the caches, and one read per query was what a step cost.
void dot_rows_multi(std::span<const float* const> queries, std::span<const int64_t> n, const float* rows,
                    int64_t stride, int64_t d, float scale, std::span<float* const> out);
void weighted_row_sum_multi(std::span<const float* const> weights, std::span<const int64_t> n,
                            const float* rows, int64_t stride, int64_t d, std::span<float* const> out);

// C = alpha op(A) op(B) + beta C on row-major float32 matrices, op(X) = X or X^T: C [m, n], op(A) [m, k],
// op(B) [k, n], leading dimensions in floats. OpenBLAS sgemm: multi-threaded when called alone, serial
// inside an OpenMP parallel region (the OpenMP build of OpenBLAS). Not batch-invariant: for prefill only.
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// True when no element is NaN or +-Inf.
bool all_finite(const float* x, int64_t n);

// The index of the largest of x[0..n), the lowest on ties (n >= 1). What greedy decoding picks; the CUDA
// argmax_rows kernel gives the same index. (Inline: the sampler's fuzz build links no kernels.)
inline int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return static_cast<int32_t>(best);
}

// The same index as argmax(), 8 lanes at a time (the largest value by a vector max, then its first
// position): the greedy passes' argmax over the shipped model's 8192 logits took 8 us a row in the loop
// above, three rows per speculative step. Input with a NaN takes the loop above.
int32_t argmax_rows_kernel(const float* x, int64_t n);

}  // namespace mtpx::cpu
