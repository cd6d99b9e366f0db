#include "backend/cpu/ops.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/simd.h"

namespace mtpx::cpu {

// The hot inner loops of attention and the delta rule: compiled for AVX2+FMA and for baseline x86-64,
// picked at load time by the CPU (GCC function multiversioning); one version per machine.
#define MTPX_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))

namespace {

// What the CPU runs, for the kernels below that pick a version at run time.
bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}

bool cpu_has_avx512f() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") != 0;
}

}  // namespace

void rms_norm(const float* x, const float* weight, float eps, int64_t n, float* out) {
  float ss = dot(x, x, n);
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * scale) * weight[i];
}

void l2_normalize(float* x, float eps, int64_t n) {
  const float scale = 1.0f / std::sqrt(dot(x, x, n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

namespace {

// e^x in float32 without a libm call, 8 lanes at a time: glibc's expf is one call per element (4-5 ns),
// and the shipped model's activations made 9,000 of them per token, about a tenth of a decode step.
// Cephes' expf: x = n ln2 + r with ln2 in two parts (n C1 is exact, so r is accurate), e^r by its degree-7
// polynomial (relative error about 1e-7 on |r| <= ln2 / 2), 2^n built in the exponent bits. x is clamped to
// [-87, 88] so that 2^n stays a normal float, and e^x above 88 is +inf (so silu(-x) and sigmoid(-x) are 0
// there, as they should be); a NaN stays NaN.
// The vector and the scalar form run the same operations (products and sums, never fused), so a tail
// element gets the bits a vector lane would.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and taking it away rounds to an integer
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_clamped(float x) {
  if (x > 88.0f) return std::numeric_limits<float>::infinity();
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = (p * (r * r) + r) + 1.0f;
  // (A NaN n converts to nothing defined in C++: 2^0 then, and p is NaN already.)
  const int32_t exponent = n == n ? static_cast<int32_t>(n) : 0;
  return p * std::bit_cast<float>((exponent + 127) << 23);
}

__attribute__((target("avx2"))) inline __m256 exp_clamped8(__m256 x) {
  const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // (a NaN x is returned as is)
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  const __m256 round = _mm256_set1_ps(kRound);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), round), round);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Hi))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)),
                          _mm256_set1_ps(std::numeric_limits<float>::infinity()), overflow);
}

enum class Activation { kSwiglu, kSilu, kMulSigmoid, kExp };

// out[i] = silu(a[i]) * b[i] (kSwiglu), silu(a[i]) (kSilu), b[i] * sigmoid(a[i]) (kMulSigmoid) or
// e^(a[i] - b[0]) (kExp: b is one shift for every element).
template <Activation A>
inline float activation(float a, float b) {
  if constexpr (A == Activation::kExp) return exp_clamped(a - b);
  const float e = exp_clamped(-a);
  if constexpr (A == Activation::kSwiglu) return a / (1.0f + e) * b;
  if constexpr (A == Activation::kSilu) return a / (1.0f + e);
  return b * (1.0f / (1.0f + e));
}

template <Activation A>
__attribute__((target("avx2"))) void activation_avx2(const float* a, const float* b, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    if constexpr (A == Activation::kExp) {
      _mm256_storeu_ps(out + i, exp_clamped8(_mm256_sub_ps(av, _mm256_set1_ps(*b))));
      continue;
    }
    const __m256 e = exp_clamped8(_mm256_sub_ps(_mm256_setzero_ps(), av));
    __m256 y;
    if constexpr (A == Activation::kSwiglu)
      y = _mm256_mul_ps(_mm256_div_ps(av, _mm256_add_ps(one, e)), _mm256_loadu_ps(b + i));
    else if constexpr (A == Activation::kSilu)
      y = _mm256_div_ps(av, _mm256_add_ps(one, e));
    else
      y = _mm256_mul_ps(_mm256_loadu_ps(b + i), _mm256_div_ps(one, _mm256_add_ps(one, e)));
    _mm256_storeu_ps(out + i, y);
  }
  for (; i < n; ++i) out[i] = activation<A>(a[i], b == nullptr ? 0.0f : A == Activation::kExp ? *b : b[i]);
}

template <Activation A>
void apply_activation(const float* a, const float* b, int64_t n, float* out) {
  static const bool avx2 = cpu_has_avx2();
  if (avx2) {
    activation_avx2<A>(a, b, n, out);
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    out[i] = activation<A>(a[i], b == nullptr ? 0.0f : A == Activation::kExp ? *b : b[i]);
}

}  // namespace

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  apply_activation<Activation::kSwiglu>(gate, up, n, out);
}

