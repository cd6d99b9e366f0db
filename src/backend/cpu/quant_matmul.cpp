#include "backend/cpu/quant_matmul.h"

// GCC 12 reports its own _mm512_undefined_* helpers inside the AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <vector>

#include "backend/cpu/simd.h"
#include "util/bf16.h"
#include "util/error.h"

namespace mtpx::cpu {
namespace {

// The packed codes are read as bytes of a little-endian bit stream.
static_assert(std::endian::native == std::endian::little, "affine kernels assume a little-endian CPU");

// Activation rows per tile for windows of 3 or more rows (3 + 3 + 3 for a 9-row verify window): at most
// kRows rows share a tile's decoded codes.
constexpr int64_t kRows = 3;
// SIMD code loads read up to kOverread bytes past the codes they decode (e.g. 32 codes of 2 bits, 8 bytes,
// come from a 16-byte load). Only the last rows of the matrix can run off the end of the buffer; their
// groups that would are decoded from a padded copy.
constexpr int64_t kOverread = 16;
constexpr int64_t kMaxGroupBytes = 128;  // 128 codes of 8 bits
// Prefetch the rows of the output tile this many tiles ahead (a quantized tile is a short read: 4 rows of
// 512 bytes for 4-bit 1024-wide rows). 0.8B decode mix, 4-bit, 2 threads: 1 tile 45.5-48.6 ms per pass,
// 2: 45.9, 4: 44.5-45.2, 8: 48.3 (within this shared machine's noise, but never worse).
constexpr int64_t kPrefetchTiles = 4;
// Rows of the weight dequantized to float32 at a time for the sgemm path (as matmul_gemm).
constexpr int64_t kDequantBlockRows = 512;

float param_at(const void* data, WeightType type, int64_t index) {
  switch (type) {
    case WeightType::kF32:
      return load_f32(data, index);
    case WeightType::kF16:
      return f16_to_f32(load_u16(data, index));
    case WeightType::kBF16:
      return bf16_to_f32(load_u16(data, index));
    case WeightType::kAffine:
      break;
  }
  return 0.0f;
}

int64_t packed_row_bytes(const WeightMatrix& w) { return w.cols * w.bits / 8; }

const uint8_t* row_codes(const WeightMatrix& w, int64_t row) {
  return static_cast<const uint8_t*>(w.data) + row * packed_row_bytes(w);
}

// Code k of a row: bits [k * bits, (k + 1) * bits) of the row's little-endian bit stream. With bits <= 8 a
// code spans at most two bytes.
uint32_t code_in_row(const uint8_t* row, int bits, int64_t k) {
  const int64_t bit = k * bits;
  const uint8_t* p = row + bit / 8;
  const int shift = static_cast<int>(bit % 8);
  uint32_t v = p[0];
  if (shift + bits > 8) v |= static_cast<uint32_t>(p[1]) << 8;
  return (v >> shift) & ((1u << bits) - 1u);
}

// sum(x_g) for every row and group, in one fixed order (8 interleaved partial sums, then a fixed pairwise
// sum), whatever m is: out[r * stride + g], zero for g in [groups, stride).
void group_sums(const float* x, int64_t m, int64_t cols, int64_t group_size, int64_t stride, float* out) {
  const int64_t groups = cols / group_size;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * cols + g * group_size;
      float part[8] = {};
      for (int64_t k = 0; k < group_size; k += 8)
        for (int j = 0; j < 8; ++j) part[j] += xg[k + j];
      out[r * stride + g] =
          ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    }
    for (int64_t g = groups; g < stride; ++g) out[r * stride + g] = 0.0f;
  }
}

// What every tile of one call reads.
struct AffineCall {
  const WeightMatrix* w = nullptr;
  const uint8_t* codes = nullptr;      // w.data as bytes
  const uint8_t* codes_end = nullptr;  // one past the last packed byte
  int64_t row_bytes = 0;               // packed bytes per weight row
  int64_t groups = 0;                  // groups per row
  const float* x = nullptr;            // [m, cols], in the lane order of the tiles (see arrange_x)
  const float* xsum = nullptr;         // [m, xsum_stride]: sum(x_g), zero past `groups`
  int64_t xsum_stride = 0;
  // kAvx512Vnni only: x quantized to int8 (see quantize_activations), [m, cols], and the scale of each run
  // of kActivationBlock values, [m, cols / kActivationBlock].
  const int8_t* xq = nullptr;
  const float* xq_scale = nullptr;
};

// The `bytes` packed bytes at byte offset `offset` of weight row `row`, or a padded copy of them when a SIMD
// load would read past the end of the packed buffer.
inline const uint8_t* row_bytes_at(const AffineCall& c, int64_t row, int64_t offset, int64_t bytes,
                                   uint8_t* padded) {
  const uint8_t* src = c.codes + row * c.row_bytes + offset;
  if (c.codes_end - src >= bytes + kOverread) return src;
  std::memcpy(padded, src, static_cast<size_t>(bytes));
  std::memset(padded + bytes, 0, kOverread);
  return padded;
}

// Tiles convert the scales and biases of their rows to float32 kGroupChunk groups at a time (a multiple
// of 16, so that the bias term runs in whole vectors).
constexpr int64_t kGroupChunk = 32;

// The int8-activation tiles (4 bits): activations are quantized per run of kActivationBlock values, and
// codes go by blocks of kInt8Block (see affine_tile_vnni4).
constexpr int64_t kActivationBlock = 32;
constexpr int64_t kInt8Block = 128;

// out[0, n) = the n params from `index` as float32, out[n, kGroupChunk) = 0.
void params_to_f32(const void* data, WeightType type, int64_t index, int64_t n, float* out) {
  switch (type) {
    case WeightType::kF32:
      std::memcpy(out, static_cast<const float*>(data) + index, sizeof(float) * static_cast<size_t>(n));
      break;
    case WeightType::kF16:
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(load_u16(data, index + i));
      break;
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(load_u16(data, index + i));
      break;
  }
  for (int64_t i = n; i < kGroupChunk; ++i) out[i] = 0.0f;
}

// The weight rows of an output tile [o0, o0 + NO), clamped to the last row of the matrix.
template <int NO>
struct TileRows {
  int64_t row[NO];
  const uint8_t* codes[NO];     // packed codes of each row
  const uint8_t* prefetch[NO];  // ... of the rows kPrefetchTiles tiles ahead
  bool near_end;                // a SIMD load of the last row may pass the end of the buffer

  TileRows(const AffineCall& c, int64_t o0) {
    const int64_t last = c.w->rows - 1;
    for (int o = 0; o < NO; ++o) {
      row[o] = std::min(o0 + o, last);
      codes[o] = c.codes + row[o] * c.row_bytes;
      prefetch[o] = c.codes + std::min(o0 + kPrefetchTiles * NO + o, last) * c.row_bytes;
    }
    near_end = c.codes_end - (codes[NO - 1] + c.row_bytes) < kOverread;
  }

  // One prefetch per 64-byte line that starts in [begin, end) of the rows of the next tile: a tile reads NO
  // interleaved short streams, which the hardware prefetcher follows poorly.
  void prefetch_lines(int64_t begin, int64_t end) const {
    for (int64_t line = (begin + 63) & ~int64_t{63}; line < end; line += 64)
      for (int o = 0; o < NO; ++o)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch[o] + line), _MM_HINT_T0);
  }
};

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA (+F16C): 8 lanes.
//
// The tile decoders. The cheapest decoding found leaves each code in place inside its 32-bit lane, only
// masked: the lane then holds q * 2^b for a bit position b fixed per (vector, lane), and the int->float
// conversion is exact. Once per call the activations are put in the same lane order and multiplied by
// 2^-b (exact), so every product x' * q' equals x * q bit for bit; only the order of the terms within a
// group differs from the natural one, and it is fixed. (Measured on the AVX2 EPYC, 1 row, L2-resident
// 4-bit weights: 20.6 Gcodes/s per core against 15.7 for broadcast + variable shift + mask in natural order;
// converting through the 2^23 bit trick instead of vcvtdq2ps did not help.)
//
// A decoder D turns a block of D::kCodes codes into D::kCodes / D::kLanes vectors: load() reads the block,
// vec(raw, t) gives vector t. code(t, j) is the position in the block of the code in lane j of vector t,
// bit(t, j) its bit position in the lane.

#define MTPX_AVX2 __attribute__((target("avx2,fma,f16c")))

