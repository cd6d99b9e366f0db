#include "backend/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

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
