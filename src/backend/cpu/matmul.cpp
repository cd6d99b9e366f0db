#include "backend/cpu/matmul.h"

// GCC 12 reports its own _mm512_undefined_* helpers inside the AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <cblas.h>
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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
// AMX (Intel AMX-BF16 tile multiplies). TDPBF16PS computes C[i, n] += sum_k A[i, k] B[k, n] for a
// 16 x 32 bf16 block A, a 32 x 16 bf16 block B (stored in pairs: B row p holds, per column n, the
// elements k = 2p and 2p+1) and a 16 x 16 float32 block C. Here A is 16 weight rows x 32 columns, read in
// place (64 bytes of each row, with the matrix's row stride), and B holds the activations. A float32
// activation x is split into three bf16 terms, hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid)
// (both subtractions are exact), each its own column of B: a bf16 weight times a bf16 term is exact in
// float32, so the sum (lo + mid) + hi of the three columns keeps x's 24 bits and has only the float32
// accumulation error (a single bf16 x would lose 16 of them). Five activation rows (15 columns) per B
// tile; more rows take several passes over each 16-row block of weights (from L1/L2).
//
// Why: a tile multiply takes the same time whatever number of rows it holds, so a verify window of 2-5
// rows costs about what one decode row does (the AVX-512 kernels pay one activation load and FMA per row
// and weight vector). One weight row block streams from memory at the rate of the AVX-512 kernel.
//
// Batch invariance: each C element is computed from its own A row and B column only (Intel SDM,
// TDPBF16PS), over the k-blocks of 32 in order, then its three columns are added in a fixed order; which
// other rows, columns or threads share the work changes nothing.
constexpr int64_t kAmxRowsPerTile = 5;  // activation rows per B tile (3 of its 16 columns each)

// The LDTILECFG operand (palette 1): rows and bytes per row of each tile register.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The B tiles of all activation rows: [chunk of 5 rows][k-block of 32][16 pairs][16 columns][2] bf16,
// 1 KiB per (chunk, k-block); columns past 3 x the chunk's rows are zero.
struct AmxActivations {
  std::vector<uint16_t> tiles;
  int64_t chunks = 0, k_blocks = 0;
  int64_t columns = 0;  // columns in use in the widest chunk (3 x min(m, 5))
  const uint16_t* tile(int64_t chunk, int64_t kb) const {
    return tiles.data() + (chunk * k_blocks + kb) * 16 * 16 * 2;
  }
};

AmxActivations prepare_amx_activations(const float* x, int64_t m, int64_t k_dim) {
  AmxActivations a;
  a.k_blocks = k_dim / 32;
  a.chunks = (m + kAmxRowsPerTile - 1) / kAmxRowsPerTile;
  a.columns = 3 * std::min(m, kAmxRowsPerTile);
  a.tiles.assign(static_cast<size_t>(a.chunks * a.k_blocks * 16 * 16 * 2), 0);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t chunk = r / kAmxRowsPerTile, column = 3 * (r % kAmxRowsPerTile);
    for (int64_t k = 0; k < k_dim; ++k) {
      const float v = x[r * k_dim + k];
      const uint16_t hi = f32_to_bf16(v);
      const float rest = v - bf16_to_f32(hi);
      const uint16_t mid = f32_to_bf16(rest);
      const uint16_t lo = f32_to_bf16(rest - bf16_to_f32(mid));
      uint16_t* pair_row = const_cast<uint16_t*>(a.tile(chunk, k / 32)) + (k % 32 / 2) * 32;
      const int64_t e = k % 2;
      pair_row[column * 2 + e] = hi;
      pair_row[(column + 1) * 2 + e] = mid;
      pair_row[(column + 2) * 2 + e] = lo;
    }
  }
  return a;
}

