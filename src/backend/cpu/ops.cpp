#include "backend/cpu/ops.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "backend/cpu/simd.h"

namespace mtpx::cpu {

// The hot inner loops of attention and the delta rule: compiled for AVX2+FMA and for baseline x86-64,
// picked at load time by the CPU (GCC function multiversioning); one version per machine.
#define MTPX_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))

void rms_norm(const float* x, const float* weight, float eps, int64_t n, float* out) {
  float ss = dot(x, x, n);
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * scale) * weight[i];
}

void l2_normalize(float* x, float eps, int64_t n) {
  const float scale = 1.0f / std::sqrt(dot(x, x, n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

MTPX_MULTIVERSION void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
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

bool have_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

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

// NV vectors of output dims held in registers across all n rows: out = fma(w_j, row_j, out), j in order.
template <int NV>
__attribute__((target("avx2,fma"))) inline void weighted_block_avx2(const float* weights, const float* rows,
                                                                    int64_t stride, int64_t n, float* out) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 wj = _mm256_set1_ps(weights[j]);
    for (int v = 0; v < NV; ++v)
      acc[v] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(rows + j * stride + 8 * v), acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
}

__attribute__((target("avx2,fma"))) void weighted_row_sum_avx2(const float* weights, const float* rows,
                                                               int64_t stride, int64_t n, int64_t d,
                                                               float* out) {
  const int64_t d8 = d / 8 * 8;
  int64_t i = 0;
  for (; i + 64 <= d8; i += 64) weighted_block_avx2<8>(weights, rows + i, stride, n, out + i);
  for (; i < d8; i += 8) weighted_block_avx2<1>(weights, rows + i, stride, n, out + i);
  for (; i < d; ++i) {
    float s = 0.0f;
    for (int64_t j = 0; j < n; ++j) s += weights[j] * rows[j * stride + i];
    out[i] = s;
  }
}

}  // namespace

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

bool all_finite(const float* x, int64_t n) {
  // On the bits (an all-ones exponent is NaN or Inf): vectorizes, and -ffast-math could not fold it away.
  uint32_t worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    worst = std::max(worst, bits & 0x7f800000u);
  }
  return worst != 0x7f800000u;
}

}  // namespace mtpx::cpu
