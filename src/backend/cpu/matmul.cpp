#include "backend/cpu/matmul.h"

// GCC 12 reports its own _mm512_undefined_* helpers inside the AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cpu/quant_matmul.h"
#include "backend/cpu/simd.h"
#include "util/bf16.h"
#include "util/error.h"

namespace mtpx::cpu {
namespace {

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

// ---------------------------------------------------------------------------------------------
// Small-M kernels (decode and verify windows): every weight byte is read once per call.
//
// A kernel walks a range of output features one at a time and reads each weight row from start to end,
// so a thread's whole share of the matrix is one sequential stream. (Tiles of several output rows read
// several interleaved 2-7 KB streams instead: on the 2-core AVX-512 EPYC, tiles of 8 rows streamed at
// 0.65-0.80 of a plain read where one sequential stream reaches 0.95-1.0; BENCHMARKS.md, session 5.) The
// NR activation rows of a call share each weight load (windows of several rows are bound by the
// activation loads, one per FMA); a row block wider than the register file is split into several calls,
// which re-read the weight row from L1.
//
// Batch invariance: for one (m, o), every kernel of a path runs the same operations whatever NR is: k
// in blocks of 4 vectors, vector j of a block accumulating into acc[j] (a partial last block of whole
// vectors uses acc[0..]), then (acc0 + acc1) + (acc2 + acc3), a fixed horizontal sum, and the scalar
// tail in order.

// The activations as the SIMD kernels read them: a copy with 64-byte aligned rows (unaligned 64-byte loads
// straddle cache lines: verify windows of 2-5 rows were 15-30% slower, AVX-512 EPYC) and a row stride that
// is not a multiple of 4 KiB (rows of x would share L1 sets); permuted for the AVX2 bf16 loads.
struct Activations {
  const float* data = nullptr;
  int64_t stride = 0;  // floats between rows
  const float* row(int64_t r) const { return data + r * stride; }
};

// AVX-512: 16 lanes, blocks of 64; bf16 widened by zero-extension and a 16-bit shift.
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

template <WeightType T, int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void rows_avx512(const WeightMatrix& w,
                                                                          const Activations& xs,
                                                                          const float* x, int64_t m0,
                                                                          int64_t o_begin, int64_t o_end,
                                                                          float* y) {
  const int64_t k_dim = w.cols;
  const int64_t k64 = k_dim / 64 * 64, k16 = k_dim / 16 * 16;
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int64_t row = o * k_dim;
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k64; k += 64) {
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = load16<T>(w.data, row + k + 16 * j);
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < 4; ++j)
          acc[r][j] = _mm512_fmadd_ps(_mm512_load_ps(xs.row(m0 + r) + k + 16 * j), wv[j], acc[r][j]);
    }
    for (int64_t k = k64, j = 0; k < k16; k += 16, ++j) {
      const __m512 wv = load16<T>(w.data, row + k);
      for (int r = 0; r < NR; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_load_ps(xs.row(m0 + r) + k), wv, acc[r][j]);
    }
    for (int r = 0; r < NR; ++r) {
      float s = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
      for (int64_t k = k16; k < k_dim; ++k) s += x[(m0 + r) * k_dim + k] * load_scalar(w.data, T, row + k);
      y[(m0 + r) * w.rows + o] = s;
    }
  }
}

// AVX2 + FMA (+F16C): 8 lanes, blocks of 32 (k16: whole blocks of 16 for the tail block).
template <WeightType T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const void* base, int64_t index) {
  if constexpr (T == WeightType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + index);
  } else {
    static_assert(T == WeightType::kF16);
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index)));
  }
}

// 16 weights from k as two 8-lane vectors. bf16: one 32-byte load widened by interleaving with zeros:
// unpacklo/hi_epi16 yield k = {0-3, 8-11} and {4-7, 12-15}, so x is permuted to match (permute_for_bf16).
// Fewer uops per weight byte than zero-extension + shift: 15-20% faster in decode on the AVX2 EPYC.
template <WeightType T>
__attribute__((target("avx2,fma,f16c"))) inline void load16_pair(const void* base, int64_t index, __m256& lo,
                                                                 __m256& hi) {
  if constexpr (T == WeightType::kBF16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index));
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), h));
  } else {
    lo = load8<T>(base, index);
    hi = load8<T>(base, index + 8);
  }
}