// Output features [o_begin, o_end) for all m rows: blocks of 16 weight rows (o_begin a multiple of 16;
// only the last block may be shorter, in tiles configured with fewer rows, so no byte past the matrix is
// read). Tiles: 0 C, 1 B, 2 A; 3 and 4 the C and A of a short last block.
__attribute__((target("amx-tile,amx-bf16"))) void rows_amx(const WeightMatrix& w, const AmxActivations& xa,
                                                           int64_t m, int64_t o_begin, int64_t o_end,
                                                           float* y) {
  const int64_t k_dim = w.cols, tail = (o_end - o_begin) % 16;
  AmxTileConfig config;
  const auto row_bytes = static_cast<uint16_t>(xa.columns * 4);
  config.rows[0] = config.rows[1] = config.rows[2] = 16;
  config.colsb[0] = config.colsb[1] = row_bytes;
  config.colsb[2] = 64;
  if (tail > 0) {
    config.rows[3] = config.rows[4] = static_cast<uint8_t>(tail);
    config.colsb[3] = row_bytes;
    config.colsb[4] = 64;
  }
  _tile_loadconfig(&config);
  alignas(64) float c[16 * 16];
  const auto* weights = static_cast<const uint16_t*>(w.data);
  const long stride = static_cast<long>(k_dim * 2);
  for (int64_t o = o_begin; o < o_end; o += 16) {
    const uint16_t* block = weights + o * k_dim;
    const bool full = o + 16 <= o_end;
    for (int64_t chunk = 0; chunk < xa.chunks; ++chunk) {
      if (full) {
        _tile_zero(0);
        for (int64_t kb = 0; kb < xa.k_blocks; ++kb) {
          _tile_loadd(1, xa.tile(chunk, kb), 64);
          _tile_loadd(2, block + kb * 32, stride);
          _tile_dpbf16ps(0, 2, 1);
        }
        _tile_stored(0, c, 64);
      } else {
        _tile_zero(3);
        for (int64_t kb = 0; kb < xa.k_blocks; ++kb) {
          _tile_loadd(1, xa.tile(chunk, kb), 64);
          _tile_loadd(4, block + kb * 32, stride);
          _tile_dpbf16ps(3, 4, 1);
        }
        _tile_stored(3, c, 64);
      }
      const int64_t rows_here = full ? 16 : tail;
      const int64_t r0 = chunk * kAmxRowsPerTile, r_end = std::min(m, r0 + kAmxRowsPerTile);
      for (int64_t i = 0; i < rows_here; ++i)
        for (int64_t r = r0; r < r_end; ++r) {
          const float* sums = c + i * 16 + 3 * (r - r0);  // hi, mid, lo
          y[r * w.rows + o + i] = (sums[2] + sums[1]) + sums[0];
        }
    }
  }
  _tile_release();
}

// The AMX kernels serve bf16 weights in whole 32-wide k-blocks; the family runs the AVX-512 kernels on
// any other weight.
bool amx_serves(const WeightMatrix& w) { return w.type == WeightType::kBF16 && w.cols % 32 == 0; }

void matmul_amx(const WeightMatrix& w, const float* x, int64_t m, float* y) {
  const AmxActivations xa = prepare_amx_activations(x, m, w.cols);
  const int64_t blocks = (w.rows + 15) / 16;
  // Each thread takes one contiguous range of 16-row blocks (one tile configuration per thread and call).
  const bool parallel = blocks > 1 && w.rows * w.cols >= (int64_t{1} << 15);
#pragma omp parallel if (parallel)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
    if (b1 > b0) rows_amx(w, xa, m, b0 * 16, std::min(w.rows, b1 * 16), y);
  }
}

// AMX needs the CPU's tile units (CPUID.7.0:EDX bits 24 AMX-TILE and 22 AMX-BF16), an OS that saves tile
// state (XCR0 bits 17-18), and on Linux the process's request for it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, kernel 5.16+; refused under older kernels and some hypervisors).
bool amx_usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
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
  // AMX only when asked for: on the 2-core Sapphire Rapids-class Xeon it measured it lost at one row on
  // cache-resident models (the shipped model: 832 vs 1108 tok/s) and did not win on the 0.8B shape
  // (BENCHMARKS.md, session 6).
  for (MatmulKernel k : {MatmulKernel::kAvx512, MatmulKernel::kAvx2})
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

bool matmul_kernel_supported(MatmulKernel kernel) { return hardware_supports(kernel); }

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
  if (kernel == MatmulKernel::kAmx) {
    if (amx_serves(w)) {
      matmul_amx(w, x, m, y);
      return;
    }
    kernel = MatmulKernel::kAvx512;
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

const char* simd_path() { return kernel_name(path()); }

}  // namespace mtpx::cpu
