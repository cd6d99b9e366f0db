#include "backend/cpu/matmul.h"

// GCC 12 reports its own _mm512_undefined_* helpers inside the AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <cblas.h>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string_view>
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
      return load_f32(data, index);
    case WeightType::kF16:
      return f16_to_f32(load_u16(data, index));
    case WeightType::kBF16:
      return bf16_to_f32(load_u16(data, index));
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

// Software prefetch of the weight stream this many bytes ahead. The hardware prefetchers stop at every
// 4 KiB page (a bf16 row of 1024 weights is half a page), and a one-row GEMV gives the core little else
// to overlap; on the 2-core Xeon (AMX class) the lm_head product streamed at 68-75% of a plain read
// without it and 90-109% with it (4 or 8 KiB ahead; BENCHMARKS.md, session 7). Prefetches change no
// arithmetic, so batch invariance is untouched; past the end of the matrix they are harmless hints.
constexpr int64_t kPrefetchBytes = 4096;

// Prefetches the `bytes` of weights that start kPrefetchBytes after p, one hint per 64-byte line.
template <int64_t bytes>
inline void prefetch_ahead(const void* p) {
  const char* ahead = static_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

constexpr int64_t element_bytes(WeightType t) { return t == WeightType::kF32 ? 4 : 2; }

// AVX-512: 16 lanes, blocks of 64 (f32 and f16 weights; bf16 has rows_avx512_bf16).
template <WeightType T>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) inline __m512 load16(const void* base,
                                                                              int64_t index) {
  static_assert(T == WeightType::kF32 || T == WeightType::kF16);
  if constexpr (T == WeightType::kF32)
    return _mm512_loadu_ps(static_cast<const float*>(base) + index);
  else
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index)));
}

template <WeightType T, int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void rows_avx512(const WeightMatrix& w,
                                                                          const Activations& xs,
                                                                          const float* x, int64_t m0,
                                                                          int64_t o_begin, int64_t o_end,
                                                                          float* y) {
  const int64_t k_dim = w.cols;
  const int64_t k64 = k_dim / 64 * 64, k16 = k_dim / 16 * 16;
  const float* xr[NR];  // each activation row's start (see rows_avx512_bf16)
  for (int r = 0; r < NR; ++r) xr[r] = xs.row(m0 + r);
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int64_t row = o * k_dim;
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k64; k += 64) {
      prefetch_ahead<64 * element_bytes(T)>(static_cast<const char*>(w.data) + (row + k) * element_bytes(T));
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = load16<T>(w.data, row + k + 16 * j);
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < 4; ++j)
          acc[r][j] = _mm512_fmadd_ps(_mm512_load_ps(xr[r] + k + 16 * j), wv[j], acc[r][j]);
    }
    for (int64_t k = k64, j = 0; k < k16; k += 16, ++j) {
      const __m512 wv = load16<T>(w.data, row + k);
      for (int r = 0; r < NR; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_load_ps(xr[r] + k), wv, acc[r][j]);
    }
    float sums[NR];  // (the vector sums in a loop of their own: see rows_avx512_bf16)
    for (int r = 0; r < NR; ++r)
      sums[r] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
    for (int r = 0; r < NR; ++r) {
      for (int64_t k = k16; k < k_dim; ++k)
        sums[r] += x[(m0 + r) * k_dim + k] * load_scalar(w.data, T, row + k);
      y[(m0 + r) * w.rows + o] = sums[r];
    }
  }
}