// The mask of each (vector, lane) of decoder D: the code's bits. The tables are built at run time, so that
// the compiler loads the masks (as operands of the and) instead of rebuilding the constants in the loop.
template <class D>
std::array<int32_t, D::kCodes> lane_masks() {
  std::array<int32_t, D::kCodes> m{};
  for (int t = 0; t < D::kCodes / D::kLanes; ++t)
    for (int j = 0; j < D::kLanes; ++j)
      m[static_cast<size_t>(D::kLanes * t + j)] =
          static_cast<int32_t>(((1u << D::kBits) - 1u) << D::bit(t, j));
  return m;
}

MTPX_AVX2 inline __m256i load_mask(const int32_t* masks, int t) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(masks + 8 * t));
}

// 4 bits, 64 codes = 8 words per block: lane j of vector t holds code 8j + t at bit 4t, except vector 7,
// which is shifted down (at bit 28 a code >= 8 would make the int negative).
struct Nibbles64 {
  static constexpr int kBits = 4, kCodes = 64, kLanes = 8;
  using Raw = __m256i;
  static constexpr int code(int t, int j) { return 8 * j + t; }
  static constexpr int bit(int t, int /*j*/) { return t < 7 ? 4 * t : 0; }
  MTPX_AVX2 static Raw load(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static const int32_t* masks() {  // [t][lane]
    static const std::array<int32_t, 64> m = lane_masks<Nibbles64>();
    return m.data();
  }
  MTPX_AVX2 static __m256 vec(Raw v, int t, const int32_t* masks) {
    const __m256i q = t < 7 ? _mm256_and_si256(v, load_mask(masks, t)) : _mm256_srli_epi32(v, 28);
    return _mm256_cvtepi32_ps(q);
  }
};

// BITS = 2..6, 32 codes = 4 * BITS bytes per block: lane j holds codes 4j..4j+3 (a byte shuffle gathers the
// at most 3 bytes they span; lanes 0-3 take the first 2 * BITS bytes, lanes 4-7 the rest), vector t code
// 4j + t at bit 4j*BITS % 8 + t*BITS (its top bit is at most bit 23: a positive int, exactly converted).
template <int BITS>
struct Lanes32 {
  static constexpr int kBits = BITS, kCodes = 32, kLanes = 8;
  using Raw = __m256i;
  static constexpr int code(int t, int j) { return 4 * j + t; }
  static constexpr int bit(int t, int j) { return 4 * BITS * (j % 4) % 8 + BITS * t; }
  // Blocks of up to 16 bytes are broadcast to both 16-byte halves; larger ones are loaded whole and the
  // dwords from 2 * BITS on moved into the upper half (the shuffle only moves bytes within halves).
  static constexpr bool kWide = 4 * BITS > 16;
  static constexpr int kUpperDword = kWide ? 2 * BITS / 4 : 0;
  static constexpr int kUpperBase = 2 * BITS - (kWide ? 4 * kUpperDword : 0);  // upper half: its first byte
  static constexpr std::array<int8_t, 32> shuffle() {
    std::array<int8_t, 32> idx{};
    for (int lane = 0; lane < 8; ++lane) {
      const int first_bit = 4 * BITS * (lane % 4);
      const int base = (lane < 4 ? 0 : kUpperBase) + first_bit / 8;
      const int bytes = (first_bit % 8 + 4 * BITS + 7) / 8;
      for (int b = 0; b < 4; ++b)
        idx[static_cast<size_t>(4 * lane + b)] = b < bytes ? static_cast<int8_t>(base + b) : int8_t{-128};
    }
    return idx;
  }
  static constexpr std::array<int8_t, 32> kShuffle = shuffle();
  static const int32_t* masks() {  // [t][lane]
    static const std::array<int32_t, 32> m = lane_masks<Lanes32>();
    return m.data();
  }
  MTPX_AVX2 static Raw load(const uint8_t* p) {
    __m256i bytes;
    if constexpr (kWide) {
      const __m256i dwords =
          _mm256_setr_epi32(0, 1, 2, 3, kUpperDword, kUpperDword + 1, kUpperDword + 2, kUpperDword + 3);
      bytes = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), dwords);
    } else {
      bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    return _mm256_shuffle_epi8(bytes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kShuffle.data())));
  }
  MTPX_AVX2 static __m256 vec(Raw v, int t, const int32_t* masks) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, load_mask(masks, t)));
  }
};

// 8 bits, natural order: vector t is codes 8t..8t+7, zero-extended bytes.
struct Bytes32 {
  static constexpr int kBits = 8, kCodes = 32, kLanes = 8;
  using Raw = const uint8_t*;
  static constexpr int code(int t, int j) { return 8 * t + j; }
  static constexpr int bit(int, int) { return 0; }
  MTPX_AVX2 static Raw load(const uint8_t* p) { return p; }
  static const int32_t* masks() { return nullptr; }
  MTPX_AVX2 static __m256 vec(Raw p, int t, const int32_t*) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * t))));
  }
};

// x'[k0 + L*t + j] = x[k0 + code(t, j)] * 2^-bit(t, j) (L = D::kLanes) for the blocks of D in codes
// [begin, end) of each row.
template <class D>
void arrange_x(const float* x, int64_t m, int64_t cols, int64_t begin, int64_t end, float* out) {
  // The permutation and the powers of two of one block (multiplying by a power of two is exact).
  static const auto layout = [] {
    std::array<std::pair<int, float>, D::kCodes> l{};
    for (int t = 0; t < D::kCodes / D::kLanes; ++t)
      for (int j = 0; j < D::kLanes; ++j)
        l[static_cast<size_t>(D::kLanes * t + j)] = {D::code(t, j), std::ldexp(1.0f, -D::bit(t, j))};
    return l;
  }();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t k0 = begin; k0 < end; k0 += D::kCodes) {
      const float* src = x + r * cols + k0;
      float* dst = out + r * cols + k0;
      for (size_t i = 0; i < layout.size(); ++i) dst[i] = src[layout[i].first] * layout[i].second;
    }
}

// Activations for tiles of decoder D; paired: the blocks of 64 codes hold two groups of 32, an odd last
// group goes to Lanes32<4> (see affine_tile_avx2).
template <class D, bool kPaired>
void arrange_x_for(const float* x, int64_t m, int64_t cols, int64_t /*group_size*/, float* out) {
  const int64_t main_end = kPaired ? cols / D::kCodes * D::kCodes : cols;
  arrange_x<D>(x, m, cols, 0, main_end, out);
  if constexpr (kPaired) arrange_x<Lanes32<D::kBits>>(x, m, cols, main_end, cols, out);
}

// group_acc[r][o] += x'[r] * q'[o] over `codes` codes from src[o] (packed codes) and xg (activations, row r
// at xg + r * cols).
template <class D, int NR, int NO>
MTPX_AVX2 inline __attribute__((always_inline)) void accumulate_avx2(const uint8_t* const* src,
                                                                     const float* xg, int64_t cols,
                                                                     int64_t codes, const int32_t* masks,
                                                                     __m256 (&group_acc)[NR][NO]) {
  for (int64_t k = 0; k < codes; k += D::kCodes) {
    typename D::Raw raw[NO];
    for (int o = 0; o < NO; ++o) raw[o] = D::load(src[o] + k * D::kBits / 8);
#pragma GCC unroll 8
    for (int t = 0; t < D::kCodes / D::kLanes; ++t) {
      __m256 xv[NR];
      for (int r = 0; r < NR; ++r) xv[r] = _mm256_loadu_ps(xg + r * cols + k + 8 * t);
      for (int o = 0; o < NO; ++o) {
        const __m256 q = D::vec(raw[o], t, masks);
        for (int r = 0; r < NR; ++r) group_acc[r][o] = _mm256_fmadd_ps(xv[r], q, group_acc[r][o]);
      }
    }
  }
}

