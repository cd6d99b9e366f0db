#include "backend/cpu/matmul.h"

// GCC 12 reports its own _mm512_undefined_* helpers inside the AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/cpu/quant_matmul.h"
#include "util/bf16.h"
#include "util/error.h"

namespace mtpx::cpu {
namespace {

// At most kRows activation rows share a tile's weight loads.
constexpr int64_t kRows = 4;
// Activation rows processed per block, so the block of x stays in L2 while the weights stream by.
constexpr int64_t kRowBlock = 32;

float load_scalar(const void* data, WeightType type, int64_t index) {
  switch (type) {
    case WeightType::kF32:
      return static_cast<const float*>(data)[index];
    case WeightType::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(data)[index]);
    case WeightType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(data)[index]);
    case WeightType::kAffine:
      break;  // codes are not addressable one by one: the affine kernels read them
  }
  return 0.0f;
}

template <WeightType T>
constexpr int64_t kWeightBytes = T == WeightType::kF32 ? 4 : 2;
// One prefetch per 64-byte line, into the rows of the output tile kPrefetchTiles ahead (the same
// thread's tiles under the static schedule are adjacent in memory). Two tiles ahead looked faster on an
// isolated lm_head but not in whole-model decode (paired runs, AVX2 EPYC, 2 threads), so one.
constexpr int64_t kPrefetchTiles = 1;
template <WeightType T>
constexpr int64_t kPrefetchMask = 64 / kWeightBytes<T> - 1;

// ---------------------------------------------------------------------------------------------
// SIMD tiles. A tile computes NR activation rows x NO output features with one vector accumulator
// per (row, output); NR and NO are compile-time so the accumulators live in registers. Every (m, o)
// runs the same instruction sequence whatever the tile shape: lane-blocked FMAs over k in order, one
// fixed horizontal sum, then the scalar tail in order.

// AVX-512: 16 lanes. Loads widen bf16 by a 16-bit shift and f16 with vcvtph2ps.
template <WeightType T>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) inline __m512 load16(const void* base,
                                                                              int64_t index) {
  if constexpr (T == WeightType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + index);
  } else if constexpr (T == WeightType::kF16) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index)));
  } else {
    __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <WeightType T, int NR, int NO>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void tile_avx512(const WeightMatrix& w,
                                                                          const float* x, int64_t m0,
                                                                          int64_t o0, float* y) {
  const int64_t k_dim = w.cols;
  const int64_t k_vec = k_dim / 16 * 16;
  __m512 acc[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_setzero_ps();
  const char* wbytes = static_cast<const char*>(w.data);
  for (int64_t k = 0; k < k_vec; k += 16) {
    if ((k & kPrefetchMask<T>) == 0)
      for (int o = 0; o < NO; ++o)
        _mm_prefetch(wbytes + ((o0 + kPrefetchTiles * NO + o) * k_dim + k) * kWeightBytes<T>, _MM_HINT_T0);
    __m512 wv[NO];
    for (int o = 0; o < NO; ++o) wv[o] = load16<T>(w.data, (o0 + o) * k_dim + k);
    for (int r = 0; r < NR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + r) * k_dim + k);
      for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) {
      float s = _mm512_reduce_add_ps(acc[r][o]);
      for (int64_t k = k_vec; k < k_dim; ++k)
        s += x[(m0 + r) * k_dim + k] * load_scalar(w.data, T, (o0 + o) * k_dim + k);
      y[(m0 + r) * w.rows + o0 + o] = s;
    }
}

// AVX2 + FMA (+F16C): 8 lanes.
template <WeightType T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const void* base, int64_t index) {
  if constexpr (T == WeightType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + index);
  } else if constexpr (T == WeightType::kF16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index)));
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  sums = _mm_add_ss(sums, shuf);
  return _mm_cvtss_f32(sums);
}