// AVX-512, bf16: 32 weights per 64-byte load, widened without a shuffle. As 16 32-bit lanes, lane j of a
// load at k holds w[k + 2j] in its low half and w[k + 2j + 1] in its high half, so a 16-bit left shift
// gives the even weights as float32 and masking off the low half the odd ones (two cheap ALU ops per 32
// weights, against a lane-crossing vpmovzxwd (port 5 only) plus a shift per 16 in rows_avx512). The
// activations come deinterleaved to match (deinterleave_for_bf16): per 32-block, the 16 even elements,
// then the 16 odd ones. Why: with 2-4 activation rows the widening, not the FMAs, filled the vector ports
// (BENCHMARKS.md, session 8): a verify row now costs little more than its FMAs.
// Order per (m, o), whatever NR is: blocks of 64 (acc0 += even(w[k..k+32)) x, acc1 += odd(...), acc2 and
// acc3 the same for k + 32), one block of 32 into acc0/acc1, (acc0 + acc1) + (acc2 + acc3), the
// horizontal sum, then the scalar tail in order.
template <int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void rows_avx512_bf16(const WeightMatrix& w,
                                                                               const Activations& xs,
                                                                               const float* x, int64_t m0,
                                                                               int64_t o_begin, int64_t o_end,
                                                                               float* y) {
  const int64_t k_dim = w.cols;
  const int64_t k64 = k_dim / 64 * 64, k32 = k_dim / 32 * 32;
  const auto* weights = static_cast<const uint16_t*>(w.data);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  // Each activation row's start, hoisted: indexing xs.row(m0 + r) inside the loop cost address arithmetic
  // per FMA; two rows of 256 x 256 products from L2 went from 22 to 27 GB/s (BENCHMARKS.md, session 8).
  const float* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = xs.row(m0 + r);
  for (int64_t o = o_begin; o < o_end; ++o) {
    const uint16_t* row = weights + o * k_dim;
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k64; k += 64) {
      prefetch_ahead<128>(row + k);
      const __m512i p0 = _mm512_loadu_si512(row + k), p1 = _mm512_loadu_si512(row + k + 32);
      const __m512 wv[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(p0, 16)),
                            _mm512_castsi512_ps(_mm512_and_si512(p0, high_half)),
                            _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16)),
                            _mm512_castsi512_ps(_mm512_and_si512(p1, high_half))};
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < 4; ++j)
          acc[r][j] = _mm512_fmadd_ps(_mm512_load_ps(xr[r] + k + 16 * j), wv[j], acc[r][j]);
    }
    if (k32 > k64) {
      const __m512i p0 = _mm512_loadu_si512(row + k64);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16)),
                   odd = _mm512_castsi512_ps(_mm512_and_si512(p0, high_half));
      for (int r = 0; r < NR; ++r) {
        acc[r][0] = _mm512_fmadd_ps(_mm512_load_ps(xr[r] + k64), even, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_load_ps(xr[r] + k64 + 16), odd, acc[r][1]);
      }
    }
    // The vector sums first, in a loop with nothing else in it: with the scalar tail's loop inside, GCC did
    // not unroll over r and kept the accumulators in memory (stored and reloaded for every output).
    float sums[NR];
    for (int r = 0; r < NR; ++r)
      sums[r] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
    for (int r = 0; r < NR; ++r) {
      for (int64_t k = k32; k < k_dim; ++k) sums[r] += x[(m0 + r) * k_dim + k] * bf16_to_f32(row[k]);
      y[(m0 + r) * w.rows + o] = sums[r];
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
  const float* xr[NR];  // each activation row's start (see rows_avx512_bf16)
  for (int r = 0; r < NR; ++r) xr[r] = xs.row(m0 + r);
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int64_t row = o * k_dim;
    __m256 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k32; k += 32) {
      prefetch_ahead<32 * element_bytes(T)>(static_cast<const char*>(w.data) + (row + k) * element_bytes(T));
      __m256 wv[4];
      load16_pair<T>(w.data, row + k, wv[0], wv[1]);
      load16_pair<T>(w.data, row + k + 16, wv[2], wv[3]);
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < 4; ++j)
          acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(xr[r] + k + 8 * j), wv[j], acc[r][j]);
    }
    if (k16 > k32) {
      __m256 wv[2];
      load16_pair<T>(w.data, row + k32, wv[0], wv[1]);
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < 2; ++j)
          acc[r][j] = _mm256_fmadd_ps(_mm256_load_ps(xr[r] + k32 + 8 * j), wv[j], acc[r][j]);
    }
    float sums[NR];  // (the vector sums in a loop of their own: see rows_avx512_bf16)
    for (int r = 0; r < NR; ++r)
      sums[r] =
          hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
    for (int r = 0; r < NR; ++r) {
      for (int64_t k = k16; k < k_dim; ++k)
        sums[r] += x[(m0 + r) * k_dim + k] * load_scalar(w.data, T, row + k);
      y[(m0 + r) * w.rows + o] = sums[r];
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

// The activation order rows_avx512_bf16 needs: per whole block of 32, the even elements x[0, 2, .., 30],
// then the odd ones x[1, 3, .., 31] (the tail stays in order). Two permutes per block of 32.
__attribute__((target("avx512f"))) void deinterleave_for_bf16(const float* in, int64_t k_dim, float* out) {
  const int64_t k32 = k_dim / 32 * 32;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t k = 0; k < k32; k += 32) {
    const __m512 a = _mm512_loadu_ps(in + k), b = _mm512_loadu_ps(in + k + 16);
    _mm512_storeu_ps(out + k, _mm512_permutex2var_ps(a, even, b));
    _mm512_storeu_ps(out + k + 16, _mm512_permutex2var_ps(a, odd, b));
  }
  std::memcpy(out + k32, in + k32, static_cast<size_t>(k_dim - k32) * sizeof(float));
}

// How a kernel family reads its activation copy.
enum class ActivationOrder { kInOrder, kAvx2Bf16, kEvenOdd32 };

// Where prepare_activations puts its copy: a buffer on the caller's stack when the rows fit (decode and
// verify windows of the shipped model's widths: no allocation per product), else on the heap; neither is
// zeroed (every float a kernel reads is written).
struct ActivationBuffer {
  static constexpr int64_t kStackFloats = 4096;
  alignas(64) float stack[kStackFloats];
  std::unique_ptr<float[]> heap;
  float* get(int64_t floats) {
    if (floats <= kStackFloats) return stack;
    heap.reset(new float[static_cast<size_t>(floats) + 16]);
    const auto address = reinterpret_cast<uintptr_t>(heap.get());
    return heap.get() + ((64 - address % 64) % 64) / sizeof(float);
  }
};

Activations prepare_activations(const float* x, int64_t m, int64_t k_dim, ActivationOrder order,
                                ActivationBuffer& buffer) {
  Activations a;
  a.stride = (k_dim + 15) / 16 * 16 + 16;
  a.data = buffer.get(m * a.stride);
  for (int64_t r = 0; r < m; ++r) {
    float* out = const_cast<float*>(a.row(r));
    switch (order) {
      case ActivationOrder::kAvx2Bf16:
        permute_for_bf16(x + r * k_dim, k_dim, out);
        break;
      case ActivationOrder::kEvenOdd32:
        deinterleave_for_bf16(x + r * k_dim, k_dim, out);
        break;
      case ActivationOrder::kInOrder:
        std::memcpy(out, x + r * k_dim, static_cast<size_t>(k_dim) * sizeof(float));
        break;
    }
  }
  return a;
}

// ---------------------------------------------------------------------------------------------
// AMX (Intel AMX-BF16 tile multiplies) for decode and verify windows, on weights repacked once into tiles
// (pack_amx_tiles). TDPBF16PS computes C[i, n] += sum_k A[i, k] B[k, n] for a 16 x 32 bf16 block A, a
// 32 x 16 bf16 block B stored in pairs (B row p holds, per column n, the elements k = 2p and 2p + 1) and a
// 16 x 16 float32 block C. B holds 16 output features x 32 k of the weights: pack_amx_tiles lays the 1 KiB
// tiles out in the order the kernel reads them (per block of 16 features, its k-blocks in order), so a
// thread's share of a matrix is one sequential stream. (The weights read in place, 16 strided rows per
// tile, took a decode step's products 1.2-1.3x as long as the AVX-512 kernels; BENCHMARKS.md, session 13.)
// A holds the activations: a float32 x is split into three bf16 terms, hi = bf16(x), mid = bf16(x - hi),
// lo = bf16(x - hi - mid) (both subtractions are exact), each its own row of A. A bf16 weight times a bf16
// term is exact in float32, so the sum (lo + mid) + hi of the three rows keeps x's 24 bits and has only
// the float32 accumulation error (a single bf16 x would lose 16 of them). Five activation rows per A tile
// (15 of its 16 rows), up to three A tiles (kGemmMinRows - 1 rows) per load of a B tile.
//
// Why: a tile multiply takes the same time whatever number of rows it holds, so a verify window of 2-5
// rows costs what one decode row does, where the AVX-512 kernels pay one FMA per row and weight vector
// (on the 2-core Xeon, 3-5 row windows made the bf16 FMA kernels compute-bound).
//
// Batch invariance: each C element is computed from its own A row and B column only (Intel SDM,
// TDPBF16PS), over the k-blocks of 32 in order, then its three rows are added in a fixed order; which other
// rows, tiles or threads share the work changes nothing.
constexpr int64_t kAmxRowsPerTile = 5;  // activation rows per A tile (3 of its 16 rows each)
constexpr int64_t kAmxMaxATiles = 3;
static_assert(kAmxRowsPerTile * kAmxMaxATiles >= kGemmMinRows - 1);