// xs: the prepared activations, permuted for bf16 (prepare_activations).
template <WeightType T, int NR>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const WeightMatrix& w, const Activations& xs,
                                                        const float* x, int64_t m0, int64_t o_begin,
                                                        int64_t o_end, float* y) {
  const int64_t k_dim = w.cols;
  const int64_t k32 = k_dim / 32 * 32, k16 = k_dim / 16 * 16;
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int64_t row = o * k_dim;
    __m256 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k32; k += 32) {
      __m256 wv[4];
      load16_pair<T>(w.data, row + k, wv[0], wv[1]);
      load16_pair<T>(w.data, row + k + 16, wv[2], wv[3]);
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < 4; ++j)
          acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(xs.row(m0 + r) + k + 8 * j), wv[j], acc[r][j]);
    }
    if (k16 > k32) {
      __m256 wv[2];
      load16_pair<T>(w.data, row + k32, wv[0], wv[1]);
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < 2; ++j)
          acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(xs.row(m0 + r) + k32 + 8 * j), wv[j], acc[r][j]);
    }
    for (int r = 0; r < NR; ++r) {
      float s =
          hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
      for (int64_t k = k16; k < k_dim; ++k) s += x[(m0 + r) * k_dim + k] * load_scalar(w.data, T, row + k);
      y[(m0 + r) * w.rows + o] = s;
    }
  }
}

// The activation order load16_pair<kBF16> needs: per whole block of 16, x[0-3], x[8-11], x[4-7], x[12-15]
// (the tail after the last whole block stays in order; the kernels read it from x).
void permute_for_bf16(const float* in, int64_t k_dim, float* out) {
  const int64_t k16 = k_dim / 16 * 16;
  for (int64_t k = 0; k < k16; k += 16) {
    std::memcpy(out + k, in + k, 4 * sizeof(float));
    std::memcpy(out + k + 4, in + k + 8, 4 * sizeof(float));
    std::memcpy(out + k + 8, in + k + 4, 4 * sizeof(float));
    std::memcpy(out + k + 12, in + k + 12, 4 * sizeof(float));
  }
  std::memcpy(out + k16, in + k16, static_cast<size_t>(k_dim - k16) * sizeof(float));
}

Activations prepare_activations(const float* x, int64_t m, int64_t k_dim, bool permute,
                                std::vector<float>& buffer) {
  Activations a;
  a.stride = (k_dim + 15) / 16 * 16 + 16;
  buffer.resize(static_cast<size_t>(m * a.stride + 16));
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  a.data = buffer.data() + ((64 - address % 64) % 64) / sizeof(float);
  for (int64_t r = 0; r < m; ++r) {
    float* out = const_cast<float*>(a.row(r));
    if (permute)
      permute_for_bf16(x + r * k_dim, k_dim, out);
    else
      std::memcpy(out, x + r * k_dim, static_cast<size_t>(k_dim) * sizeof(float));
  }
  return a;
}

// ---------------------------------------------------------------------------------------------
// Portable fallback: 8 interleaved partial sums per (m, o), then a fixed pairwise sum.
template <WeightType T, int NR>
void rows_scalar(const WeightMatrix& w, const Activations& /*xs*/, const float* x, int64_t m0,
                 int64_t o_begin, int64_t o_end, float* y) {
  const int64_t k_dim = w.cols;
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int64_t wo = o * k_dim;
    for (int r = 0; r < NR; ++r) {
      const float* xr = x + (m0 + r) * k_dim;
      float part[8] = {};
      int64_t k = 0;
      for (; k + 8 <= k_dim; k += 8)
        for (int j = 0; j < 8; ++j) part[j] += xr[k + j] * load_scalar(w.data, T, wo + k + j);
      float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      for (; k < k_dim; ++k) s += xr[k] * load_scalar(w.data, T, wo + k);
      y[(m0 + r) * w.rows + o] = s;
    }
  }
}