// out[0, n) = the n params from `index` as float32, out[n, round_up(n, 8)) = 0.
MTPX_AVX2 inline void params_to_f32_avx2(const void* data, WeightType type, int64_t index, int64_t n,
                                         float* out) {
  int64_t i = 0;
  if (type == WeightType::kF32) {
    for (; i + 8 <= n; i += 8)
      _mm256_store_ps(out + i, _mm256_loadu_ps(static_cast<const float*>(data) + index + i));
  } else {
    const uint16_t* half = static_cast<const uint16_t*>(data) + index;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(half + i));
      _mm256_store_ps(out + i, type == WeightType::kF16
                                   ? _mm256_cvtph_ps(h)
                                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
  for (; i < n; ++i) out[i] = param_at(data, type, index + i);
  for (; i % 8 != 0; ++i) out[i] = 0.0f;
}

// NR activation rows x NO outputs with decoder D. kPaired: D's blocks hold two groups (64 codes of 4 bits,
// groups of 32; lanes 0-3 are the first group, 4-7 the second), and an odd last group is decoded by
// Lanes32<4>. Rows of the tile past the end of the matrix repeat its last row (the same work, results
// dropped), so that one tile shape serves every output count. Per (row, output), lane by lane, for each
// chunk of groups:
//   acc += bias[g..g+7] * sum(x_g..g+7)            (one FMA per 8 groups, before the chunk's groups)
//   acc += scale_g * dot(x_g, q_g)                 (per group; dot = lane-blocked FMAs in a fixed order)
// and y = the horizontal sum of acc.
template <class D, bool kPaired, int NR, int NO>
MTPX_AVX2 void affine_tile_avx2(const AffineCall& c, int64_t m0, int64_t o0, float* y) {
  const WeightMatrix& w = *c.w;
  const int64_t cols = w.cols, group_size = w.group_size, groups = c.groups;
  const int64_t group_bytes = group_size * D::kBits / 8;
  constexpr int64_t kStep = kPaired ? 2 : 1;  // groups per decoder block run
  const TileRows<NO> rows(c, o0);
  alignas(32) uint8_t padded[NO][kMaxGroupBytes + kOverread];
  alignas(32) float scale[NO][kGroupChunk];
  alignas(32) float bias[NO][kGroupChunk];
  __m256 acc[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm256_setzero_ps();

  const int32_t* masks = D::masks();
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupChunk) {  // kGroupChunk is even: pairs stay in one chunk
    const int64_t chunk = std::min(kGroupChunk, groups - g0);
    for (int o = 0; o < NO; ++o) {
      params_to_f32_avx2(w.scales, w.scale_type, rows.row[o] * groups + g0, chunk, scale[o]);
      params_to_f32_avx2(w.biases, w.scale_type, rows.row[o] * groups + g0, chunk, bias[o]);
    }
    for (int64_t v = 0; v < chunk; v += 8)
      for (int r = 0; r < NR; ++r) {
        const __m256 xsum = _mm256_loadu_ps(c.xsum + (m0 + r) * c.xsum_stride + g0 + v);
        for (int o = 0; o < NO; ++o)
          acc[r][o] = _mm256_fmadd_ps(_mm256_load_ps(&bias[o][v]), xsum, acc[r][o]);
      }
    for (int64_t g = g0; g < g0 + chunk;) {
      // Groups in this step: kStep, or 1 for the odd last group of a paired tile.
      const int64_t n = std::min(kStep, g0 + chunk - g);
      const int64_t byte0 = g * group_bytes, bytes = n * group_bytes;
      rows.prefetch_lines(byte0, byte0 + bytes);
      const uint8_t* src[NO];
      for (int o = 0; o < NO; ++o)
        src[o] =
            rows.near_end ? row_bytes_at(c, rows.row[o], byte0, bytes, padded[o]) : rows.codes[o] + byte0;
      __m256 group_acc[NR][NO];
      for (int r = 0; r < NR; ++r)
        for (int o = 0; o < NO; ++o) group_acc[r][o] = _mm256_setzero_ps();
      const float* xg = c.x + m0 * cols + g * group_size;
      if constexpr (kPaired) {
        using Tail = Lanes32<D::kBits>;
        if (n == 2) {
          accumulate_avx2<D, NR, NO>(src, xg, cols, 2 * group_size, masks, group_acc);
        } else {
          accumulate_avx2<Tail, NR, NO>(src, xg, cols, group_size, Tail::masks(), group_acc);
        }
      } else {
        accumulate_avx2<D, NR, NO>(src, xg, cols, group_size, masks, group_acc);
      }
      // acc += scale_g * dot(x_g, q_g), lane by lane (a step of two groups: lanes 0-3 and 4-7).
      for (int o = 0; o < NO; ++o) {
        const float* s = &scale[o][g - g0];
        const __m256 sv =
            n == 2 ? _mm256_setr_m128(_mm_broadcast_ss(s), _mm_broadcast_ss(s + 1)) : _mm256_broadcast_ss(s);
        for (int r = 0; r < NR; ++r) acc[r][o] = _mm256_fmadd_ps(sv, group_acc[r][o], acc[r][o]);
      }
      g += n;
    }
  }
  for (int o = 0; o < NO; ++o) {
    if (o0 + o >= w.rows) break;
    for (int r = 0; r < NR; ++r) y[(m0 + r) * w.rows + o0 + o] = hsum8(acc[r][o]);
  }
}

// 8 codes starting at p (BITS bytes), as floats in natural order (for dequantizing rows): broadcast the
// bytes, shift lane i right by i*BITS (after a byte shuffle that brings the two bytes holding code i into
// lane i when the 8 codes span more than a word), mask.
template <int BITS, int LANES>
constexpr std::array<int8_t, LANES * 4> pair_shuffle() {
  std::array<int8_t, LANES * 4> idx{};
  for (int i = 0; i < LANES; ++i) {
    // A byte shuffle indexes within 16-byte lanes; every 16-byte lane holds the same source bytes.
    const int start = i * BITS / 8;
    idx[static_cast<size_t>(4 * i)] = static_cast<int8_t>(start);
    idx[static_cast<size_t>(4 * i + 1)] = static_cast<int8_t>(start + 1);
    idx[static_cast<size_t>(4 * i + 2)] = int8_t{-128};  // zero
    idx[static_cast<size_t>(4 * i + 3)] = int8_t{-128};
  }
  return idx;
}
template <int BITS, int LANES>
constexpr std::array<int32_t, LANES> bit_offsets(bool within_byte) {
  std::array<int32_t, LANES> s{};
  for (int i = 0; i < LANES; ++i) s[static_cast<size_t>(i)] = within_byte ? i * BITS % 8 : i * BITS;
  return s;
}
template <int BITS, int LANES>
inline constexpr std::array<int8_t, LANES * 4> kPairShuffle = pair_shuffle<BITS, LANES>();
template <int BITS, int LANES>
inline constexpr std::array<int32_t, LANES> kShiftInWord = bit_offsets<BITS, LANES>(false);
template <int BITS, int LANES>
inline constexpr std::array<int32_t, LANES> kShiftInByte = bit_offsets<BITS, LANES>(true);

template <int BITS>
MTPX_AVX2 inline __m256 codes8_avx2(const uint8_t* p) {
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  if constexpr (BITS == 8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (BITS <= 4) {
    uint32_t word;  // all 8 codes lie in one 32-bit word
    std::memcpy(&word, p, sizeof word);
    const __m256i shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kShiftInWord<BITS, 8>.data()));
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shift), mask));
  } else {
    uint64_t bytes;
    std::memcpy(&bytes, p, sizeof bytes);
    const __m256i shuffle =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kPairShuffle<BITS, 8>.data()));
    const __m256i shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kShiftInByte<BITS, 8>.data()));
    const __m256i pairs = _mm256_shuffle_epi8(_mm256_set1_epi64x(static_cast<long long>(bytes)), shuffle);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(pairs, shift), mask));
  }
}

// Dequantize one row to float32: fma(scale, q, bias), one rounding, as the scalar version.
template <int BITS>
MTPX_AVX2 void dequantize_row_avx2(const AffineCall& c, int64_t row, float* out) {
  const WeightMatrix& w = *c.w;
  const int64_t group_bytes = w.group_size * BITS / 8;
  alignas(32) uint8_t padded[kMaxGroupBytes + kOverread];
  for (int64_t g = 0; g < c.groups; ++g) {
    const uint8_t* src = row_bytes_at(c, row, g * group_bytes, group_bytes, padded);
    const __m256 scale = _mm256_set1_ps(param_at(w.scales, w.scale_type, row * c.groups + g));
    const __m256 bias = _mm256_set1_ps(param_at(w.biases, w.scale_type, row * c.groups + g));
    float* dst = out + g * w.group_size;
    for (int64_t k = 0; k < w.group_size; k += 8)
      _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(scale, codes8_avx2<BITS>(src + k * BITS / 8), bias));
  }
}