// The LDTILECFG operand (palette 1): rows and bytes per row of each tile register.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The three bf16 terms (hi, mid, lo) of 16 floats, stored as 16 bf16 each at out[0], out[32], out[64].
// VCVTNEPS2BF16 rounds to nearest even (denormal inputs count as zero, as they do in the tile multiplies).
__attribute__((target("avx512f,avx512bf16"))) inline void store_split3_bf16(__m512 v, uint16_t* out) {
  __m512 rest = v;
  for (int t = 0; t < 3; ++t) {
    const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * t), bits);
    if (t < 2)
      rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
}

// The A tiles of all activation rows: [k-block][A tile][16 rows][32] bf16; row 3j + t of A tile c holds
// term t of activation row 5c + j. Rows past the tile's activations are never loaded (the tile
// configuration gives each A tile its own row count), so the buffer is not zeroed.
struct AmxActivations {
  std::unique_ptr<uint16_t[]> rows;
  int64_t m = 0, tiles = 0, k_blocks = 0;
  const uint16_t* tile(int64_t kb, int64_t c) const { return rows.get() + (kb * tiles + c) * 16 * 32; }
  int64_t rows_in_tile(int64_t c) const { return std::min(kAmxRowsPerTile, m - c * kAmxRowsPerTile); }
};

__attribute__((target("avx512f,avx512bf16"))) AmxActivations prepare_amx_activations(const float* x,
                                                                                     int64_t m,
                                                                                     int64_t k_dim) {
  AmxActivations a;
  a.m = m;
  a.tiles = (m + kAmxRowsPerTile - 1) / kAmxRowsPerTile;
  a.k_blocks = k_dim / 32;
  a.rows = std::make_unique_for_overwrite<uint16_t[]>(static_cast<size_t>(a.k_blocks * a.tiles * 16 * 32));
  for (int64_t r = 0; r < m; ++r) {
    const int64_t c = r / kAmxRowsPerTile, j = r % kAmxRowsPerTile;
    for (int64_t kb = 0; kb < a.k_blocks; ++kb) {
      uint16_t* out = const_cast<uint16_t*>(a.tile(kb, c)) + 3 * j * 32;
      store_split3_bf16(_mm512_loadu_ps(x + r * k_dim + kb * 32), out);
      store_split3_bf16(_mm512_loadu_ps(x + r * k_dim + kb * 32 + 16), out + 16);
    }
  }
  return a;
}

// The tiles block_amx uses.
__attribute__((target("amx-tile"))) void configure_amx_small_m(const AmxActivations& xa) {
  AmxTileConfig config;
  config.rows[0] = 16;
  config.colsb[0] = 64;
  for (int64_t c = 0; c < xa.tiles; ++c) {  // A tile c and its C tile: its activation rows x 3
    config.rows[1 + c] = config.rows[4 + c] = static_cast<uint8_t>(3 * xa.rows_in_tile(c));
    config.colsb[1 + c] = config.colsb[4 + c] = 64;
  }
  // GCC does not see LDTILECFG read its operand and dropped the stores above (at -O2, in a clone of this
  // function): the configuration escapes to memory first.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// One block of 16 output features (b) for all activation rows: tiles B (weights) 0, A 1..NT (one per A tile
// of activations), C 4..3+NT. Stores the block's features in [o_begin, o_end) to y (c: scratch for the C
// tiles).
template <int NT>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) inline void block_amx(const WeightMatrix& w,
                                                                           const AmxActivations& xa,
                                                                           int64_t b, int64_t o_begin,
                                                                           int64_t o_end, float* c,
                                                                           float* y) {
  const int64_t k_blocks = xa.k_blocks;
  const uint32_t* block = w.amx_tiles + b * k_blocks * 256;
  _tile_zero(4);
  if constexpr (NT >= 2) _tile_zero(5);
  if constexpr (NT >= 3) _tile_zero(6);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    // The next block's tile of this k-block (1 KiB = 16 lines) into L2 (see kPrefetchBytes for why software
    // prefetches). Into L1 the prefetches stalled on the fill buffers; prefetching the first block of a
    // range as well, or two blocks ahead, measured slower (BENCHMARKS.md, session 13).
    const char* next = reinterpret_cast<const char*>(block + (k_blocks + kb) * 256);
    for (int line = 0; line < 1024; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    _tile_loadd(0, block + kb * 256, 64);
    _tile_loadd(1, xa.tile(kb, 0), 64);
    _tile_dpbf16ps(4, 1, 0);
    if constexpr (NT >= 2) {
      _tile_loadd(2, xa.tile(kb, 1), 64);
      _tile_dpbf16ps(5, 2, 0);
    }
    if constexpr (NT >= 3) {
      _tile_loadd(3, xa.tile(kb, 2), 64);
      _tile_dpbf16ps(6, 3, 0);
    }
  }
  _tile_stored(4, c, 64);
  if constexpr (NT >= 2) _tile_stored(5, c + 256, 64);
  if constexpr (NT >= 3) _tile_stored(6, c + 512, 64);
  const int64_t lo = std::max<int64_t>(o_begin - b * 16, 0), hi = std::min<int64_t>(o_end - b * 16, 16);
  const auto mask = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
  for (int t = 0; t < NT; ++t) {
    const float* ct = c + t * 256;
    for (int64_t j = 0; j < xa.rows_in_tile(t); ++j) {
      const __m512 sum = _mm512_add_ps(
          _mm512_add_ps(_mm512_load_ps(ct + (3 * j + 2) * 16), _mm512_load_ps(ct + (3 * j + 1) * 16)),
          _mm512_load_ps(ct + 3 * j * 16));  // (lo + mid) + hi
      _mm512_mask_storeu_ps(y + (t * kAmxRowsPerTile + j) * w.rows + b * 16, mask, sum);
    }
  }
}