template <WeightType T, int NR, int NO>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const WeightMatrix& w, const float* x, int64_t m0,
                                                        int64_t o0, float* y) {
  const int64_t k_dim = w.cols;
  const int64_t k_vec = k_dim / 8 * 8;
  __m256 acc[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm256_setzero_ps();
  const char* wbytes = static_cast<const char*>(w.data);
  int64_t k_start = 0;
  if constexpr (T == WeightType::kBF16) {
    // bf16 by 16: one 32-byte load per weight row, widened by interleaving with zeros (unpacklo/hi_epi16
    // yield k = {0-3, 8-11} and {4-7, 12-15} of the block); x is permuted to match. Fewer uops per weight
    // byte than zero-extend + shift, measured 15-20% faster in decode-shaped products on AVX2 EPYC.
    const __m256i zero = _mm256_setzero_si256();
    const int64_t k16 = k_dim / 16 * 16;
    for (int64_t k = 0; k < k16; k += 16) {
      if ((k & kPrefetchMask<T>) == 0)
        for (int o = 0; o < NO; ++o)
          _mm_prefetch(wbytes + ((o0 + kPrefetchTiles * NO + o) * k_dim + k) * kWeightBytes<T>, _MM_HINT_T0);
      __m256 w_lo[NO], w_hi[NO];
      for (int o = 0; o < NO; ++o) {
        const __m256i h = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w.data) + (o0 + o) * k_dim + k));
        w_lo[o] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h));
        w_hi[o] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h));
      }
      for (int r = 0; r < NR; ++r) {
        const __m256 xa = _mm256_loadu_ps(x + (m0 + r) * k_dim + k);
        const __m256 xb = _mm256_loadu_ps(x + (m0 + r) * k_dim + k + 8);
        const __m256 x_lo = _mm256_permute2f128_ps(xa, xb, 0x20);
        const __m256 x_hi = _mm256_permute2f128_ps(xa, xb, 0x31);
        for (int o = 0; o < NO; ++o) {
          acc[r][o] = _mm256_fmadd_ps(x_lo, w_lo[o], acc[r][o]);
          acc[r][o] = _mm256_fmadd_ps(x_hi, w_hi[o], acc[r][o]);
        }
      }
    }
    k_start = k16;
  }
  for (int64_t k = k_start; k < k_vec; k += 8) {
    // Software prefetch of the next tile: a tile reads NO interleaved short streams, which the hardware
    // prefetcher follows poorly.
    if ((k & kPrefetchMask<T>) == 0)
      for (int o = 0; o < NO; ++o)
        _mm_prefetch(wbytes + ((o0 + kPrefetchTiles * NO + o) * k_dim + k) * kWeightBytes<T>, _MM_HINT_T0);
    __m256 wv[NO];
    for (int o = 0; o < NO; ++o) wv[o] = load8<T>(w.data, (o0 + o) * k_dim + k);
    for (int r = 0; r < NR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + r) * k_dim + k);
      for (int o = 0; o < NO; ++o) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) {
      float s = hsum8(acc[r][o]);
      for (int64_t k = k_vec; k < k_dim; ++k)
        s += x[(m0 + r) * k_dim + k] * load_scalar(w.data, T, (o0 + o) * k_dim + k);
      y[(m0 + r) * w.rows + o0 + o] = s;
    }
}

// ---------------------------------------------------------------------------------------------
// Portable fallback: 8 interleaved partial sums per (m, o), then a fixed pairwise sum.
template <WeightType T, int NR, int NO>
void tile_scalar(const WeightMatrix& w, const float* x, int64_t m0, int64_t o0, float* y) {
  const int64_t k_dim = w.cols;
  for (int r = 0; r < NR; ++r) {
    const float* xr = x + (m0 + r) * k_dim;
    for (int o = 0; o < NO; ++o) {
      const int64_t wo = (o0 + o) * k_dim;
      float part[8] = {};
      int64_t k = 0;
      for (; k + 8 <= k_dim; k += 8)
        for (int j = 0; j < 8; ++j) part[j] += xr[k + j] * load_scalar(w.data, T, wo + k + j);
      float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      for (; k < k_dim; ++k) s += xr[k] * load_scalar(w.data, T, wo + k);
      y[(m0 + r) * w.rows + o0 + o] = s;
    }
  }
}

enum class Path { kAvx512, kAvx2, kScalar };

Path detect_path() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return Path::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Path::kAvx2;
  return Path::kScalar;
}

Path path() {
  static const Path p = detect_path();  // a property of the CPU, computed once
  return p;
}

using TileFn = void (*)(const WeightMatrix&, const float*, int64_t, int64_t, float*);

// Tile functions for one path and weight type, indexed [rows in tile - 1][outputs in tile - 1].
// Decode (one row) uses wide output tiles for more independent FMA chains; several rows use a square-ish
// tile that fits the register file (AVX2: 16 ymm, AVX-512: 32 zmm).
struct TileSet {
  TileFn tiles[4][8];
  int outputs_single_row;  // output tile width when the block has 1 row (decode)
  int outputs_two_rows;    // ... 2 rows (a K=1 verify window): keeps 8 (AVX2) / 16 (AVX-512) accumulators
  int outputs_multi_row;   // ... 3 or more rows
};

#define MTPX_ROW(F, T, R) \
  { F<T, R, 1>, F<T, R, 2>, F<T, R, 3>, F<T, R, 4>, F<T, R, 5>, F<T, R, 6>, F<T, R, 7>, F<T, R, 8> }
#define MTPX_TILESET(F, T, SINGLE, TWO, MULTI) \
  TileSet { {MTPX_ROW(F, T, 1), MTPX_ROW(F, T, 2), MTPX_ROW(F, T, 3), MTPX_ROW(F, T, 4)}, SINGLE, TWO, MULTI }

template <WeightType T>
const TileSet& tiles_for(Path p) {
  static const TileSet avx512 = MTPX_TILESET(tile_avx512, T, 8, 8, 4);
  static const TileSet avx2 = MTPX_TILESET(tile_avx2, T, 8, 4, 3);
  static const TileSet scalar = MTPX_TILESET(tile_scalar, T, 4, 4, 4);
  switch (p) {
    case Path::kAvx512:
      return avx512;
    case Path::kAvx2:
      return avx2;
    case Path::kScalar:
      return scalar;
  }
  return scalar;
}