// AVX2, 4 bits, int8 activations: the VNNI tiles' equation and layout (affine_tile_vnni4) on 8 lanes. A
// 32-byte half of a block holds 64 codes; vpmaddubsw multiplies its low and high nibbles by the even and odd
// activations into int16 pairs (at most 2 * 2 * 15 * 127 = 7620 in magnitude after the two are added: no
// saturation), and vpmaddwd by ones sums them into 8 int32 lanes, lane j holding codes 8j..8j+7 of the half.
template <int NR, int NO>
MTPX_AVX2 void affine_tile_avx2_int8(const AffineCall& c, int64_t m0, int64_t o0, float* y) {
  const WeightMatrix& w = *c.w;
  const int64_t cols = w.cols, groups = c.groups;
  const int64_t block_groups = std::max<int64_t>(1, kInt8Block / w.group_size);
  const int64_t runs_per_row = cols / kActivationBlock;
  const int shift = std::countr_zero(static_cast<uint64_t>(w.group_size));
  const TileRows<NO> rows(c, o0);
  alignas(32) float scale[NO][kGroupChunk + 8];  // + 8: a block's scales are read as one vector
  alignas(32) float bias[NO][kGroupChunk];
  __m256 acc[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm256_setzero_ps();
  // Lane j of half h: group (64h + 8j) / group_size of the block, activation run 2h + j / 4.
  const __m256i lane_code = _mm256_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56);
  const __m256i half_group[2] = {
      _mm256_srlv_epi32(lane_code, _mm256_set1_epi32(shift)),
      _mm256_srlv_epi32(_mm256_add_epi32(lane_code, _mm256_set1_epi32(64)), _mm256_set1_epi32(shift))};
  const __m256i half_run[2] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                               _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)};
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupChunk) {  // kGroupChunk is a multiple of block_groups
    const int64_t chunk = std::min(kGroupChunk, groups - g0);
    for (int o = 0; o < NO; ++o) {
      params_to_f32_avx2(w.scales, w.scale_type, rows.row[o] * groups + g0, chunk, scale[o]);
      std::fill(scale[o] + (chunk + 7) / 8 * 8, scale[o] + kGroupChunk + 8, 0.0f);
      params_to_f32_avx2(w.biases, w.scale_type, rows.row[o] * groups + g0, chunk, bias[o]);
    }
    for (int64_t v = 0; v < chunk; v += 8)
      for (int r = 0; r < NR; ++r) {
        const __m256 xsum = _mm256_loadu_ps(c.xsum + (m0 + r) * c.xsum_stride + g0 + v);
        for (int o = 0; o < NO; ++o)
          acc[r][o] = _mm256_fmadd_ps(_mm256_load_ps(&bias[o][v]), xsum, acc[r][o]);
      }
    for (int64_t g = g0; g < g0 + chunk; g += block_groups) {
      const int64_t k0 = g * w.group_size;  // first code of the block
      rows.prefetch_lines(k0 / 2, (k0 + kInt8Block) / 2);
      for (int h = 0; h < 2; ++h) {
        __m256i even[NO], odd[NO];
        __m256 sv[NO];
        for (int o = 0; o < NO; ++o) {
          const __m256i raw =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.codes[o] + k0 / 2 + 32 * h));
          even[o] = _mm256_and_si256(raw, low_nibbles);
          odd[o] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_nibbles);
          sv[o] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(&scale[o][g - g0]), half_group[h]);
        }
        for (int r = 0; r < NR; ++r) {
          const int8_t* xr = c.xq + (m0 + r) * cols + k0;
          const __m256i x_even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * h));
          const __m256i x_odd =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + kInt8Block / 2 + 32 * h));
          const __m256 run_scale = _mm256_permutevar8x32_ps(
              _mm256_castps128_ps256(
                  _mm_loadu_ps(c.xq_scale + (m0 + r) * runs_per_row + k0 / kActivationBlock)),
              half_run[h]);
          for (int o = 0; o < NO; ++o) {
            const __m256i pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(even[o], x_even), _mm256_maddubs_epi16(odd[o], x_odd));
            const __m256i dot = _mm256_madd_epi16(pairs, ones);
            acc[r][o] = _mm256_fmadd_ps(_mm256_mul_ps(sv[o], run_scale), _mm256_cvtepi32_ps(dot), acc[r][o]);
          }
        }
      }
    }
  }
  for (int o = 0; o < NO; ++o) {
    if (o0 + o >= w.rows) break;
    for (int r = 0; r < NR; ++r) y[(m0 + r) * w.rows + o0 + o] = hsum8(acc[r][o]);
  }
}

#undef MTPX_AVX2

// ---------------------------------------------------------------------------------------------
// AVX-512: 16 lanes, the same equation and chunk structure. 4 bits: codes left in place as in Nibbles64,
// 128 codes (16 words) per block, which holds 128 / group_size groups (lane j is in group 8j / group_size
// of the block); groups past the last whole block, and other widths, in natural order: 16 codes = 2 * BITS
// bytes, broadcast, byte shuffle, variable shift, mask (8 bits: zero-extension).

#define MTPX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

struct Nibbles128 {
  static constexpr int kBits = 4, kCodes = 128, kLanes = 16;
  static constexpr int code(int t, int j) { return 8 * j + t; }
  static constexpr int bit(int t, int /*j*/) { return t < 7 ? 4 * t : 0; }
  static const int32_t* masks() {
    static const std::array<int32_t, 128> m = lane_masks<Nibbles128>();
    return m.data();
  }
  MTPX_AVX512 static __m512 vec(__m512i v, int t, const int32_t* masks) {
    const __m512i q =
        t < 7 ? _mm512_and_si512(v, _mm512_loadu_si512(masks + 16 * t)) : _mm512_srli_epi32(v, 28);
    return _mm512_cvtepi32_ps(q);
  }
};

// Activations for the AVX-512 4-bit tiles: whole blocks of Nibbles128, the rest in natural order.
void arrange_x_nibbles128(const float* x, int64_t m, int64_t cols, int64_t /*group_size*/, float* out) {
  const int64_t main_end = cols / Nibbles128::kCodes * Nibbles128::kCodes;
  arrange_x<Nibbles128>(x, m, cols, 0, main_end, out);
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(out + r * cols + main_end, x + r * cols + main_end,
                sizeof(float) * static_cast<size_t>(cols - main_end));
}

template <int BITS>
MTPX_AVX512 inline __m512 codes16_avx512(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BITS == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  } else {
    const __m512i shuffle = _mm512_loadu_si512(kPairShuffle<BITS, 16>.data());
    const __m512i shift = _mm512_loadu_si512(kShiftInByte<BITS, 16>.data());
    const __m512i pairs = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(bytes), shuffle);
    return _mm512_cvtepi32_ps(
        _mm512_and_si512(_mm512_srlv_epi32(pairs, shift), _mm512_set1_epi32((1 << BITS) - 1)));
  }
}

// Lane j of a block of 128 codes (16 lanes of 8) is in its group 8j / group_size.
MTPX_AVX512 inline __m512i lane_groups_avx512(int64_t group_size) {
  return _mm512_srlv_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120),
                           _mm512_set1_epi32(std::countr_zero(static_cast<uint64_t>(group_size))));
}

// The scales and biases of a tile's NO rows for one chunk of groups, as float32.
template <int NO>
struct ChunkParams {
  alignas(64) float scale[NO][kGroupChunk + 16];  // + 16: a block's scales are read as one vector
  alignas(64) float bias[NO][kGroupChunk];

  // Converts the chunk [g0, g0 + chunk) and adds its bias term, acc += bias[o, g..g+15] * sum(x_g..g+15),
  // for the NR activation rows from m0.
  template <int NR>
  MTPX_AVX512 inline __attribute__((always_inline)) void begin_chunk(const AffineCall& c,
                                                                     const TileRows<NO>& rows, int64_t m0,
                                                                     int64_t g0, int64_t chunk,
                                                                     __m512 (&acc)[NR][NO]) {
    const WeightMatrix& w = *c.w;
    for (int o = 0; o < NO; ++o) {
      params_to_f32(w.scales, w.scale_type, rows.row[o] * c.groups + g0, chunk, scale[o]);
      std::fill(scale[o] + kGroupChunk, scale[o] + kGroupChunk + 16, 0.0f);
      params_to_f32(w.biases, w.scale_type, rows.row[o] * c.groups + g0, chunk, bias[o]);
    }
    for (int64_t v = 0; v < chunk; v += 16)
      for (int r = 0; r < NR; ++r) {
        const __m512 xsum = _mm512_loadu_ps(c.xsum + (m0 + r) * c.xsum_stride + g0 + v);
        for (int o = 0; o < NO; ++o)
          acc[r][o] = _mm512_fmadd_ps(_mm512_load_ps(&bias[o][v]), xsum, acc[r][o]);
      }
  }
};