// Output features [o_begin, o_end) of all activation rows, from the blocks of 16 features that hold them
// (a block is computed whole; only its features in the range are stored). NT: the A tiles in use.
template <int NT>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void rows_amx(const WeightMatrix& w,
                                                                   const AmxActivations& xa, int64_t o_begin,
                                                                   int64_t o_end, float* y) {
  alignas(64) float c[NT * 256];
  for (int64_t b = o_begin / 16; b * 16 < o_end; ++b) block_amx<NT>(w, xa, b, o_begin, o_end, c, y);
}

__attribute__((target("amx-tile"))) void release_amx_tiles() { _tile_release(); }

// The AMX kernels serve bf16 weights in whole 32-wide k-blocks; small-M products also need the matrix's
// tiles (pack_amx_tiles). The family runs the AVX-512 kernels on any other weight.
bool amx_serves(const WeightMatrix& w) { return w.type == WeightType::kBF16 && w.cols % 32 == 0; }
bool amx_small_m_serves(const WeightMatrix& w) { return amx_serves(w) && w.amx_tiles != nullptr; }

// Prefill on AMX (M >= kGemmMinRows, bf16 weights): C = X W^T as tile products with the activations as
// the A operand (16 rows x 32 k of bf16) and the weights as B. B must hold pairs (k = 2p, 2p+1) per column,
// so each group of weight rows is first repacked (a 16 x 16 transpose of 32-bit pairs per tile) into a
// buffer that stays in L2 while every activation block passes over it; the weights are read from memory
// once per call. Each activation is split into two bf16 terms, hi = bf16(x) and mid = bf16(x - hi), whose
// products with a bf16 weight are exact in float32 and accumulate into the same C tile. Rounding to
// nearest leaves |x - hi| <= 2^-8 |x| and |x - hi - mid| <= 2^-16 |x|, so each output is within
// 2^-16 sum_k |x_k w_k| (plus float32 accumulation) of the exact product: 16 of x's 24 bits, far below the
// bf16 weights' own precision. (A third term, lo, as in rows_amx, made the product 1.5-2x slower on the
// Xeon for no visible change in the model's logits.) This path is not batch-invariant with the small-M
// kernels, like the sgemm path it replaces: see matmul.h. Register blocking: 2 x 2 C tiles (32 activation
// rows x 32 weight rows), 2 A tiles, 2 B tiles. Tiles of C that reach past the matrix go through a
// scratch tile. Measured (2 threads, the 0.8B shape's matrices, 512 rows): 2.4x OpenBLAS sgemm on the
// widened weights.
constexpr int64_t kAmxGemmTerms = 2;
constexpr int64_t kAmxGemmGroupBytes = 512 * 1024;  // repacked weights per group (L2 is 2 MiB per core)

// Transposes the 16 x 16 block of 32-bit elements at src (row stride src_stride elements) into dst
// (16 rows of 16, contiguous).
__attribute__((target("avx512f"))) void transpose16x16_epi32(const uint32_t* src, int64_t src_stride,
                                                             uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4b + q], 128-bit lane L: rows 4b..4b+3 of column 4L + q. Output row c = 4L + q gathers lane L of
  // r[q], r[4 + q], r[8 + q], r[12 + q] (X, Y, Z, W below).
  for (int q = 0; q < 4; ++q) {
    const __m512i x = r[q], y = r[4 + q], z = r[8 + q], w = r[12 + q];
    const __m512i xy01 = _mm512_shuffle_i32x4(x, y, 0x44),
                  zw01 = _mm512_shuffle_i32x4(z, w, 0x44);  // X0 X1 Y0 Y1
    const __m512i xy23 = _mm512_shuffle_i32x4(x, y, 0xee),
                  zw23 = _mm512_shuffle_i32x4(z, w, 0xee);                             // X2 X3 Y2 Y3
    _mm512_storeu_si512(dst + q * 16, _mm512_shuffle_i32x4(xy01, zw01, 0x88));         // X0 Y0 Z0 W0
    _mm512_storeu_si512(dst + (4 + q) * 16, _mm512_shuffle_i32x4(xy01, zw01, 0xdd));   // X1 Y1 Z1 W1
    _mm512_storeu_si512(dst + (8 + q) * 16, _mm512_shuffle_i32x4(xy23, zw23, 0x88));   // X2 Y2 Z2 W2
    _mm512_storeu_si512(dst + (12 + q) * 16, _mm512_shuffle_i32x4(xy23, zw23, 0xdd));  // X3 Y3 Z3 W3
  }
}

// The activations of an AMX GEMM as A tiles: for each block of 16 rows (rows padded with zeros to a
// multiple of 32), each k-block of 32 and each term (hi, mid), 16 rows x 32 bf16 contiguous (1 KiB):
// a tile load reads 1 KiB in order instead of 16 rows a matrix stride apart, which shared L1 sets.
struct AmxGemmActivations {
  std::vector<uint16_t> tiles;
  int64_t row_blocks = 0, k_blocks = 0;
  const uint16_t* tile(int64_t row_block, int64_t kb, int64_t term) const {
    return tiles.data() + ((row_block * k_blocks + kb) * kAmxGemmTerms + term) * 512;
  }
};

