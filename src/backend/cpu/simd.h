// Small SIMD helpers shared by the CPU kernels (internal to backend/cpu).
#pragma once

#include <immintrin.h>

namespace mtpx::cpu {

// The sum of the 8 lanes of v in one fixed order, ((v0+v4) + (v1+v5)) + ((v2+v6) + (v3+v7)): kernels that
// promise batch invariance rely on the order being the same wherever it is used.
__attribute__((target("avx2"))) inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  sums = _mm_add_ss(sums, shuf);
  return _mm_cvtss_f32(sums);
}

}  // namespace mtpx::cpu