template <int BITS, int NR, int NO>
MTPX_AVX512 void affine_tile_avx512(const AffineCall& c, int64_t m0, int64_t o0, float* y) {
  const WeightMatrix& w = *c.w;
  const int64_t cols = w.cols, group_size = w.group_size, groups = c.groups;
  const int64_t group_bytes = group_size * BITS / 8;
  // 4 bits: groups [0, block_groups_end) go by whole Nibbles128 blocks of block_groups groups.
  constexpr bool kNibbles = BITS == 4;
  const int64_t block_groups = kNibbles ? std::max<int64_t>(1, Nibbles128::kCodes / group_size) : 1;
  const int64_t block_groups_end = kNibbles ? cols / Nibbles128::kCodes * Nibbles128::kCodes / group_size : 0;
  const TileRows<NO> rows(c, o0);
  alignas(64) uint8_t padded[NO][kMaxGroupBytes + kOverread];
  ChunkParams<NO> params;
  __m512 acc[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_setzero_ps();
  const __m512i lane_group = lane_groups_avx512(group_size);
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupChunk) {  // kGroupChunk is a multiple of block_groups
    const int64_t chunk = std::min(kGroupChunk, groups - g0);
    params.template begin_chunk<NR>(c, rows, m0, g0, chunk, acc);
    auto& scale = params.scale;
    for (int64_t g = g0; g < g0 + chunk;) {
      const bool block = g < block_groups_end;
      const int64_t n = block ? block_groups : 1;  // groups in this step
      const int64_t byte0 = g * group_bytes, bytes = n * group_bytes;
      rows.prefetch_lines(byte0, byte0 + bytes);
      const uint8_t* src[NO];
      for (int o = 0; o < NO; ++o)
        src[o] =
            rows.near_end ? row_bytes_at(c, rows.row[o], byte0, bytes, padded[o]) : rows.codes[o] + byte0;
      __m512 group_acc[NR][NO];
      for (int r = 0; r < NR; ++r)
        for (int o = 0; o < NO; ++o) group_acc[r][o] = _mm512_setzero_ps();
      const float* xg = c.x + m0 * cols + g * group_size;
      if constexpr (kNibbles) {
        if (block) {
          const int32_t* masks = Nibbles128::masks();
          for (int64_t k = 0; k < n * group_size; k += Nibbles128::kCodes) {
            __m512i raw[NO];
            for (int o = 0; o < NO; ++o) raw[o] = _mm512_loadu_si512(src[o] + k / 2);
            for (int t = 0; t < 8; ++t) {
              __m512 xv[NR];
              for (int r = 0; r < NR; ++r) xv[r] = _mm512_loadu_ps(xg + r * cols + k + 16 * t);
              for (int o = 0; o < NO; ++o) {
                const __m512 q = Nibbles128::vec(raw[o], t, masks);
                for (int r = 0; r < NR; ++r) group_acc[r][o] = _mm512_fmadd_ps(xv[r], q, group_acc[r][o]);
              }
            }
          }
        }
      }
      if (!block) {
        for (int64_t k = 0; k < group_size; k += 16) {
          __m512 xv[NR];
          for (int r = 0; r < NR; ++r) xv[r] = _mm512_loadu_ps(xg + r * cols + k);
          for (int o = 0; o < NO; ++o) {
            const __m512 q = codes16_avx512<BITS>(src[o] + k * BITS / 8);
            for (int r = 0; r < NR; ++r) group_acc[r][o] = _mm512_fmadd_ps(xv[r], q, group_acc[r][o]);
          }
        }
      }
      // acc += scale * group_acc, lane by lane, each lane with the scale of its group.
      for (int o = 0; o < NO; ++o) {
        const __m512 sv = block ? _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(&scale[o][g - g0]))
                                : _mm512_set1_ps(scale[o][g - g0]);
        for (int r = 0; r < NR; ++r) acc[r][o] = _mm512_fmadd_ps(sv, group_acc[r][o], acc[r][o]);
      }
      g += n;
    }
  }
  for (int o = 0; o < NO; ++o) {
    if (o0 + o >= w.rows) break;
    for (int r = 0; r < NR; ++r) y[(m0 + r) * w.rows + o0 + o] = _mm512_reduce_add_ps(acc[r][o]);
  }
}

// AVX-512 VNNI, 4 bits, int8 activations (the products are then integer dot products: vpdpbusd multiplies
// 64 unsigned codes by 64 signed activations and adds them in groups of 4 into 16 int32 lanes, where the
// float tiles above spend an and, a conversion and an FMA on every 16 codes). Per run of kActivationBlock
// (32) values of a row, x is quantized as s = max|x| / 127, xq = x * (1 / s) rounded (quantize_activations),
// so each value moves by at most s / 2. The equation is the float one with x replaced by s * xq in the scale
// term only:
//   y = sum_g ( bias_g * sum(x_g) + scale_g * sum_k q_k * s_k * xq_k )
// The bias term uses the float sums of x as before. A block of 128 codes (64 bytes of a weight row) gives
// two vectors of bytes: the low nibbles, codes 0, 2, ..., 126, and the high nibbles, codes 1, 3, ..., 127;
// xq is stored in the same order (even codes, then odd codes, per block). Lane j then sums codes 8j..8j+7,
// all in group 8j / group_size and in activation run j / 4: the integer sums are exact, and each lane is
// scaled once per block by scale * s of its group and run. Every (row, output) runs the same operations in
// the same order whatever the tile, so batch invariance holds as for the float tiles.
#define MTPX_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

template <int NR, int NO>
MTPX_AVX512_VNNI void affine_tile_vnni4(const AffineCall& c, int64_t m0, int64_t o0, float* y) {
  const WeightMatrix& w = *c.w;
  const int64_t cols = w.cols, groups = c.groups;
  const int64_t block_groups = std::max<int64_t>(1, kInt8Block / w.group_size);
  const int64_t runs_per_row = cols / kActivationBlock;
  const TileRows<NO> rows(c, o0);
  ChunkParams<NO> params;
  __m512 acc[NR][NO];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o] = _mm512_setzero_ps();
  const __m512i lane_group = lane_groups_avx512(w.group_size);
  const __m512i lane_run = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupChunk) {  // kGroupChunk is a multiple of block_groups
    const int64_t chunk = std::min(kGroupChunk, groups - g0);
    params.template begin_chunk<NR>(c, rows, m0, g0, chunk, acc);
    auto& scale = params.scale;
    for (int64_t g = g0; g < g0 + chunk; g += block_groups) {
      const int64_t k0 = g * w.group_size;  // first code of the block
      rows.prefetch_lines(k0 / 2, (k0 + kInt8Block) / 2);
      __m512i even[NO], odd[NO];
      for (int o = 0; o < NO; ++o) {
        const __m512i raw = _mm512_loadu_si512(rows.codes[o] + k0 / 2);
        even[o] = _mm512_and_si512(raw, low_nibbles);
        odd[o] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
      }
      __m512 sv[NO];
      for (int o = 0; o < NO; ++o)
        sv[o] = _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(&scale[o][g - g0]));
      for (int r = 0; r < NR; ++r) {
        const int8_t* xr = c.xq + (m0 + r) * cols + k0;
        const __m512i x_even = _mm512_loadu_si512(xr), x_odd = _mm512_loadu_si512(xr + kInt8Block / 2);
        const __m512 run_scale = _mm512_permutexvar_ps(
            lane_run, _mm512_castps128_ps512(
                          _mm_loadu_ps(c.xq_scale + (m0 + r) * runs_per_row + k0 / kActivationBlock)));
        for (int o = 0; o < NO; ++o) {
          const __m512i dot = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), even[o], x_even), odd[o], x_odd);
          acc[r][o] = _mm512_fmadd_ps(_mm512_mul_ps(sv[o], run_scale), _mm512_cvtepi32_ps(dot), acc[r][o]);
        }
      }
    }
  }
  for (int o = 0; o < NO; ++o) {
    if (o0 + o >= w.rows) break;
    for (int r = 0; r < NR; ++r) y[(m0 + r) * w.rows + o0 + o] = _mm512_reduce_add_ps(acc[r][o]);
  }
}

// quantize_activations() in portable code (for the AVX2 int8 tiles), the same values: the products by
// 1 / s rounded to nearest even (std::nearbyint in the default rounding mode) and clamped.
void quantize_activations_portable(const float* x, int64_t m, int64_t cols, int8_t* xq, float* scales) {
  const int64_t runs = cols / kActivationBlock;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * cols;
    for (int64_t b = 0; b < runs; ++b) {
      float peak = 0.0f;
      for (int64_t k = 0; k < kActivationBlock; ++k)
        peak = std::max(peak, std::abs(xr[b * kActivationBlock + k]));
      const bool zeros = peak < 1e-30f;
      const float scale = zeros ? 0.0f : peak / 127.0f, inverse = zeros ? 0.0f : 1.0f / scale;
      scales[r * runs + b] = scale;
      for (int64_t k = b * kActivationBlock; k < (b + 1) * kActivationBlock; ++k) {
        const float q = std::clamp(std::nearbyint(xr[k] * inverse), -127.0f, 127.0f);
        const int64_t i = k % kInt8Block;
        xq[r * cols + k / kInt8Block * kInt8Block + (i % 2) * (kInt8Block / 2) + i / 2] =
            static_cast<int8_t>(std::isnan(q) ? -127.0f : q);
      }
    }
  }
}