AmxGemmActivations prepare_amx_gemm_activations(const float* x, int64_t m, int64_t k_dim) {
  static_assert(kAmxGemmTerms == 2);
  AmxGemmActivations a;
  a.row_blocks = (m + 31) / 32 * 2;
  a.k_blocks = k_dim / 32;
  a.tiles.assign(static_cast<size_t>(a.row_blocks * a.k_blocks * kAmxGemmTerms * 512), 0);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r)
    for (int64_t kb = 0; kb < a.k_blocks; ++kb) {
      uint16_t* hi = const_cast<uint16_t*>(a.tile(r / 16, kb, 0)) + (r % 16) * 32;
      uint16_t* mid = hi + 512;
      for (int64_t j = 0; j < 32; ++j) {
        const float v = x[r * k_dim + kb * 32 + j];
        hi[j] = f32_to_bf16(v);
        mid[j] = f32_to_bf16(v - bf16_to_f32(hi[j]));
      }
    }
  return a;
}

// Repacks weight rows [o0, o0 + 16) (rows at or past `rows_end` as zeros) into the B tiles of every
// k-block: tile kb at dst + kb * 256 holds, in pair row p and column n, the 32-bit pair of row o0 + n at
// k = 32 kb + 2p.
__attribute__((target("avx512f"))) void pack_amx_weight_block(const WeightMatrix& w, int64_t o0,
                                                              int64_t rows_end, uint32_t* dst) {
  const int64_t pairs = w.cols / 2, k_blocks = w.cols / 32;
  const auto* src = static_cast<const uint32_t*>(w.data) + o0 * pairs;
  if (o0 + 16 <= rows_end) {
    for (int64_t kb = 0; kb < k_blocks; ++kb) transpose16x16_epi32(src + kb * 16, pairs, dst + kb * 256);
    return;
  }
  alignas(64) uint32_t part[16 * 16];
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    for (int64_t n = 0; n < 16; ++n) {
      if (o0 + n < rows_end)
        std::memcpy(part + n * 16, src + n * pairs + kb * 16, 64);
      else
        std::memset(part + n * 16, 0, 64);
    }
    transpose16x16_epi32(part, 16, dst + kb * 256);
  }
}

// Output features [o_begin, o_end) for all activation rows, o_end - o_begin <= the group's rows.
// Tiles: 0-3 C (activation block a x weight block b at 2a + b), 4-5 A, 6-7 B.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void gemm_amx_group(const WeightMatrix& w,
                                                                         const AmxGemmActivations& xa,
                                                                         int64_t m, int64_t o_begin,
                                                                         int64_t o_end, uint32_t* packed,
                                                                         float* y) {
  const int64_t k_dim = w.cols, k_blocks = k_dim / 32;
  const int64_t blocks = (o_end - o_begin + 31) / 32 * 2;  // whole pairs of 16-row blocks
  if (w.amx_tiles != nullptr) {
    packed =
        const_cast<uint32_t*>(w.amx_tiles) + o_begin / 16 * k_blocks * 256;  // packed at load (read only)
  } else {
    for (int64_t b = 0; b < blocks; ++b)
      pack_amx_weight_block(w, o_begin + 16 * b, o_end, packed + b * k_blocks * 256);
  }
  alignas(64) float scratch[16 * 16];
  const long y_stride = static_cast<long>(w.rows * 4);
  // Stores C tile `tile` (rows r0.., columns c0..) into y, through the scratch tile where it reaches past
  // the rows or this thread's columns.
#define MTPX_STORE_C(tile, r0, c0)                                 \
  do {                                                             \
    if ((r0) + 16 <= m && (c0) + 16 <= o_end) {                    \
      _tile_stored(tile, y + (r0)*w.rows + (c0), y_stride);        \
    } else {                                                       \
      _tile_stored(tile, scratch, 64);                             \
      for (int64_t i = 0; i < 16 && (r0) + i < m; ++i)             \
        for (int64_t j = 0; j < 16 && (c0) + j < o_end; ++j)       \
          y[((r0) + i) * w.rows + (c0) + j] = scratch[i * 16 + j]; \
    }                                                              \
  } while (0)
  for (int64_t r0 = 0; r0 < m; r0 += 32) {
    for (int64_t b = 0; b < blocks; b += 2) {
      const uint32_t* b0 = packed + b * k_blocks * 256;
      const uint32_t* b1 = b0 + k_blocks * 256;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        _tile_loadd(6, b0 + kb * 256, 64);
        _tile_loadd(7, b1 + kb * 256, 64);
        for (int64_t t = 0; t < kAmxGemmTerms; ++t) {
          _tile_loadd(4, xa.tile(r0 / 16, kb, t), 64);
          _tile_loadd(5, xa.tile(r0 / 16 + 1, kb, t), 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      const int64_t c0 = o_begin + 16 * b;
      MTPX_STORE_C(0, r0, c0);
      MTPX_STORE_C(1, r0, c0 + 16);
      MTPX_STORE_C(2, r0 + 16, c0);
      MTPX_STORE_C(3, r0 + 16, c0 + 16);
    }
  }
#undef MTPX_STORE_C
}

// Groups [g_begin, g_end) of group_rows output features: one tile configuration and one repacking buffer
// per thread.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void gemm_amx_groups(const WeightMatrix& w,
                                                                          const AmxGemmActivations& xa,
                                                                          int64_t m, int64_t group_rows,
                                                                          int64_t g_begin, int64_t g_end,
                                                                          float* y) {
  AmxTileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = 16;
    config.colsb[i] = 64;
  }
  _tile_loadconfig(&config);
  std::vector<uint32_t> packed(w.amx_tiles != nullptr ? 0 : static_cast<size_t>(group_rows * w.cols / 2));
  for (int64_t g = g_begin; g < g_end; ++g)
    gemm_amx_group(w, xa, m, g * group_rows, std::min(w.rows, (g + 1) * group_rows), packed.data(), y);
  _tile_release();
}