const TileSet& select_tiles(WeightType type) {
  switch (type) {
    case WeightType::kF32:
      return tiles_for<WeightType::kF32>(path());
    case WeightType::kF16:
      return tiles_for<WeightType::kF16>(path());
    case WeightType::kBF16:
    case WeightType::kAffine:
      break;
  }
  return tiles_for<WeightType::kBF16>(path());
}

// Prefill: y = x W^T through sgemm, on blocks of output rows widened to float32 (f32 weights are used
// in place). A block of kGemmBlockRows x cols floats is small next to the weights and is reused for all M
// rows, so the widening costs 1/M of the multiply-adds.
constexpr int64_t kGemmBlockRows = 512;

void matmul_gemm(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  const int64_t k = w.cols;
  if (w.type == WeightType::kF32) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(w.rows),
                static_cast<int>(k), 1.0f, x, static_cast<int>(k), static_cast<const float*>(w.data),
                static_cast<int>(k), 0.0f, y, static_cast<int>(w.rows));
    return;
  }
  std::vector<float> block(static_cast<size_t>(std::min(kGemmBlockRows, w.rows) * k));
  for (int64_t o0 = 0; o0 < w.rows; o0 += kGemmBlockRows) {
    const int64_t nb = std::min(kGemmBlockRows, w.rows - o0);
    const auto* src = static_cast<const uint16_t*>(w.data) + o0 * k;
    const int64_t n = nb * k;
    if (w.type == WeightType::kBF16) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) block[static_cast<size_t>(i)] = bf16_to_f32(src[i]);
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) block[static_cast<size_t>(i)] = f16_to_f32(src[i]);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(nb),
                static_cast<int>(k), 1.0f, x, static_cast<int>(k), block.data(), static_cast<int>(k), 0.0f,
                y + o0, static_cast<int>(w.rows));
  }
}

}  // namespace

int64_t weight_bytes(const WeightMatrix& w) {
  switch (w.type) {
    case WeightType::kF32:
      return w.rows * w.cols * 4;
    case WeightType::kF16:
    case WeightType::kBF16:
      return w.rows * w.cols * 2;
    case WeightType::kAffine: {
      const int64_t scale_bytes = w.scale_type == WeightType::kF32 ? 4 : 2;
      return w.rows * w.cols * w.bits / 8 + 2 * w.rows * (w.cols / w.group_size) * scale_bytes;
    }
  }
  return 0;
}

void matmul(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  if (m <= 0 || w.rows <= 0) return;
  if (w.type == WeightType::kAffine) {
    affine_matmul(w, x, m, y);  // quant_matmul.cpp
    return;
  }
  if (w.cols == 0) {
    std::memset(y, 0, sizeof(float) * static_cast<size_t>(m * w.rows));
    return;
  }
  if (m >= kGemmMinRows) {
    matmul_gemm(w, x, m, y);
    return;
  }
  const TileSet& set = select_tiles(w.type);
  // Small products are not worth waking the thread team.
  const bool parallel = w.rows * w.cols * m >= (int64_t{1} << 15);
  for (int64_t mb = 0; mb < m; mb += kRowBlock) {
    const int64_t mb_end = std::min(m, mb + kRowBlock);
    const int64_t rows = mb_end - mb;
    const int64_t width = rows == 1   ? set.outputs_single_row
                          : rows == 2 ? set.outputs_two_rows
                                      : set.outputs_multi_row;
    const int64_t out_tiles = (w.rows + width - 1) / width;
#pragma omp parallel for schedule(static) if (parallel && out_tiles > 1)
    for (int64_t t = 0; t < out_tiles; ++t) {
      const int64_t o0 = t * width;
      const int64_t no = std::min(width, w.rows - o0);
      for (int64_t m0 = mb; m0 < mb_end; m0 += kRows) {
        const int64_t nr = std::min(kRows, mb_end - m0);
        set.tiles[nr - 1][no - 1](w, x, m0, o0, y);
      }
    }
  }
}

void matmul_reference(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  if (w.type == WeightType::kAffine) {
    affine_matmul_reference(w, x, m, y);
    return;
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < w.rows; ++o) {
      double s = 0.0;
      for (int64_t k = 0; k < w.cols; ++k)
        s += static_cast<double>(x[r * w.cols + k]) * load_scalar(w.data, w.type, o * w.cols + k);
      y[r * w.rows + o] = static_cast<float>(s);
    }
}

void weight_row_to_f32(const WeightMatrix& w, int64_t row, float* out) {
  if (w.type == WeightType::kAffine) {
    affine_row_to_f32(w, row, out);
    return;
  }
  for (int64_t k = 0; k < w.cols; ++k) out[k] = load_scalar(w.data, w.type, row * w.cols + k);
}

const char* simd_path() {
  switch (path()) {
    case Path::kAvx512:
      return "avx512";
    case Path::kAvx2:
      return "avx2";
    case Path::kScalar:
      return "scalar";
  }
  return "scalar";
}

}  // namespace mtpx::cpu