void exp_shifted_in_place(float* x, int64_t n, float shift) {
  apply_activation<Activation::kExp>(x, &shift, n, x);  // b: the shift, shared by every element
}

void silu_in_place(float* x, int64_t n) { apply_activation<Activation::kSilu>(x, nullptr, n, x); }

void mul_sigmoid(const float* gate, int64_t n, float* x) {
  apply_activation<Activation::kMulSigmoid>(gate, x, n, x);
}

void add_inplace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

MTPX_MULTIVERSION float dot(const float* a, const float* b, int64_t n) {
  float part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

MTPX_MULTIVERSION void axpy(float a, const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

namespace {

// The same step with 64 columns of the state held in four 512-bit registers per pass (dv a multiple of
// 64): half the time of the AVX2 loops. Every element sees the same products and sums in the same order as
// in the loops below, and GCC fuses the same product-sum pairs into FMAs in both (the loops' AVX2 clone and
// these intrinsics alike), so the bits do not depend on which version runs: the DeltaRuleStep tests check
// it, since a state whose width is not a multiple of 64 takes the loops.
__attribute__((target("avx512f"))) void delta_rule_step_avx512(const float* S_in, float* S_out,
                                                               const float* q, const float* k, const float* v,
                                                               float decay, float beta, int64_t dk,
                                                               int64_t dv, float* o) {
  const __m512 decay_v = _mm512_set1_ps(decay), beta_v = _mm512_set1_ps(beta);
  for (int64_t c = 0; c < dv; c += 64) {
    __m512 kv[4], delta[4], out[4];
    for (int j = 0; j < 4; ++j) kv[j] = out[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
      const float* in = S_in + i * dv + c;
      float* row = S_out + i * dv + c;
      const __m512 ki = _mm512_set1_ps(k[i]);
      for (int j = 0; j < 4; ++j) {
        const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(in + 16 * j), decay_v);
        _mm512_storeu_ps(row + 16 * j, r);
        kv[j] = _mm512_add_ps(kv[j], _mm512_mul_ps(ki, r));
      }
    }
    for (int j = 0; j < 4; ++j)
      delta[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + c + 16 * j), kv[j]), beta_v);
    for (int64_t i = 0; i < dk; ++i) {
      float* row = S_out + i * dv + c;
      const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
      for (int j = 0; j < 4; ++j) {
        const __m512 r = _mm512_add_ps(_mm512_loadu_ps(row + 16 * j), _mm512_mul_ps(ki, delta[j]));
        _mm512_storeu_ps(row + 16 * j, r);
        out[j] = _mm512_add_ps(out[j], _mm512_mul_ps(qi, r));
      }
    }
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + c + 16 * j, out[j]);
  }
}

MTPX_MULTIVERSION void delta_rule_step_loops(const float* S_in, float* S_out, const float* q, const float* k,
                                             const float* v, float decay, float beta, int64_t dk, int64_t dv,
                                             float* o, float* scratch) {
  float* __restrict kv = scratch;
  float* __restrict delta = scratch + dv;
  for (int64_t j = 0; j < dv; ++j) kv[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* in = S_in + i * dv;
    float* row = S_out + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] = in[j] * decay;
      kv[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - kv[j]) * beta;
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S_out + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * delta[j];
      o[j] += qi * row[j];
    }
  }
}

}  // namespace

// One call per head and token, with the row loops inlined: called once per 64-float row (three axpy
// calls through the multiversion dispatch each), the same arithmetic took 8.5 us per layer and token on
// the shipped model, a sixth of a decode step (BENCHMARKS.md, session 8).
void delta_rule_step(const float* S_in, float* S_out, const float* q, const float* k, const float* v,
                     float decay, float beta, int64_t dk, int64_t dv, float* o, float* scratch) {
  static const bool avx512 = cpu_has_avx512f();
  if (avx512 && dv % 64 == 0) {
    delta_rule_step_avx512(S_in, S_out, q, k, v, decay, beta, dk, dv, o);
    return;
  }
  delta_rule_step_loops(S_in, S_out, q, k, v, decay, beta, dk, dv, o, scratch);
}

namespace {

bool have_avx2_fma() { return cpu_has_avx2() && __builtin_cpu_supports("fma"); }

// One key: an 8-lane FMA chain over the whole vectors, the horizontal sum, the scalar tail in order.
template <int R>
__attribute__((target("avx2,fma"))) inline void dot_keys_avx2(const float* q, const float* rows,
                                                              int64_t stride, int64_t d, float scale,
                                                              float* out) {
  const int64_t d8 = d / 8 * 8;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d8; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + r * stride + i), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum8(acc[r]);
    for (int64_t i = d8; i < d; ++i) s += q[i] * rows[r * stride + i];
    out[r] = s * scale;
  }
}