void matmul_gemm_amx(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  const AmxGemmActivations xa = prepare_amx_gemm_activations(x, m, w.cols);
  const int64_t threads = omp_get_max_threads();
  int64_t group_rows = std::max<int64_t>(32, kAmxGemmGroupBytes / (w.cols * 2) / 32 * 32);
  if ((w.rows + group_rows - 1) / group_rows < threads)
    group_rows = ((w.rows + threads - 1) / threads + 31) / 32 * 32;
  const int64_t groups = (w.rows + group_rows - 1) / group_rows;
#pragma omp parallel if (groups > 1)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t g0 = groups * t / n, g1 = groups * (t + 1) / n;
    if (g1 > g0) gemm_amx_groups(w, xa, m, group_rows, g0, g1, y);
  }
}

// AMX needs the CPU's tile units (CPUID.7.0:EDX bits 24 AMX-TILE and 22 AMX-BF16; the small-M kernels also
// convert with AVX512-BF16, CPUID.7.1:EAX bit 5, which every AMX CPU has), an OS that saves tile
// state (XCR0 bits 17-18), and on Linux the process's request for it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, kernel 5.16+; refused under older kernels and some hypervisors).
bool amx_usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !(eax & (1u << 5))) return false;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
  uint32_t xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
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

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

bool has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// What the hardware (and OS) can run, whatever the environment asks for.
bool hardware_supports(MatmulKernel kernel) {
  static const bool avx512 = has_avx512(), avx2 = has_avx2_fma(), amx = avx512 && amx_usable();
  switch (kernel) {
    case MatmulKernel::kAmx:
      return amx;
    case MatmulKernel::kAvx512:
      return avx512;
    case MatmulKernel::kAvx2:
      return avx2;
    case MatmulKernel::kScalar:
      return true;
  }
  return false;
}

const char* kernel_name(MatmulKernel kernel) {
  switch (kernel) {
    case MatmulKernel::kAmx:
      return "amx";
    case MatmulKernel::kAvx512:
      return "avx512";
    case MatmulKernel::kAvx2:
      return "avx2";
    case MatmulKernel::kScalar:
      return "scalar";
  }
  return "scalar";
}

constexpr MatmulKernel kKernels[] = {MatmulKernel::kAmx, MatmulKernel::kAvx512, MatmulKernel::kAvx2,
                                     MatmulKernel::kScalar};

MatmulKernel detect_path() {
  if (const char* forced = std::getenv("MTPX_MATMUL_KERNEL"); forced != nullptr && *forced != '\0') {
    for (MatmulKernel k : kKernels) {
      if (std::string_view(forced) != kernel_name(k)) continue;
      if (!hardware_supports(k))
        invalid_input("MTPX_MATMUL_KERNEL={}: this CPU cannot run those kernels", forced);
      return k;
    }
    invalid_input("MTPX_MATMUL_KERNEL must be amx, avx512, avx2 or scalar, got '{}'", forced);
  }
  // AMX first: on weights packed into tiles at load, a verify window of 2-5 rows costs about one decode
  // row, and one row as much as the AVX-512 kernels (BENCHMARKS.md, session 13).
  for (MatmulKernel k : {MatmulKernel::kAmx, MatmulKernel::kAvx512, MatmulKernel::kAvx2})
    if (hardware_supports(k)) return k;
  return MatmulKernel::kScalar;
}

MatmulKernel path() {
  static const MatmulKernel p = detect_path();  // a property of the CPU (and the environment), computed once
  return p;
}

using RowsFn = void (*)(const WeightMatrix&, const Activations&, const float*, int64_t, int64_t, int64_t,
                        float*);

// The kernels of one path and weight type, indexed [activation rows per call - 1]; max_rows: the widest
// call whose accumulators (NR x 4 vectors) fit the register file (AVX2: 16 ymm, AVX-512: 32 zmm, where 6
// rows take 24 accumulators and 4 weight vectors). Wider windows are split into calls (rows_of), and each
// call converts the weights again: a one-row call costs about as much as a one-row pass (the conversions
// and loads bind it), so on AVX-512 a 5-row window in 4 + 1 took 1.7x a 4-row one, in one call 1.2x.
struct KernelSet {
  RowsFn rows[6];
  int64_t max_rows;
  ActivationOrder order;  // how the kernels read their activation copy
};