// v * inverse rounded to the nearest integer, even on ties (the MXCSR default), as int32 in [-127, 127]
// (|x| * (1 / s) may exceed 127 by a rounding).
MTPX_AVX512_VNNI inline __m512i to_int8_range(__m512 v, __m512 inverse) {
  const __m512i limit = _mm512_set1_epi32(127);
  return _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inverse)), limit),
                          _mm512_sub_epi32(_mm512_setzero_si512(), limit));
}

// x [m, cols] (cols a multiple of kInt8Block) as int8 for the VNNI tiles: per run of kActivationBlock values
// s = max|x| / 127 and xq = x * (1 / s) rounded to nearest even (|xq| <= 127; s = 0 and xq = 0 for a run of
// zeros), stored per block of 128 values as the even-indexed values, then the odd-indexed ones.
MTPX_AVX512_VNNI void quantize_activations(const float* x, int64_t m, int64_t cols, int8_t* xq,
                                           float* scales) {
  const int64_t runs = cols / kActivationBlock;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * cols;
    int8_t* qr = xq + r * cols;
    for (int64_t b = 0; b < runs; ++b) {
      const __m512 lo = _mm512_loadu_ps(xr + b * kActivationBlock);
      const __m512 hi = _mm512_loadu_ps(xr + b * kActivationBlock + 16);
      const float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      // A run below 1e-30 counts as zeros: 1 / s could overflow (and its products are far below any
      // rounding of the rest of the row). NaN and Inf propagate: s is then NaN or Inf, and s * xq non-finite.
      const bool zeros = peak < 1e-30f;
      const float scale = zeros ? 0.0f : peak / 127.0f;
      scales[r * runs + b] = scale;
      const __m512 inverse = _mm512_set1_ps(zeros ? 0.0f : 1.0f / scale);
      const __m512i qlo = to_int8_range(lo, inverse), qhi = to_int8_range(hi, inverse);
      // Run b is values [32b, 32b + 32) of block b / 4, i.e. its 16 even values go to bytes 16 (b % 4) of
      // the block's even half, its 16 odd values to the same bytes of the odd half.
      int8_t* block = qr + (b / 4) * kInt8Block + (b % 4) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block),
                       _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qlo, even, qhi)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + kInt8Block / 2),
                       _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qlo, odd, qhi)));
    }
  }
}

#undef MTPX_AVX512_VNNI
#undef MTPX_AVX512

// ---------------------------------------------------------------------------------------------
// Portable fallback, the same equation: per group 8 interleaved partial sums, a fixed pairwise sum,
// acc += scale * dot; then the bias term in group order.
void affine_rows_scalar(const AffineCall& c, int64_t m0, int64_t nr, int64_t o0, int64_t no, float* y) {
  const WeightMatrix& w = *c.w;
  const int64_t cols = w.cols, group_size = w.group_size, groups = c.groups;
  for (int64_t o = o0; o < o0 + no; ++o) {
    const uint8_t* codes = row_codes(w, o);
    for (int64_t r = m0; r < m0 + nr; ++r) {
      const float* xr = c.x + r * cols;
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float part[8] = {};
        for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 8)
          for (int j = 0; j < 8; ++j)
            part[j] += xr[k + j] * static_cast<float>(code_in_row(codes, w.bits, k + j));
        const float dot =
            ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        acc += param_at(w.scales, w.scale_type, o * groups + g) * dot;
      }
      const float* xsum = c.xsum + r * c.xsum_stride;
      float bias = 0.0f;
      for (int64_t g = 0; g < groups; ++g) bias += param_at(w.biases, w.scale_type, o * groups + g) * xsum[g];
      y[r * w.rows + o] = acc + bias;
    }
  }
}