__attribute__((target("avx2,fma"))) void dot_rows_avx2(const float* q, const float* rows, int64_t stride,
                                                       int64_t n, int64_t d, float scale, float* out) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) dot_keys_avx2<4>(q, rows + j * stride, stride, d, scale, out + j);
  for (; j < n; ++j) dot_keys_avx2<1>(q, rows + j * stride, stride, d, scale, out + j);
}

// Rows [j0, j1) into NV vectors of 8 output dims held in registers: acc = fma(w_j, row_j, acc), j in
// order, the accumulators loaded from and stored back to acc_out (so a chain can be cut into key blocks).
template <int NV>
__attribute__((target("avx2,fma"))) inline void weighted_keys_avx2(const float* weights, const float* rows,
                                                                   int64_t stride, int64_t j0, int64_t j1,
                                                                   float* acc_out) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_loadu_ps(acc_out + 8 * v);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 wj = _mm256_set1_ps(weights[j]);
    for (int v = 0; v < NV; ++v)
      acc[v] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(rows + j * stride + 8 * v), acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc_out + 8 * v, acc[v]);
}

__attribute__((target("avx2,fma"))) void weighted_row_sum_avx2(const float* weights, const float* rows,
                                                               int64_t stride, int64_t n, int64_t d,
                                                               float* out) {
  const int64_t d8 = d / 8 * 8;
  std::fill_n(out, d8, 0.0f);
  int64_t i = 0;
  for (; i + 64 <= d8; i += 64) weighted_keys_avx2<8>(weights, rows + i, stride, 0, n, out + i);
  for (; i < d8; i += 8) weighted_keys_avx2<1>(weights, rows + i, stride, 0, n, out + i);
  for (; i < d; ++i) {
    float s = 0.0f;
    for (int64_t j = 0; j < n; ++j) s += weights[j] * rows[j * stride + i];
    out[i] = s;
  }
}

// dot_rows_multi on whole 8-float vectors (d % 8 == 0): blocks of 4 rows, and per block each query's
// dot_keys_avx2 (the block stays in L1 for the queries after the first).
__attribute__((target("avx2,fma"))) void dot_rows_multi_avx2(std::span<const float* const> queries,
                                                             std::span<const int64_t> n, const float* rows,
                                                             int64_t stride, int64_t d, float scale,
                                                             std::span<float* const> out) {
  const int64_t n_max = *std::max_element(n.begin(), n.end());
  for (int64_t j0 = 0; j0 < n_max; j0 += 4)
    for (size_t i = 0; i < queries.size(); ++i) {
      const int64_t valid = std::min<int64_t>(n[i] - j0, 4);
      if (valid == 4) {
        dot_keys_avx2<4>(queries[i], rows + j0 * stride, stride, d, scale, out[i] + j0);
      } else {
        for (int64_t j = j0; j < j0 + valid; ++j)
          dot_keys_avx2<1>(queries[i], rows + j * stride, stride, d, scale, out[i] + j);
      }
    }
}

// weighted_row_sum_multi on whole 8-float vectors: blocks of kKeyBlock rows (16 KiB at d = 64, in L1 for
// the queries after the first), per block and query the chains of weighted_row_sum_avx2 over 64 dims at a
// time, carried from block to block in `out`.
__attribute__((target("avx2,fma"))) void weighted_row_sum_multi_avx2(std::span<const float* const> weights,
                                                                     std::span<const int64_t> n,
                                                                     const float* rows, int64_t stride,
                                                                     int64_t d, std::span<float* const> out) {
  constexpr int64_t kKeyBlock = 64;
  for (float* o : out) std::fill_n(o, d, 0.0f);
  const int64_t n_max = *std::max_element(n.begin(), n.end());
  for (int64_t j0 = 0; j0 < n_max; j0 += kKeyBlock)
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t j1 = std::min(j0 + kKeyBlock, n[i]);
      if (j1 <= j0) continue;
      int64_t c = 0;
      for (; c + 64 <= d; c += 64) weighted_keys_avx2<8>(weights[i], rows + c, stride, j0, j1, out[i] + c);
      for (; c < d; c += 8) weighted_keys_avx2<1>(weights[i], rows + c, stride, j0, j1, out[i] + c);
    }
}

}  // namespace