template <WeightType T>
const KernelSet& kernels_for(MatmulKernel p) {
  static const KernelSet avx512 = [] {
    if constexpr (T == WeightType::kBF16)
      return KernelSet{{rows_avx512_bf16<1>, rows_avx512_bf16<2>, rows_avx512_bf16<3>, rows_avx512_bf16<4>,
                        rows_avx512_bf16<5>, rows_avx512_bf16<6>},
                       6,
                       ActivationOrder::kEvenOdd32};
    else
      return KernelSet{{rows_avx512<T, 1>, rows_avx512<T, 2>, rows_avx512<T, 3>, rows_avx512<T, 4>,
                        rows_avx512<T, 5>, rows_avx512<T, 6>},
                       6,
                       ActivationOrder::kInOrder};
  }();
  static const KernelSet avx2 = {
      {rows_avx2<T, 1>, rows_avx2<T, 2>, rows_avx2<T, 3>, nullptr, nullptr, nullptr},
      3,
      T == WeightType::kBF16 ? ActivationOrder::kAvx2Bf16 : ActivationOrder::kInOrder};
  static const KernelSet scalar = {
      {rows_scalar<T, 1>, rows_scalar<T, 2>, rows_scalar<T, 3>, rows_scalar<T, 4>, nullptr, nullptr},
      4,
      ActivationOrder::kInOrder};
  switch (p) {
    case MatmulKernel::kAmx:  // the AMX family's kernels for weights the tiles do not serve
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
      for (int64_t i = 0; i < n; ++i) block[static_cast<size_t>(i)] = bf16_to_f32(load_u16(src, i));
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) block[static_cast<size_t>(i)] = f16_to_f32(load_u16(src, i));
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

bool matmul_kernel_supported(MatmulKernel kernel) { return hardware_supports(kernel); }

namespace {

// Prefill on AMX unless MTPX_MATMUL_KERNEL names another family (then it takes sgemm, as before).
bool amx_prefill() {
  static const bool amx = [] {
    const char* forced = std::getenv("MTPX_MATMUL_KERNEL");
    const bool others_forced = forced != nullptr && *forced != '\0' && std::string_view(forced) != "amx";
    return hardware_supports(MatmulKernel::kAmx) && !others_forced;
  }();
  return amx;
}

// Output rows per unit of work handed to a thread.
constexpr int64_t kChunkRows = 16;
// Products (rows x cols x M) below which a matmul runs on the calling thread alone.
constexpr int64_t kParallelMinProducts = int64_t{1} << 15;

// Output features [o0, o1) of all m rows with the kernels of `set`.
void rows_of(const KernelSet& set, const WeightMatrix& w, const Activations& xs, const float* x, int64_t m,
             int64_t o0, int64_t o1, float* y) {
  if (m <= set.max_rows) {
    set.rows[m - 1](w, xs, x, 0, o0, o1, y);
    return;
  }
  // More rows than one call holds: the chunk's output features (at most kChunkRows weight rows, re-read
  // from L1 or L2) once per row block. (A call per output feature and row block, as before, made a 5-row
  // verify pass of the shipped model take 1049 us against 743 us for 4 rows on AVX-512; 909 us this way,
  // BENCHMARKS.md session 12.) Each (m, o) runs the same operations in any call (see above), so nothing
  // changes bitwise.
  for (int64_t m0 = 0; m0 < m; m0 += set.max_rows)
    set.rows[std::min(set.max_rows, m - m0) - 1](w, xs, x, m0, o0, o1, y);
}

// Thread t's share [begin, end) of n work items split into p contiguous, balanced ranges.
struct Share {
  int64_t begin, end;
  Share(int64_t n, int t, int p) : begin(n * t / p), end(n * (t + 1) / p) {}
};

// A unit of work handed to a thread: output features [o0, o1) of one product.
struct Chunk {
  const MatmulTarget* target;
  int64_t o0, o1;
};

// The small-M products of one or more matrices with the same input (equal cols and type) in one thread
// team. Threads take contiguous ranges of chunks of 16 output rows over the matrices in turn (Share), so
// each streams one part of the weights; equal columns and type make every whole chunk the same number of
// bytes, so the split balances the threads. prefix_rows > 0 (one matrix): each thread takes its range of
// the chunks of rows [prefix_rows, rows), then its range of those of [0, prefix_rows).
// Per thread with chunks: setup(state) (state: a State of its own), run(chunk, state) for each chunk, then
// finish(state).
template <typename State, typename Setup, typename Run, typename Finish>
void run_chunks(std::span<const MatmulTarget> targets, int64_t m, int64_t prefix_rows, Setup setup, Run run,
                Finish finish) {
  const int64_t cols = targets[0].w->cols;
  // Chunks of the rows [prefix_rows, end) of each matrix, then (one matrix only) of rows [0, prefix_rows).
  std::vector<Chunk> chunks;
  int64_t rows = 0;
  for (const MatmulTarget& t : targets) {
    rows += t.w->rows;
    for (int64_t o0 = prefix_rows; o0 < t.w->rows; o0 += kChunkRows)
      chunks.push_back({&t, o0, std::min(t.w->rows, o0 + kChunkRows)});
  }
  const auto suffix_chunks = static_cast<int64_t>(chunks.size());
  for (int64_t o0 = 0; o0 < prefix_rows; o0 += kChunkRows)
    chunks.push_back({&targets[0], o0, std::min(prefix_rows, o0 + kChunkRows)});
  const auto n = static_cast<int64_t>(chunks.size());
  // Small products are not worth waking the thread team.
  const bool parallel = n > 1 && rows * cols * m >= kParallelMinProducts;
#pragma omp parallel if (parallel)
  {
    const int t = omp_get_thread_num(), p = omp_get_num_threads();
    // The thread's share of the suffix, then its share of the prefix: the same share of the same chunks
    // that a product of the prefix alone gives it (matmul_prefix_last).
    const Share shares[] = {Share(suffix_chunks, t, p), Share(n - suffix_chunks, t, p)};
    const int64_t offsets[] = {0, suffix_chunks};
    if (shares[0].end > shares[0].begin || shares[1].end > shares[1].begin) {
      State state;
      setup(state);
      for (int part = 0; part < 2; ++part)
        for (int64_t c = offsets[part] + shares[part].begin; c < offsets[part] + shares[part].end; ++c)
          run(chunks[static_cast<size_t>(c)], state);
      finish(state);
    }
  }
}

void small_m_products(const KernelSet& set, std::span<const MatmulTarget> targets, const float* x, int64_t m,
                      int64_t prefix_rows = 0) {
  ActivationBuffer buffer;
  const Activations xs = prepare_activations(x, m, targets[0].w->cols, set.order, buffer);
  struct NoState {};
  run_chunks<NoState>(
      targets, m, prefix_rows, [](NoState&) {},
      [&](const Chunk& chunk, NoState&) {
        rows_of(set, *chunk.target->w, xs, x, m, chunk.o0, chunk.o1, chunk.target->y);
      },
      [](NoState&) {});
}

// The same on AMX tiles (every target amx_small_m_serves, equal cols): one tile configuration per thread.
void amx_small_m_products(std::span<const MatmulTarget> targets, const float* x, int64_t m,
                          int64_t prefix_rows = 0) {
  using RowsAmx = void (*)(const WeightMatrix&, const AmxActivations&, int64_t, int64_t, float*);
  constexpr RowsAmx kernels[] = {rows_amx<1>, rows_amx<2>, rows_amx<3>};
  const RowsAmx kernel = kernels[(m + kAmxRowsPerTile - 1) / kAmxRowsPerTile - 1];
  const int64_t cols = targets[0].w->cols;
  // Each thread converts the activations itself (~60 ns for a row of 256): a tile load waits for its lines,
  // and from a buffer another core had just written, each k-block's waited for a transfer from that core
  // (0.7 us per product of the shipped model's shapes, against 0.06 us to convert).
  struct ThreadState {
    AmxActivations xa;
    Chunk range{nullptr, 0, 0};  // a run of consecutive chunks of one matrix: one kernel call
    void flush(RowsAmx kernel) {
      if (range.target != nullptr) kernel(*range.target->w, xa, range.o0, range.o1, range.target->y);
      range.target = nullptr;
    }
  };
  run_chunks<ThreadState>(
      targets, m, prefix_rows,
      [&](ThreadState& state) {
        state.xa = prepare_amx_activations(x, m, cols);
        configure_amx_small_m(state.xa);
      },
      [&](const Chunk& chunk, ThreadState& state) {
        if (state.range.target == chunk.target && state.range.o1 == chunk.o0) {
          state.range.o1 = chunk.o1;
          return;
        }
        state.flush(kernel);
        state.range = chunk;
      },
      [&](ThreadState& state) {
        state.flush(kernel);
        release_amx_tiles();
      });
}

// prefix_rows: see matmul_prefix_last (only the small-M kernels order their rows by it).
void matmul_with(const WeightMatrix& w, const float* x, int64_t m, float* y, MatmulKernel kernel,
                 bool amx_gemm, int64_t prefix_rows = 0) {
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
    if (amx_gemm && amx_serves(w))
      matmul_gemm_amx(w, x, m, y);
    else
      matmul_gemm(w, x, m, y);
    return;
  }
  const MatmulTarget target{&w, y};
  if (kernel == MatmulKernel::kAmx) {
    if (amx_small_m_serves(w)) {
      amx_small_m_products(std::span<const MatmulTarget>(&target, 1), x, m,
                           prefix_rows > 0 && prefix_rows < w.rows ? prefix_rows : 0);
      return;
    }
    kernel = MatmulKernel::kAvx512;
  }
  small_m_products(select_kernels(w.type, kernel), std::span<const MatmulTarget>(&target, 1), x, m,
                   prefix_rows > 0 && prefix_rows < w.rows ? prefix_rows : 0);
}

}  // namespace