void dequantize_row_scalar(const AffineCall& c, int64_t row, float* out) {
  const WeightMatrix& w = *c.w;
  const uint8_t* codes = row_codes(w, row);
  for (int64_t g = 0; g < c.groups; ++g) {
    const float scale = param_at(w.scales, w.scale_type, row * c.groups + g);
    const float bias = param_at(w.biases, w.scale_type, row * c.groups + g);
    for (int64_t k = g * w.group_size; k < (g + 1) * w.group_size; ++k)
      out[k] = std::fma(scale, static_cast<float>(code_in_row(codes, w.bits, k)), bias);
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch.

using AffineTileFn = void (*)(const AffineCall&, int64_t, int64_t, float*);
using DequantizeRowFn = void (*)(const AffineCall&, int64_t, float*);
// Rearranges activations [m, cols] into the tiles' lane order (see the AVX2 decoders); args: x, m, cols,
// group size, out.
using ArrangeFn = void (*)(const float*, int64_t, int64_t, int64_t, float*);

// Tiles of one SIMD family and bit width: decode (1 row), a 2-row window, and tiles of 1..kRows rows for
// larger windows, each with its own output width.
struct AffineTiles {
  ArrangeFn arrange;  // nullptr: activations in natural order
  AffineTileFn single;
  int single_width;
  AffineTileFn pair;
  int pair_width;
  AffineTileFn multi[kRows];
  int multi_width;
};

// Shapes (measured on the AVX2 EPYC, 4-bit, one core, L2-resident weights; 8 outputs for one row and 2
// outputs for 3 or 4 rows were slower): one row x 4 outputs, two rows x 4, then tiles of up to 3 rows x 3.
// AVX2 has 16 ymm registers for the NR x NO group accumulators, the running accumulators (the compiler keeps
// them in memory between groups when they do not fit), the activations and the decode masks; AVX-512 has
// 32.
// The table of a tile family F (F::tile<NR, NO>: a tile of NR rows x NO outputs; F::arrange) with these
// output widths.
template <class F, int kSingle, int kPair, int kMulti>
const AffineTiles& tile_table() {
  static const AffineTiles t{
      F::arrange, F::template tile<1, kSingle>,
      kSingle,    F::template tile<2, kPair>,
      kPair,      {F::template tile<1, kMulti>, F::template tile<2, kMulti>, F::template tile<3, kMulti>},
      kMulti};
  return t;
}

template <class D, bool kPaired>
struct Avx2Family {
  static constexpr ArrangeFn arrange = std::is_same_v<D, Bytes32> ? nullptr : arrange_x_for<D, kPaired>;
  template <int NR, int NO>
  static constexpr AffineTileFn tile = affine_tile_avx2<D, kPaired, NR, NO>;
};
template <int BITS>
struct Avx512Family {
  static constexpr ArrangeFn arrange = BITS == 4 ? arrange_x_nibbles128 : nullptr;
  template <int NR, int NO>
  static constexpr AffineTileFn tile = affine_tile_avx512<BITS, NR, NO>;
};
struct Vnni4Family {
  static constexpr ArrangeFn arrange = nullptr;
  template <int NR, int NO>
  static constexpr AffineTileFn tile = affine_tile_vnni4<NR, NO>;
};
struct Avx2Int8Family {
  static constexpr ArrangeFn arrange = nullptr;
  template <int NR, int NO>
  static constexpr AffineTileFn tile = affine_tile_avx2_int8<NR, NO>;
};

template <class D, bool kPaired>
const AffineTiles& avx2_tiles() {
  return tile_table<Avx2Family<D, kPaired>, 4, 4, 3>();
}
template <int BITS>
const AffineTiles& avx512_tiles() {
  return tile_table<Avx512Family<BITS>, 8, 4, 4>();
}
// The VNNI tiles (4 bits, int8 activations) in the AVX-512 float tiles' shapes.
const AffineTiles& vnni4_tiles() { return tile_table<Vnni4Family, 8, 4, 4>(); }
// The AVX2 int8 tiles; the 8-lane registers hold fewer outputs' codes than the 16 AVX2 registers of the
// float tiles' shapes would need.
const AffineTiles& avx2_int8_tiles() { return tile_table<Avx2Int8Family, 4, 2, 2>(); }

// Whether the int8 families run w on their int8 tiles; other matrices take the float tiles of their SIMD
// width.
bool int8_applies(AffineKernel kernel, const WeightMatrix& w) {
  return (kernel == AffineKernel::kAvx512Vnni || kernel == AffineKernel::kAvx2Int8) && w.bits == 4 &&
         w.cols % kInt8Block == 0;
}

const AffineTiles* tiles_for(AffineKernel kernel, int bits, int64_t group_size) {
  // The matrices the int8 families do not apply to.
  if (kernel == AffineKernel::kAvx512Vnni) kernel = AffineKernel::kAvx512;
  if (kernel == AffineKernel::kAvx2Int8) kernel = AffineKernel::kAvx2;
  if (kernel == AffineKernel::kAvx2) {
    switch (bits) {
      case 2:
        return &avx2_tiles<Lanes32<2>, false>();
      case 3:
        return &avx2_tiles<Lanes32<3>, false>();
      case 4:
        return group_size == 32 ? &avx2_tiles<Nibbles64, true>() : &avx2_tiles<Nibbles64, false>();
      case 5:
        return &avx2_tiles<Lanes32<5>, false>();
      case 6:
        return &avx2_tiles<Lanes32<6>, false>();
      case 8:
        return &avx2_tiles<Bytes32, false>();
    }
  } else if (kernel == AffineKernel::kAvx512) {
    switch (bits) {
      case 2:
        return &avx512_tiles<2>();
      case 3:
        return &avx512_tiles<3>();
      case 4:
        return &avx512_tiles<4>();
      case 5:
        return &avx512_tiles<5>();
      case 6:
        return &avx512_tiles<6>();
      case 8:
        return &avx512_tiles<8>();
    }
  }
  return nullptr;  // scalar
}

AffineKernel detect_kernel() {
  // The same choice as the float kernels (simd_path()), so that one process uses one family throughout;
  // with AVX-512, int8 activations where the CPU has VNNI unless MTPX_AFFINE_ACTIVATIONS=f32.
  const std::string_view path = simd_path();
  const char* activations = std::getenv("MTPX_AFFINE_ACTIVATIONS");
  const std::string_view choice = activations != nullptr ? activations : "";
  if (!choice.empty() && choice != "int8" && choice != "f32")
    invalid_input("MTPX_AFFINE_ACTIVATIONS='{}': expected int8 or f32", choice);
  if (path == "avx512" || path == "amx") {
    return choice != "f32" && affine_kernel_supported(AffineKernel::kAvx512Vnni) ? AffineKernel::kAvx512Vnni
                                                                                 : AffineKernel::kAvx512;
  }
  if (path == "avx2" && affine_kernel_supported(AffineKernel::kAvx2))
    return choice != "f32" ? AffineKernel::kAvx2Int8 : AffineKernel::kAvx2;
  return AffineKernel::kScalar;
}

AffineKernel default_kernel() {
  static const AffineKernel k = detect_kernel();
  return k;
}

DequantizeRowFn dequantize_row_fn(int bits) {
  if (!affine_kernel_supported(AffineKernel::kAvx2)) return dequantize_row_scalar;
  switch (bits) {
    case 2:
      return dequantize_row_avx2<2>;
    case 3:
      return dequantize_row_avx2<3>;
    case 4:
      return dequantize_row_avx2<4>;
    case 5:
      return dequantize_row_avx2<5>;
    case 6:
      return dequantize_row_avx2<6>;
    case 8:
      return dequantize_row_avx2<8>;
  }
  return dequantize_row_scalar;
}

AffineCall make_call(const WeightMatrix& w, const float* x, const float* xsum, int64_t xsum_stride) {
  AffineCall c;
  c.w = &w;
  c.codes = static_cast<const uint8_t*>(w.data);
  c.row_bytes = packed_row_bytes(w);
  c.codes_end = c.codes + w.rows * c.row_bytes;
  c.groups = w.group_size > 0 ? w.cols / w.group_size : 0;
  c.x = x;
  c.xsum = xsum;
  c.xsum_stride = xsum_stride;
  return c;
}

// Prefill: blocks of weight rows dequantized to float32 (in parallel over rows), then sgemm.
void affine_matmul_gemm(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  const int64_t k = w.cols;
  const AffineCall c = make_call(w, nullptr, nullptr, 0);
  const DequantizeRowFn dequantize_row = dequantize_row_fn(w.bits);
  std::vector<float> block(static_cast<size_t>(std::min(kDequantBlockRows, w.rows) * k));
  for (int64_t o0 = 0; o0 < w.rows; o0 += kDequantBlockRows) {
    const int64_t nb = std::min(kDequantBlockRows, w.rows - o0);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nb; ++i) dequantize_row(c, o0 + i, block.data() + i * k);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(nb),
                static_cast<int>(k), 1.0f, x, static_cast<int>(k), block.data(), static_cast<int>(k), 0.0f,
                y + o0, static_cast<int>(w.rows));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

namespace {

void check_quantize_args(int bits, int64_t group_size, int64_t rows, int64_t cols) {
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
    invalid_input("quantize_affine: bits {} not supported (2, 3, 4, 5, 6, 8)", bits);
  if (group_size != 32 && group_size != 64 && group_size != 128)
    invalid_input("quantize_affine: group_size {} not supported (32, 64, 128)", group_size);
  if (rows < 0 || cols < 0 || cols % group_size != 0)
    invalid_input("quantize_affine: shape [{}, {}] is not a whole number of groups of {}", rows, cols,
                  group_size);
}

// MLX's scale and bias for the group v[0, n) (quantize_affine's comment).
std::pair<float, float> mlx_scale_bias(const float* v, int64_t n, float max_code) {
  float lo = v[0], hi = v[0];
  for (int64_t j = 1; j < n; ++j) {
    lo = std::min(lo, v[j]);
    hi = std::max(hi, v[j]);
  }
  // The end of larger magnitude is the edge; the step points from it into the range.
  const bool edge_is_min = std::abs(lo) > std::abs(hi);
  float step = std::max((hi - lo) / max_code, 1e-7f);
  if (!edge_is_min) step = -step;
  const float edge = edge_is_min ? lo : hi;
  // Round the edge to a whole number of steps and stretch the step to hit it exactly: the edge is then
  // code 0 and zero sits (up to rounding) on code -q0.
  const float q0 = std::nearbyint(edge / step);
  return {q0 != 0.0f ? edge / q0 : step, q0 != 0.0f ? edge : 0.0f};
}

// Rounds x in [0, 2^23) to the nearest integer, ties to even: adding and subtracting 2^23 leaves exactly
// that in float32 under the default rounding mode (the project builds without -ffast-math). It is what
// std::nearbyint gives there, and unlike it needs no library call where baseline x86-64 lacks ROUNDSS.
inline float round_nonnegative(float x) {
  constexpr float kTwo23 = 8388608.0f;
  return (x + kTwo23) - kTwo23;
}

inline float code_for(float v, float scale, float bias, float max_code) {
  return round_nonnegative(std::clamp((v - bias) / scale, 0.0f, max_code));
}

// Writes the codes of group g of a row for (scale, bias).
void pack_group(const float* v, int64_t n, int64_t g, int bits, float scale, float bias, float max_code,
                uint32_t* row_words) {
  for (int64_t j = 0; j < n; ++j) {
    const auto code = static_cast<uint32_t>(code_for(v[j], scale, bias, max_code));
    const int64_t bit = (g * n + j) * bits;
    const int64_t word = bit / 32;
    const int shift = static_cast<int>(bit % 32);
    row_words[word] |= code << shift;
    if (shift + bits > 32) row_words[word + 1] |= code >> (32 - shift);
  }
}

template <typename ChooseScaleBias>
void quantize_groups(const float* w, int64_t rows, int64_t cols, int bits, int64_t group_size,
                     uint32_t* packed, float* scales, float* biases, ChooseScaleBias choose) {
  check_quantize_args(bits, group_size, rows, cols);
  const float max_code = static_cast<float>((1 << bits) - 1);
  const int64_t groups = cols / group_size, words_per_row = cols * bits / 32;
  std::memset(packed, 0, sizeof(uint32_t) * static_cast<size_t>(rows * words_per_row));
#pragma omp parallel for schedule(static)  // rows are independent (each writes its own words)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = w + r * cols + g * group_size;
      const auto [scale, bias] = choose(v, g * group_size, group_size, max_code);
      scales[r * groups + g] = scale;
      biases[r * groups + g] = bias;
      pack_group(v, group_size, g, bits, scale, bias, max_code, packed + r * words_per_row);
    }
}

float round_to_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Squared error of the group decoded with (scale, bias), codes chosen for them; value j weighs wt[j].
double group_error(const float* v, const float* wt, int64_t n, float scale, float bias, float max_code) {
  double e = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double d = static_cast<double>(scale) * code_for(v[j], scale, bias, max_code) + bias - v[j];
    e += wt[j] * d * d;
  }
  return e;
}

}  // namespace

void quantize_affine(const float* w, int64_t rows, int64_t cols, int bits, int64_t group_size,
                     uint32_t* packed, float* scales, float* biases) {
  quantize_groups(
      w, rows, cols, bits, group_size, packed, scales, biases,
      [](const float* v, int64_t, int64_t n, float max_code) { return mlx_scale_bias(v, n, max_code); });
}