void dot_rows_multi(std::span<const float* const> queries, std::span<const int64_t> n, const float* rows,
                    int64_t stride, int64_t d, float scale, std::span<float* const> out) {
  if (queries.empty()) return;
  static const bool simd = have_avx2_fma();
  if (simd && d % 8 == 0) {
    dot_rows_multi_avx2(queries, n, rows, stride, d, scale, out);
    return;
  }
  for (size_t i = 0; i < queries.size(); ++i) dot_rows(queries[i], rows, stride, n[i], d, scale, out[i]);
}

void weighted_row_sum_multi(std::span<const float* const> weights, std::span<const int64_t> n,
                            const float* rows, int64_t stride, int64_t d, std::span<float* const> out) {
  if (weights.empty()) return;
  static const bool simd = have_avx2_fma();
  if (simd && d % 8 == 0) {
    weighted_row_sum_multi_avx2(weights, n, rows, stride, d, out);
    return;
  }
  for (size_t i = 0; i < weights.size(); ++i) weighted_row_sum(weights[i], rows, stride, n[i], d, out[i]);
}

void dot_rows(const float* q, const float* rows, int64_t stride, int64_t n, int64_t d, float scale,
              float* out) {
  static const bool simd = have_avx2_fma();  // a property of the CPU
  if (simd) {
    dot_rows_avx2(q, rows, stride, n, d, scale, out);
    return;
  }
  for (int64_t j = 0; j < n; ++j) out[j] = dot(q, rows + j * stride, d) * scale;
}

void weighted_row_sum(const float* weights, const float* rows, int64_t stride, int64_t n, int64_t d,
                      float* out) {
  static const bool simd = have_avx2_fma();
  if (simd) {
    weighted_row_sum_avx2(weights, rows, stride, n, d, out);
    return;
  }
  std::fill_n(out, d, 0.0f);
  for (int64_t j = 0; j < n; ++j) axpy(weights[j], rows + j * stride, d, out);
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda),
              b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

namespace {

__attribute__((target("avx2"))) int32_t argmax_avx2(const float* x, int64_t n) {
  const int64_t n8 = n / 8 * 8;
  __m256 best = _mm256_loadu_ps(x);
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  for (int64_t i = 8; i < n8; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    best = _mm256_max_ps(best, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  float top = lanes[0];
  for (int j = 1; j < 8; ++j) top = lanes[j] > top ? lanes[j] : top;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t i = n8; i < n; ++i) {
    has_nan = has_nan || x[i] != x[i];
    top = x[i] > top ? x[i] : top;
  }
  if (has_nan) return argmax(x, n);
  // The first position holding the largest value (+0 and -0 compare equal, as in argmax's comparison).
  const __m256 target = _mm256_set1_ps(top);
  for (int64_t i = 0; i < n8; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (mask != 0) return static_cast<int32_t>(i + __builtin_ctz(static_cast<unsigned>(mask)));
  }
  for (int64_t i = n8; i < n; ++i)
    if (x[i] == top) return static_cast<int32_t>(i);
  return argmax(x, n);  // unreachable: top is one of the values
}

}  // namespace

int32_t argmax_rows_kernel(const float* x, int64_t n) {
  static const bool avx2 = cpu_has_avx2();
  return avx2 && n >= 8 ? argmax_avx2(x, n) : argmax(x, n);
}

namespace {

// On the bits (an all-ones exponent is NaN or Inf), so -ffast-math could not fold it away.
bool all_finite_scalar(const float* x, int64_t n) {
  uint32_t worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    worst = std::max(worst, bits & 0x7f800000u);
  }
  return worst != 0x7f800000u;
}

// 32 values per step: an exponent field is all ones exactly when (bits & mask) == mask. (The scalar loop
// compiles to baseline SSE2, which has no unsigned max: 2 us per 8192-id logit row, checked once per row of
// every pass, against 0.3 us here.)
__attribute__((target("avx2"))) bool all_finite_avx2(const float* x, int64_t n) {
  const __m256i mask = _mm256_set1_epi32(0x7f800000);
  __m256i any = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256i e =
          _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8 * j)), mask);
      any = _mm256_or_si256(any, _mm256_cmpeq_epi32(e, mask));
    }
  return _mm256_testz_si256(any, any) != 0 && all_finite_scalar(x + i, n - i);
}

}  // namespace

bool all_finite(const float* x, int64_t n) {
  static const bool avx2 = cpu_has_avx2();
  return avx2 ? all_finite_avx2(x, n) : all_finite_scalar(x, n);
}

}  // namespace mtpx::cpu