MatmulKernel detect_path() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return MatmulKernel::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return MatmulKernel::kAvx2;
  return MatmulKernel::kScalar;
}

MatmulKernel path() {
  static const MatmulKernel p = detect_path();  // a property of the CPU, computed once
  return p;
}

using RowsFn = void (*)(const WeightMatrix&, const Activations&, const float*, int64_t, int64_t, int64_t,
                        float*);

// The kernels of one path and weight type, indexed [activation rows per call - 1]; max_rows: the widest
// call whose accumulators (NR x 4 vectors) fit the register file (AVX2: 16 ymm, AVX-512: 32 zmm).
struct KernelSet {
  RowsFn rows[4];
  int64_t max_rows;
  bool permuted_x;  // the kernels read x permuted by permute_for_bf16 (else a copy in order)
};

template <WeightType T>
const KernelSet& kernels_for(MatmulKernel p) {
  static const KernelSet avx512 = {
      {rows_avx512<T, 1>, rows_avx512<T, 2>, rows_avx512<T, 3>, rows_avx512<T, 4>}, 4, false};
  static const KernelSet avx2 = {
      {rows_avx2<T, 1>, rows_avx2<T, 2>, rows_avx2<T, 3>, rows_avx2<T, 3>}, 3, T == WeightType::kBF16};
  static const KernelSet scalar = {
      {rows_scalar<T, 1>, rows_scalar<T, 2>, rows_scalar<T, 3>, rows_scalar<T, 4>}, 4, false};
  switch (p) {
    case MatmulKernel::kAvx512:
      return avx512;
    case MatmulKernel::kAvx2:
      return avx2;
    case MatmulKernel::kScalar:
      return scalar;
  }
  return scalar;
}

const KernelSet& select_kernels(WeightType type, MatmulKernel kernel) {
  switch (type) {
    case WeightType::kF32:
      return kernels_for<WeightType::kF32>(kernel);
    case WeightType::kF16:
      return kernels_for<WeightType::kF16>(kernel);
    case WeightType::kBF16:
    case WeightType::kAffine:
      break;
  }
  return kernels_for<WeightType::kBF16>(kernel);
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

bool matmul_kernel_supported(MatmulKernel kernel) {
  switch (kernel) {
    case MatmulKernel::kAvx512:
      return path() == MatmulKernel::kAvx512;
    case MatmulKernel::kAvx2:
      return path() != MatmulKernel::kScalar;
    case MatmulKernel::kScalar:
      return true;
  }
  return false;
}

void matmul(const WeightMatrix& w, const float* x, int64_t m, float* y) { matmul(w, x, m, y, path()); }

void matmul(const WeightMatrix& w, const float* x, int64_t m, float* y, MatmulKernel kernel) {
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
  const KernelSet& set = select_kernels(w.type, kernel);
  std::vector<float> buffer;
  const Activations xs = prepare_activations(x, m, w.cols, set.permuted_x, buffer);
  // Threads take contiguous ranges of output features (schedule static), so each streams one part of the
  // matrix; chunks of 16 rows keep the calls few.
  constexpr int64_t kChunk = 16;
  const int64_t chunks = (w.rows + kChunk - 1) / kChunk;
  // Small products are not worth waking the thread team.
  const bool parallel = chunks > 1 && w.rows * w.cols * m >= (int64_t{1} << 15);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t o0 = c * kChunk, o1 = std::min(w.rows, o0 + kChunk);
    if (m <= set.max_rows) {
      set.rows[m - 1](w, xs, x, 0, o0, o1, y);
      continue;
    }
    // More rows than one call holds: row blocks per output feature, so the weight row is re-read from L1.
    for (int64_t o = o0; o < o1; ++o)
      for (int64_t m0 = 0; m0 < m; m0 += set.max_rows)
        set.rows[std::min(set.max_rows, m - m0) - 1](w, xs, x, m0, o, o + 1, y);
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
    case MatmulKernel::kAvx512:
      return "avx512";
    case MatmulKernel::kAvx2:
      return "avx2";
    case MatmulKernel::kScalar:
      return "scalar";
  }
  return "scalar";
}

}  // namespace mtpx::cpu