void quantize_affine_least_squares(const float* w, int64_t rows, int64_t cols, int bits, int64_t group_size,
                                   uint32_t* packed, float* scales, float* biases,
                                   const float* column_weights) {
  const std::vector<float> ones(static_cast<size_t>(column_weights == nullptr ? group_size : 0), 1.0f);
  quantize_groups(
      w, rows, cols, bits, group_size, packed, scales, biases,
      [&](const float* v, int64_t col0, int64_t n, float max_code) -> std::pair<float, float> {
        const float* wt = column_weights != nullptr ? column_weights + col0 : ones.data();
        const auto [mlx_scale, mlx_bias] = mlx_scale_bias(v, n, max_code);
        // (|mlx_scale| >= ~1e-7, so its bf16 rounding is never 0.)
        float best_scale = round_to_bf16(mlx_scale), best_bias = round_to_bf16(mlx_bias);
        double best = group_error(v, wt, n, best_scale, best_bias, max_code);
        const float lo = *std::min_element(v, v + n), hi = *std::max_element(v, v + n);
        if (!(hi > lo)) return {best_scale, best_bias};
        for (int step = 0; step <= 20; ++step) {
          // Codes of the range [lo, hi] spread over max_code - 1 + step / 10 steps.
          const float inverse = (max_code - 1.0f + 0.1f * static_cast<float>(step)) / (hi - lo);
          double sum_w = 0, sum_q = 0, sum_qq = 0, sum_v = 0, sum_qv = 0;
          for (int64_t j = 0; j < n; ++j) {
            const double q = round_nonnegative(std::clamp(inverse * (v[j] - lo), 0.0f, max_code));
            sum_w += wt[j], sum_q += wt[j] * q, sum_qq += wt[j] * q * q;
            sum_v += wt[j] * v[j], sum_qv += wt[j] * q * v[j];
          }
          // Weighted least squares for v ~ scale * q + bias over the group.
          const double det = sum_w * sum_qq - sum_q * sum_q;
          if (!(det > 0.0)) continue;
          const auto scale = round_to_bf16(static_cast<float>((sum_w * sum_qv - sum_q * sum_v) / det));
          const auto bias = round_to_bf16(static_cast<float>((sum_qq * sum_v - sum_q * sum_qv) / det));
          if (scale == 0.0f || !std::isfinite(scale) || !std::isfinite(bias)) continue;
          const double e = group_error(v, wt, n, scale, bias, max_code);
          if (e < best) best = e, best_scale = scale, best_bias = bias;
        }
        return {best_scale, best_bias};
      });
}

uint32_t affine_code(const WeightMatrix& w, int64_t row, int64_t k) {
  return code_in_row(row_codes(w, row), w.bits, k);
}

void check_affine(const WeightMatrix& w) {
  if (w.type != WeightType::kAffine) invalid_input("affine matmul: the matrix is not kAffine");
  if (w.bits != 2 && w.bits != 3 && w.bits != 4 && w.bits != 5 && w.bits != 6 && w.bits != 8)
    invalid_input("affine matmul: bits {} not supported (2, 3, 4, 5, 6, 8)", w.bits);
  if (w.group_size != 32 && w.group_size != 64 && w.group_size != 128)
    invalid_input("affine matmul: group_size {} not supported (32, 64, 128)", w.group_size);
  if (w.rows < 0 || w.cols < 0 || w.cols % w.group_size != 0)
    invalid_input("affine matmul: shape [{}, {}] is not a whole number of groups of {}", w.rows, w.cols,
                  w.group_size);
  if (w.scale_type == WeightType::kAffine) invalid_input("affine matmul: scales must be f32, f16 or bf16");
  if (w.rows > 0 && w.cols > 0 && (w.data == nullptr || w.scales == nullptr || w.biases == nullptr))
    invalid_input("affine matmul: codes, scales and biases must all be set");
}

bool affine_kernel_supported(AffineKernel kernel) {
  __builtin_cpu_init();
  switch (kernel) {
    case AffineKernel::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case AffineKernel::kAvx512Vnni:
      return affine_kernel_supported(AffineKernel::kAvx512) && __builtin_cpu_supports("avx512vnni");
    case AffineKernel::kAvx2Int8:
    case AffineKernel::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case AffineKernel::kScalar:
      return true;
  }
  return false;
}

void affine_matmul(const WeightMatrix& w, const float* x, int64_t m, float* y, AffineKernel kernel) {
  check_affine(w);
  if (m <= 0 || w.rows <= 0) return;
  if (w.cols == 0) {
    std::memset(y, 0, sizeof(float) * static_cast<size_t>(m * w.rows));
    return;
  }
  if (m >= kGemmMinRows) {
    affine_matmul_gemm(w, x, m, y);
    return;
  }
  if (!affine_kernel_supported(kernel))
    fail(ErrorKind::kInternal, "affine matmul: kernel not supported here");
  // Rows of sums padded with zeros to whole 16-lane vectors (the tiles read the bias term in vectors).
  thread_local std::vector<float> xsum;
  const int64_t groups = w.cols / w.group_size, xsum_stride = (groups + 15) / 16 * 16;
  xsum.resize(static_cast<size_t>(m * xsum_stride));
  group_sums(x, m, w.cols, w.group_size, xsum_stride, xsum.data());
  const bool int8 = int8_applies(kernel, w);
  const AffineTiles* tiles = !int8                                 ? tiles_for(kernel, w.bits, w.group_size)
                             : kernel == AffineKernel::kAvx512Vnni ? &vnni4_tiles()
                                                                   : &avx2_int8_tiles();
  thread_local std::vector<float> arranged;
  if (tiles != nullptr && tiles->arrange != nullptr) {
    arranged.resize(static_cast<size_t>(m * w.cols));
    tiles->arrange(x, m, w.cols, w.group_size, arranged.data());
    x = arranged.data();
  }
  AffineCall call = make_call(w, x, xsum.data(), xsum_stride);
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xq_scale;
  if (int8) {
    xq.resize(static_cast<size_t>(m * w.cols));
    xq_scale.resize(static_cast<size_t>(m * w.cols / kActivationBlock));
    if (kernel == AffineKernel::kAvx512Vnni) {
      quantize_activations(x, m, w.cols, xq.data(), xq_scale.data());
    } else {
      quantize_activations_portable(x, m, w.cols, xq.data(), xq_scale.data());
    }
    call.xq = xq.data();
    call.xq_scale = xq_scale.data();
  }
  // Small products are not worth waking the thread team.
  const bool parallel = w.rows * w.cols * m >= (int64_t{1} << 15);
  if (tiles == nullptr) {
    constexpr int64_t kScalarWidth = 4;
    const int64_t out_tiles = (w.rows + kScalarWidth - 1) / kScalarWidth;
#pragma omp parallel for schedule(static) if (parallel && out_tiles > 1)
    for (int64_t t = 0; t < out_tiles; ++t)
      affine_rows_scalar(call, 0, m, t * kScalarWidth, std::min(kScalarWidth, w.rows - t * kScalarWidth), y);
    return;
  }
  const int64_t width = m == 1 ? tiles->single_width : m == 2 ? tiles->pair_width : tiles->multi_width;
  const int64_t out_tiles = (w.rows + width - 1) / width;
#pragma omp parallel for schedule(static) if (parallel && out_tiles > 1)
  for (int64_t t = 0; t < out_tiles; ++t) {
    const int64_t o0 = t * width;
    if (m == 1) {
      tiles->single(call, 0, o0, y);
    } else if (m == 2) {
      tiles->pair(call, 0, o0, y);
    } else {
      for (int64_t m0 = 0; m0 < m; m0 += kRows) tiles->multi[std::min(kRows, m - m0) - 1](call, m0, o0, y);
    }
  }
}

void affine_matmul(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  affine_matmul(w, x, m, y, default_kernel());
}

AffineKernel affine_default_kernel() { return default_kernel(); }

void affine_matmul_reference(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  check_affine(w);
  const int64_t groups = w.cols / w.group_size;
  for (int64_t o = 0; o < w.rows; ++o) {
    const uint8_t* codes = row_codes(w, o);
    for (int64_t r = 0; r < m; ++r) {
      double s = 0.0;
      for (int64_t k = 0; k < w.cols; ++k) {
        const int64_t g = o * groups + k / w.group_size;
        const double weight = static_cast<double>(param_at(w.scales, w.scale_type, g)) *
                                  static_cast<double>(code_in_row(codes, w.bits, k)) +
                              static_cast<double>(param_at(w.biases, w.scale_type, g));
        s += static_cast<double>(x[r * w.cols + k]) * weight;
      }
      y[r * w.rows + o] = static_cast<float>(s);
    }
  }
}

void affine_row_to_f32(const WeightMatrix& w, int64_t row, float* out) {
  check_affine(w);
  const AffineCall c = make_call(w, nullptr, nullptr, 0);
  dequantize_row_fn(w.bits)(c, row, out);
}

}  // namespace mtpx::cpu