void matmul_shared_input(std::span<const MatmulTarget> targets, const float* x, int64_t m) {
  if (targets.empty() || m <= 0) return;
  const MatmulKernel kernel = path();
  const WeightMatrix& first = *targets[0].w;
  if (m < kGemmMinRows && kernel == MatmulKernel::kAmx && first.cols > 0) {
    bool tiles = true;  // one team on AMX tiles when every matrix has them
    for (const MatmulTarget& t : targets)
      tiles = tiles && amx_small_m_serves(*t.w) && t.w->cols == first.cols;
    if (tiles) {
      amx_small_m_products(targets, x, m);
      return;
    }
  }
  // One team for all of them where every product takes the small-M kernels of one set (the affine kernels
  // keep their own calls).
  bool shared = m < kGemmMinRows && kernel != MatmulKernel::kAmx && first.cols > 0;
  for (const MatmulTarget& t : targets)
    shared = shared && t.w->type == first.type && t.w->type != WeightType::kAffine && t.w->cols == first.cols;
  if (!shared) {
    for (const MatmulTarget& t : targets) matmul(*t.w, x, m, t.y);
    return;
  }
  small_m_products(select_kernels(first.type, kernel), targets, x, m);
}

void matmul(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  matmul_with(w, x, m, y, path(), amx_prefill());
}

void matmul_prefix_last(const WeightMatrix& w, const float* x, int64_t m, float* y, int64_t prefix_rows) {
  matmul_with(w, x, m, y, path(), amx_prefill(), prefix_rows);
}

void matmul(const WeightMatrix& w, const float* x, int64_t m, float* y, MatmulKernel kernel) {
  // Also what requests the tile state from the OS before the first tile instruction.
  if (!hardware_supports(kernel))
    fail(ErrorKind::kInternal, "matmul: this CPU cannot run the {} kernels", kernel_name(kernel));
  matmul_with(w, x, m, y, kernel, kernel == MatmulKernel::kAmx);
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

int64_t amx_tile_words(const WeightMatrix& w) {
  if (!amx_serves(w)) return 0;
  return (w.rows + 31) / 32 * 2 * (w.cols / 32) * 256;  // whole pairs of blocks, as the prefill reads them
}

void pack_amx_tiles(const WeightMatrix& w, uint32_t* out) {
  if (!amx_serves(w)) fail(ErrorKind::kInternal, "pack_amx_tiles: the AMX kernels do not serve this matrix");
  const int64_t blocks = (w.rows + 31) / 32 * 2, k_blocks = w.cols / 32;
#pragma omp parallel for schedule(static) if (w.rows * w.cols >= (int64_t{1} << 20))
  for (int64_t b = 0; b < blocks; ++b) pack_amx_weight_block(w, b * 16, w.rows, out + b * k_blocks * 256);
}

bool amx_small_m_path() { return path() == MatmulKernel::kAmx; }

// Huge pages: a decode step streams every tile once, and on 4 KiB pages each page cost a TLB miss (the
// shipped model's decode steps were 6.6% slower than the AVX-512 kernels' on the mapped files; on huge
// pages they are as fast; BENCHMARKS.md, session 13).
TileArena::TileArena(int64_t words) {
  constexpr size_t kHugePage = size_t{2} << 20;
  bytes_ = (static_cast<size_t>(words) * sizeof(uint32_t) + kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail(ErrorKind::kInternal, "cannot allocate {} bytes for AMX weight tiles", bytes_);
  ::madvise(p, bytes_, MADV_HUGEPAGE);  // a hint: 4 KiB pages work too
  data_ = static_cast<uint32_t*>(p);
}

TileArena::~TileArena() {
  if (data_ != nullptr) ::munmap(data_, bytes_);
}

void weight_row_to_f32(const WeightMatrix& w, int64_t row, float* out) {
  if (w.type == WeightType::kAffine) {
    affine_row_to_f32(w, row, out);
    return;
  }
  for (int64_t k = 0; k < w.cols; ++k) out[k] = load_scalar(w.data, w.type, row * w.cols + k);
}

const char* simd_path() { return kernel_name(path()); }

}  // namespace mtpx::cpu
