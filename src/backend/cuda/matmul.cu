// Row products (decode and verify: the FMA, tile and streaming row kernels) and the prompt GEMMs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/affine.h"
#include "backend/cuda/cublas_api.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/runtime.h"
#include "util/error.h"

namespace mtpx::cuda {
namespace {

// ---- matmul rows: a warp computes R output features (weight rows) for all M activation rows; lane l
// reduces k = 8l.. in strides of 256, then a fixed butterfly. Row m's arithmetic (its own accumulator,
// the same k order) does not depend on M or on which features share the warp: batch-invariant.
// Several matrices with the same input can run in one launch (q/k/v; the DeltaNet projections), and
// the epilogue can add into y (residual) or combine gate and up (SwiGLU).
constexpr int kGemvRows = 4;  // weight rows per warp: each x load serves 4 rows (2 for small matrices)
constexpr int kMaxGroup = 4;

template <typename W>
struct GemvGroup {
  const W* w[kMaxGroup];
  float* y[kMaxGroup];
  int rows[kMaxGroup];
  int tasks_before[kMaxGroup + 1];  // prefix sums of each matrix's tasks (gemv_rows: warps; tiles: blocks)
  int count;
  int cols;
  uint32_t prefetch_bytes;  // of each row, before griddep_wait (device_math.cuh)
  // bf16_tile_rows only: non-null: the activation rows are RMS-normalized first (RowNorm, kernels.h).
  const float* norm_weight;
  float norm_eps;
};

template <typename W, int M, int MODE, int R>  // R weight rows per warp (swiglu: R/2 gate + R/2 up rows)
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_rows(const GemvGroup<W> g, const float* __restrict__ x) {
  const int warp = blockIdx.x * kGemvWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= g.tasks_before[g.count]) return;
  int j = 0;
  while (warp >= g.tasks_before[j + 1]) ++j;
  const int per_matrix = MODE == kSwiglu ? R / 2 : R;
  const int row0 = (warp - g.tasks_before[j]) * per_matrix;
  const int cols = g.cols;
  const W* wr[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int mi = MODE == kSwiglu ? (i < R / 2 ? 0 : 1) : j;
    const int r = row0 + (MODE == kSwiglu ? i % (R / 2) : i);
    wr[i] =
        g.w[mi] + static_cast<size_t>(min(r, g.rows[j] - 1)) * cols;  // past the end: computed, not stored
  }
#pragma unroll
  for (int i = 0; i < R; ++i)
    if (lane == i) prefetch_l2(wr[i], g.prefetch_bytes);
  griddep_wait();
  griddep_launch_dependents();
  float acc[R][M];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[i][m] = 0.0f;
#pragma unroll(8 / R)  // 8 loads of 16 bytes in flight per lane
  for (int k = lane * 8; k < cols; k += 256) {
    float wf[R][8];
#pragma unroll
    for (int i = 0; i < R; ++i) load8(wr[i] + k, wf[i]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float4 a = *reinterpret_cast<const float4*>(x + static_cast<size_t>(m) * cols + k);
      const float4 b = *reinterpret_cast<const float4*>(x + static_cast<size_t>(m) * cols + k + 4);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        float s = acc[i][m];
        s = fmaf(wf[i][0], a.x, s), s = fmaf(wf[i][1], a.y, s), s = fmaf(wf[i][2], a.z, s);
        s = fmaf(wf[i][3], a.w, s), s = fmaf(wf[i][4], b.x, s), s = fmaf(wf[i][5], b.y, s);
        s = fmaf(wf[i][6], b.z, s), s = fmaf(wf[i][7], b.w, s);
        acc[i][m] = s;
      }
    }
  }
  finish_rows<M, MODE, R>(acc, g, j, row0, per_matrix, lane);
}

// ---- bf16 rows on tensor cores: mma.sync m16n8k16, bf16 operands, float32 accumulation (PTX ISA, "Matrix
// Fragments for mma.m16n8k16 with floating point type"). A block takes 16 weight rows (the A operand; 16
// gate and 16 up rows for SwiGLU) against up to 8 activation rows per n-tile (B); its 8 warps split k:
// warp w takes the 64-wide k-blocks w, w + 8, ... Lane (g = lane / 4, q = lane % 4) loads 32 contiguous
// bytes of weight rows g and g + 8 and 16 floats of activation row g at k + 16q, and the four k-steps of
// a block use its words 2s and 2s + 1 as A's k-slots (2q, 2q + 1) and (2q + 8, 2q + 9), and B's the same:
// a dot product may take its k in any order as long as A and B agree, so no shuffle or shared-memory
// staging is needed. The float32 activations enter as x = hi + lo, both bf16 (two products, as the prefill
// GEMMs do: ~16 bits of x kept). The warps' partial tiles are summed in warp order through shared memory.
// Why: the FMA kernel spends 1 + M instructions per weight, and a verify window of 4 rows cost 1.27x a
// decode step on the 9B shape; an mma takes 16 x 16 weights for all 8 columns at once. Measured on the
// H200 (BENCHMARKS.md, session 15): 9B c(3) 1.27 -> 1.10, c(7) 2.0 -> 1.33, decode 161 -> 169 tok/s
// (MTPX_BF16_ROWS=fma switches back to the FMA kernel). Batch-invariant: activation row m is B's column m,
// which no other column touches, with the same instructions, k order and warp order for any row count.
// With g.norm_weight (RowNorm, kernels.h) the product takes x * weight and each lane also sums x^2 over the
// values it loads; the lanes of a row (four, then the warps in order) add those up and the output is scaled
// by 1 / rms(x) = 1 / sqrt(sum / cols + eps): (x / rms * weight) W^T with the norm's division moved past the
// dot product, so the RMSNorm kernel before the product and its round trip go away. The same order for any
// row count again.
constexpr int kTileRows = 16;  // weight rows per mma tile
constexpr int kTileK = 64;     // k per warp step: 32 bytes of a weight row per lane, four mma k-steps

// The outputs of a block's row tiles from its warps' accumulator fragments (partial[w][t][n][c][lane]) and,
// with NORM, their sums of x^2 per activation row (row_squares[w][m]): the warps summed in warp order, then
// the epilogue. Consecutive threads take consecutive rows; fragment element c of lane (g, q) holds row
// g + 8 (c / 2), column 2q + c % 2. bf16_tile_rows and bf16_stream_rows both end here, which keeps their
// outputs bit for bit the same.
template <int MODE, int TILES, int OUT_TILES, int NT, int WARPS, bool NORM>
__device__ __forceinline__ void write_tile_outputs(const float (*partial)[TILES][NT][4][32],
                                                   const float (*row_squares)[NT * 8],
                                                   const GemvGroup<__nv_bfloat16>& g, int j, int row0,
                                                   int rows, int m_count) {
  for (int o = threadIdx.x; o < OUT_TILES * kTileRows * 8 * NT; o += blockDim.x) {
    const int ot = o / (kTileRows * 8 * NT), r = o % kTileRows, m = o % (kTileRows * 8 * NT) / kTileRows;
    const int row = row0 + ot * kTileRows + r;
    if (m >= m_count || row >= rows) continue;
    const int n = m / 8, frag_lane = (r % 8) * 4 + (m % 8) / 2, c = (r / 8) * 2 + m % 2;
    float v[2] = {0.0f, 0.0f};
#pragma unroll
    for (int t = 0; t < (MODE == kSwiglu ? 2 : 1); ++t) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += partial[w][MODE == kSwiglu ? t : ot][n][c][frag_lane];
      v[t] = sum;
    }
    if constexpr (NORM) {  // x W^T / rms(x), as rms_norm_kernel computes 1 / rms
      float squares_sum = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) squares_sum += row_squares[w][m];
      const float scale = 1.0f / sqrtf(squares_sum / static_cast<float>(g.cols) + g.norm_eps);
      v[0] *= scale, v[1] *= scale;
    }
    float* out = g.y[j] + static_cast<size_t>(m) * rows + row;
    if constexpr (MODE == kSwiglu)
      *out = silu(v[0]) * v[1];
    else if constexpr (MODE == kAccumulate)
      *out += v[0];
    else
      *out = v[0];
  }
}

// RT row tiles per block (not SwiGLU: 16 RT consecutive rows of one matrix), WARPS warps splitting k; NORM:
// the input's RMSNorm (g.norm_weight) taken.
template <int NT, int MODE, int U, int RT = 1, int WARPS = kGemvWarps, bool NORM = false>
__global__ void __launch_bounds__(WARPS * 32)
    bf16_tile_rows(const GemvGroup<__nv_bfloat16> g, const float* __restrict__ x, int m_count) {
  constexpr int kTiles = MODE == kSwiglu ? 2 : RT;
  constexpr int kOutTiles = MODE == kSwiglu ? 1 : RT;
  __shared__ float partial[WARPS][kTiles][NT][4][32];      // each warp's accumulator fragments
  __shared__ float row_squares[NORM ? WARPS : 1][NT * 8];  // NORM: each warp's sums of x^2 per row
  const int block = blockIdx.x;
  int j = 0;
  while (block >= g.tasks_before[j + 1]) ++j;
  const int row0 = (block - g.tasks_before[j]) * kTileRows * kOutTiles, rows = g.rows[j], cols = g.cols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 4, quad = lane % 4;
  const __nv_bfloat16* w_lo[kTiles];  // row g of each tile (past the end: the last row, not stored)
  const __nv_bfloat16* w_hi[kTiles];  // row g + 8
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const __nv_bfloat16* w = g.w[MODE == kSwiglu ? t : j];
    const int tile_row0 = MODE == kSwiglu ? row0 : row0 + t * kTileRows;
    w_lo[t] = w + static_cast<size_t>(min(tile_row0 + grp, rows - 1)) * cols + 16 * quad;
    w_hi[t] = w + static_cast<size_t>(min(tile_row0 + grp + 8, rows - 1)) * cols + 16 * quad;
  }
  if (warp == 0 && lane < kTiles * kTileRows) {
    const __nv_bfloat16* w = g.w[MODE == kSwiglu ? lane / kTileRows : j];
    const int r = MODE == kSwiglu ? row0 + lane % kTileRows : row0 + lane;
    prefetch_l2(w + static_cast<size_t>(min(r, rows - 1)) * cols, g.prefetch_bytes);
  }
  griddep_wait();
  griddep_launch_dependents();
  float acc[kTiles][NT][4];
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[t][n][c] = 0.0f;
  float squares[NT];  // NORM: the sum of x^2 over the lane's values of row n * 8 + grp
#pragma unroll
  for (int n = 0; n < NT; ++n) squares[n] = 0.0f;
  const int k_blocks = cols / kTileK;
  // U k-blocks per pass, all their loads issued before the first mma (past the end: not loaded, zero).
  for (int kb0 = warp; kb0 < k_blocks; kb0 += U * WARPS) {
    uint4 a_lo[U][kTiles][2], a_hi[U][kTiles][2];
    float4 xv[U][NT][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kb = kb0 + u * WARPS, k = kb * kTileK;
      const bool in = kb < k_blocks;
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        const uint4 zero = make_uint4(0, 0, 0, 0);
        a_lo[u][t][0] = in ? __ldg(reinterpret_cast<const uint4*>(w_lo[t] + k)) : zero;
        a_lo[u][t][1] = in ? __ldg(reinterpret_cast<const uint4*>(w_lo[t] + k + 8)) : zero;
        a_hi[u][t][0] = in ? __ldg(reinterpret_cast<const uint4*>(w_hi[t] + k)) : zero;
        a_hi[u][t][1] = in ? __ldg(reinterpret_cast<const uint4*>(w_hi[t] + k + 8)) : zero;
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int m = n * 8 + grp;
        const float4* xm = reinterpret_cast<const float4*>(x + static_cast<size_t>(m) * cols + k + 16 * quad);
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[u][n][i] = in && m < m_count ? xm[i] : make_float4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (kb0 + u * WARPS >= k_blocks) break;
      float4 nw[NORM ? 4 : 1];  // the norm's weights at the lane's 16 values (read here: registers)
      if constexpr (NORM) {
        const float4* wn =
            reinterpret_cast<const float4*>(g.norm_weight + (kb0 + u * WARPS) * kTileK + 16 * quad);
#pragma unroll
        for (int i = 0; i < 4; ++i) nw[i] = __ldg(wn + i);
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        uint32_t bh[8], bl[8];  // word i: activation values 2i, 2i + 1 of the lane's 16
        if constexpr (NORM) {   // x^2 summed, then x * weight (the row's 1 / rms comes at the end)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float4& v = xv[u][n][i];
            squares[n] = fmaf(v.x, v.x, squares[n]), squares[n] = fmaf(v.y, v.y, squares[n]);
            squares[n] = fmaf(v.z, v.z, squares[n]), squares[n] = fmaf(v.w, v.w, squares[n]);
            v.x *= nw[i].x, v.y *= nw[i].y, v.z *= nw[i].z, v.w *= nw[i].w;
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          split_pair(xv[u][n][i].x, xv[u][n][i].y, bh[2 * i], bl[2 * i]);
          split_pair(xv[u][n][i].z, xv[u][n][i].w, bh[2 * i + 1], bl[2 * i + 1]);
        }
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
          const uint4 l0 = a_lo[u][t][0], l1 = a_lo[u][t][1], h0 = a_hi[u][t][0], h1 = a_hi[u][t][1];
          const uint32_t lo[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
          const uint32_t hi[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            mma_bf16(acc[t][n], lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1], bh[2 * s], bh[2 * s + 1]);
            mma_bf16(acc[t][n], lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1], bl[2 * s], bl[2 * s + 1]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) partial[warp][t][n][c][lane] = acc[t][n][c];
  if constexpr (NORM) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {  // the row's four lanes, in a fixed order
      float v = squares[n];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (quad == 0) row_squares[warp][n * 8 + grp] = v;
    }
  }
  __syncthreads();
  write_tile_outputs<MODE, kTiles, kOutTiles, NT, WARPS, NORM>(partial, row_squares, g, j, row0, rows,
                                                               m_count);
}

// ---- bf16 rows streamed through shared memory: bf16_tile_rows' arithmetic (the same fragments, k order,
// mma order and warp-order sum, so every output is bit for bit the tile kernel's and batch invariance holds
// across the two) with the weights moved by cp.async into a ring of stages per warp instead of loaded into
// registers pass by pass. Why: a tile block loads one pass of weights, waits a DRAM round trip, computes,
// and loads the next, so each SM's loads come in bursts with idle memory between them, and a block only
// starts loading when it is scheduled (ncu, session 17: the 9B SwiGLU product at 76% of copy bandwidth, the
// residual ones at 65%). Here the blocks are persistent (one per multiprocessor, stepping over the tasks),
// each warp keeps `stages` stages of SB k-blocks in flight across task boundaries, and the first
// are requested before griddep_wait (weights are never written by an earlier kernel), so the stream does not
// stop at the kernel boundary either. The activations of a stage follow it once the wait has passed.
// Each k-block of a stage: kTiles tiles of 16 rows x 128 bytes, the 16-byte piece p of row r at position
// p ^ (r % 8), so the lanes' 16-byte fragment reads hit distinct banks; then NORM's 64 weights; then the
// activation rows' 64 floats each.
__device__ __forceinline__ void cp_async16(void* shared, const void* global) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(global) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Waits until at most `pending` of the lane's newest groups are in flight (wait_group takes an immediate).
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  switch (pending) {
    case 7:
      return cp_async_wait<7>();
    case 6:
      return cp_async_wait<6>();
    case 5:
      return cp_async_wait<5>();
    case 4:
      return cp_async_wait<4>();
    case 3:
      return cp_async_wait<3>();
    case 2:
      return cp_async_wait<2>();
    case 1:
      return cp_async_wait<1>();
    default:
      return cp_async_wait<0>();
  }
}

constexpr int kMaxStages = 8;  // cp_async_wait_pending's cases
// Ring geometry, measured on the H200 (BENCHMARKS.md, session 22; 9B / 0.8B decode tok/s against 181.5 /
// 930.3 for bf16_tile_rows in the same call): two k-blocks per stage and 192 KiB of ring per block, one block
// per multiprocessor: 191.7 / 938.7. One k-block per stage: 171.0 / 847.8 (the loop's bookkeeping per 2 KB
// of weights); two blocks of 96 KiB per multiprocessor: 177.8 / 967.7 (one k-block per stage: 187.9 /
// 922.6); 110 KiB each, one k-block per stage: 181.8 / 873.7.
// 160 KiB since session 28 (H100, BENCHMARKS.md; medians, c(3) with the argmax on the device): 9B decode
// 156.8 against 155.3 tok/s with 192 KiB, c(3) 1.033 against 1.071; 0.8B 870.5 against 851.2, c(3) 1.073
// against 1.110. The 4-row window gains: its normed two-tile products (in_proj groups, SwiGLU) no longer
// fit two stages of two k-blocks and take three of one (launch_bf16_stream), and the residual products
// take 3 stages instead of 4 (the 16-warp ones, 3 of one k-block at 3-4 rows). One row keeps two k-blocks
// per stage everywhere (the 8-warp residuals 4 stages instead of 5). 104-108 KiB (two blocks per
// multiprocessor, so the next product loads under PDL beside this one) ran 7-14% slower; 216 KiB 4.5%
// slower on the 9B (its one-row two-tile products took 5 stages of one k-block).
constexpr int kStageBlocks = 2;         // k-blocks per stage, where two stages of them fit the ring
constexpr int kRingBytes = 160 * 1024;  // all the warps' stages of a block

template <int MODE, int RT>
constexpr int stream_tiles() {
  return MODE == kSwiglu ? 2 : RT;
}
constexpr int stream_weight_bytes(int tiles) { return tiles * kTileRows * kTileK * 2; }
constexpr int stream_stage_bytes(int tiles, bool norm, int m_count) {
  return stream_weight_bytes(tiles) + (norm ? kTileK * 4 : 0) + m_count * kTileK * 4;
}
constexpr int stream_head_bytes(int tiles, int warps, bool norm) {  // partial sums and row squares
  return warps * tiles * 4 * 32 * 4 + (norm ? warps * 8 * 4 : 0);
}

template <int MODE, int RT, int WARPS, bool NORM, int SB>
__global__ void __launch_bounds__(WARPS * 32, 1)
    bf16_stream_rows(const GemvGroup<__nv_bfloat16> g, const float* __restrict__ x, int m_count, int stages) {
  constexpr int kTiles = stream_tiles<MODE, RT>();
  constexpr int kOutTiles = MODE == kSwiglu ? 1 : RT;
  constexpr int kWeightBytes = stream_weight_bytes(kTiles);
  constexpr int kNormBytes = NORM ? kTileK * 4 : 0;
  extern __shared__ uint4 shared_words[];
  auto* const shared = reinterpret_cast<unsigned char*>(shared_words);
  auto* const partial = reinterpret_cast<float(*)[kTiles][1][4][32]>(shared);  // [WARPS]
  auto* const row_squares = reinterpret_cast<float(*)[8]>(shared + WARPS * kTiles * 4 * 32 * 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 4, quad = lane % 4;
  const int cols = g.cols, k_blocks = cols / kTileK, task_count = g.tasks_before[g.count];
  const int block_bytes = stream_stage_bytes(kTiles, NORM, m_count);  // one k-block's weights, norm, x
  const int stage_bytes = SB * block_bytes;
  unsigned char* const ring =
      shared + stream_head_bytes(kTiles, WARPS, NORM) + static_cast<size_t>(warp) * stages * stage_bytes;
  const int my_tasks =
      static_cast<int>(blockIdx.x) < task_count ? (task_count - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int per_task = warp < k_blocks ? (k_blocks - 1 - warp) / WARPS + 1 : 0;  // the warp's k-blocks
  const int task_stages = (per_task + SB - 1) / SB;
  auto task_rows = [&](int i, int& j) {  // the matrix and first row of the block's task i
    const int t = static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
    j = 0;
    while (t >= g.tasks_before[j + 1]) ++j;
    return (t - g.tasks_before[j]) * kTileRows * kOutTiles;
  };
  // A place in the warp's sequence of stages: stage v of the block's task i (i == my_tasks: the end).
  struct Cursor {
    int i, v, j, row0;
  };
  auto start = [&](Cursor& p, int i) {
    p.i = task_stages > 0 ? i : my_tasks, p.v = 0;
    if (p.i < my_tasks) p.row0 = task_rows(p.i, p.j);
  };
  auto advance = [&](Cursor& p) {
    if (p.i < my_tasks && ++p.v == task_stages) start(p, p.i + 1);
  };
  auto issue_weights = [&](const Cursor& p, unsigned char* stage) {  // and the norm's weights
    if (p.i >= my_tasks) return;
    const int rows = g.rows[p.j];
    for (int b = 0, u = p.v * SB; b < SB && u < per_task; ++b, ++u) {
      const int k = (warp + u * WARPS) * kTileK;
      unsigned char* const block = stage + b * block_bytes;
#pragma unroll
      for (int e = 0; e < kTiles * 4; ++e) {  // 8 lanes per 128-byte row segment: coalesced
        const int idx = lane + 32 * e, t = idx / (kTileRows * 8), r = idx / 8 % kTileRows, q = idx % 8;
        const int row = min((MODE == kSwiglu ? p.row0 : p.row0 + t * kTileRows) + r, rows - 1);
        cp_async16(block + t * kTileRows * 128 + r * 128 + (q ^ (r % 8)) * 16,
                   g.w[MODE == kSwiglu ? t : p.j] + static_cast<size_t>(row) * cols + k + 8 * q);
      }
      if constexpr (NORM)
        if (lane < 16) cp_async16(block + kWeightBytes + lane * 16, g.norm_weight + k + 4 * lane);
    }
  };
  auto issue_activations = [&](const Cursor& p, unsigned char* stage) {
    if (p.i >= my_tasks) return;
    for (int b = 0, u = p.v * SB; b < SB && u < per_task; ++b, ++u) {
      const int k = (warp + u * WARPS) * kTileK;
      unsigned char* const xs = stage + b * block_bytes + kWeightBytes + kNormBytes;
      for (int idx = lane; idx < m_count * 16; idx += 32)
        cp_async16(xs + idx * 16, x + static_cast<size_t>(idx / 16) * cols + k + 4 * (idx % 16));
    }
  };
  Cursor next{};  // the next stage to request
  start(next, 0);
  for (int c = 0; c < stages; ++c, advance(next)) {  // weights only: nothing an earlier kernel writes
    issue_weights(next, ring + c * stage_bytes);
    cp_async_commit();
  }
  griddep_wait();
  griddep_launch_dependents();
  {
    Cursor p{};
    start(p, 0);
    for (int c = 0; c < stages; ++c, advance(p)) issue_activations(p, ring + c * stage_bytes);
    cp_async_commit();
  }
  int slot = 0;
  bool first = true;
  for (int i = 0; i < my_tasks; ++i) {
    int j = 0;
    const int row0 = task_rows(i, j), rows = g.rows[j];
    float acc[kTiles][4];
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;
    float squares = 0.0f;  // NORM: x^2 over the lane's values of activation row grp
    for (int v = 0; v < task_stages; ++v) {
      if (first)
        cp_async_wait<0>();  // the prologue: every stage's weights and the activations after them
      else
        cp_async_wait_pending(stages - 1);  // this stage's group and none after it
      first = false;
      __syncwarp();
      unsigned char* const stage = ring + slot * stage_bytes;
      for (int b = 0, u = v * SB; b < SB && u < per_task; ++b, ++u) {
        const unsigned char* const block = stage + b * block_bytes;
        float4 xv[4];
        const auto* const xs = reinterpret_cast<const float4*>(block + kWeightBytes + kNormBytes);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          xv[e] = grp < m_count ? xs[grp * 16 + 4 * quad + e] : make_float4(0, 0, 0, 0);
        if constexpr (NORM) {  // as bf16_tile_rows: x^2 summed, then x * weight
          const auto* const wn = reinterpret_cast<const float4*>(block + kWeightBytes);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float4 nw = wn[4 * quad + e];
            float4& val = xv[e];
            squares = fmaf(val.x, val.x, squares), squares = fmaf(val.y, val.y, squares);
            squares = fmaf(val.z, val.z, squares), squares = fmaf(val.w, val.w, squares);
            val.x *= nw.x, val.y *= nw.y, val.z *= nw.z, val.w *= nw.w;
          }
        }
        uint32_t bh[8], bl[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          split_pair(xv[e].x, xv[e].y, bh[2 * e], bl[2 * e]);
          split_pair(xv[e].z, xv[e].w, bh[2 * e + 1], bl[2 * e + 1]);
        }
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
          const unsigned char* const tile = block + t * kTileRows * 128;
          const int p0 = ((2 * quad) ^ grp) * 16, p1 = ((2 * quad + 1) ^ grp) * 16;  // rows grp and grp + 8
          const uint4 l0 = *reinterpret_cast<const uint4*>(tile + grp * 128 + p0);
          const uint4 l1 = *reinterpret_cast<const uint4*>(tile + grp * 128 + p1);
          const uint4 h0 = *reinterpret_cast<const uint4*>(tile + (grp + 8) * 128 + p0);
          const uint4 h1 = *reinterpret_cast<const uint4*>(tile + (grp + 8) * 128 + p1);
          const uint32_t lo[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
          const uint32_t hi[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            mma_bf16(acc[t], lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1], bh[2 * s], bh[2 * s + 1]);
            mma_bf16(acc[t], lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1], bl[2 * s], bl[2 * s + 1]);
          }
        }
      }
      __syncwarp();  // every lane has read the stage before it is refilled
      issue_weights(next, stage);
      issue_activations(next, stage);
      cp_async_commit();
      advance(next);
      slot = slot + 1 == stages ? 0 : slot + 1;
    }
    // The task's output, as bf16_tile_rows'.
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) partial[warp][t][0][e][lane] = acc[t][e];
    if constexpr (NORM) {
      squares += __shfl_xor_sync(0xffffffffu, squares, 1);
      squares += __shfl_xor_sync(0xffffffffu, squares, 2);
      if (quad == 0) row_squares[warp][grp] = squares;
    }
    __syncthreads();
    write_tile_outputs<MODE, kTiles, kOutTiles, 1, WARPS, NORM>(partial, row_squares, g, j, row0, rows,
                                                                m_count);
    __syncthreads();  // the partial sums are read before the next task writes them
  }
  cp_async_wait<0>();  // no copy outlives the block (the trailing groups are empty)
}

// Launches bf16_stream_rows with SB k-blocks per stage where its ring holds at least 2 stages per warp.
template <int MODE, int RT, int WARPS, bool NORM, int SB>
bool launch_bf16_stream_stages(const GemvGroup<__nv_bfloat16>& g, const float* x, int m_count,
                               cudaStream_t s) {
  constexpr int kTiles = stream_tiles<MODE, RT>();
  const int stage_bytes = SB * stream_stage_bytes(kTiles, NORM, m_count);
  const int stages = std::min(kMaxStages, kRingBytes / (WARPS * stage_bytes));
  if (stages < 2) return false;
  const size_t smem =
      stream_head_bytes(kTiles, WARPS, NORM) + static_cast<size_t>(WARPS) * stages * stage_bytes;
  static const int allowed = [] {  // once per instantiation: the largest dynamic shared memory the card has
    int device = 0, most = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
        cudaFuncSetAttribute(bf16_stream_rows<MODE, RT, WARPS, NORM, SB>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, most) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: the tile kernel runs instead
      return 0;
    }
    return most;
  }();
  if (smem > static_cast<size_t>(allowed)) return false;
  const unsigned blocks =  // persistent: one per multiprocessor (the ring takes most of its shared memory)
      static_cast<unsigned>(std::min<int64_t>(g.tasks_before[g.count], multiprocessor_count()));
  launch_pdl(bf16_stream_rows<MODE, RT, WARPS, NORM, SB>, blocks, WARPS * 32, smem, s, g, x, m_count, stages);
  return true;
}

// Launches bf16_stream_rows for m <= 8 activation rows where its ring fits: two k-blocks per stage, else
// one (the same outputs: a warp visits its k-blocks in the same order either way); false: the caller runs
// bf16_tile_rows instead (the same outputs).
template <int MODE, int RT, int WARPS, bool NORM>
bool launch_bf16_stream(const GemvGroup<__nv_bfloat16>& g, const float* x, int m_count, cudaStream_t s) {
  return launch_bf16_stream_stages<MODE, RT, WARPS, NORM, kStageBlocks>(g, x, m_count, s) ||
         launch_bf16_stream_stages<MODE, RT, WARPS, NORM, 1>(g, x, m_count, s);
}

template <int MODE>
void launch_bf16_tiles(GemvGroup<__nv_bfloat16> g, const float* x, int64_t m, cudaStream_t s) {
  // Stored products (the in_proj groups, lm_head) take two row tiles per block for up to 8 activation rows:
  // a block of one tile over a 1024-wide row is a single round trip of 32 KB, and the 0.8B shape's in_proj
  // group (514 such blocks) and lm_head (15520) paid a block's fixed costs per 32 KB. H200 (BENCHMARKS.md,
  // session 18): 0.8B decode 801 -> 884 tok/s, 9B 181.0 -> 181.7 and c(3) 1.062 -> 1.034 (argmax on the
  // device). The residual products keep one tile per block: they have few tiles already (two tiles per
  // block took 9B decode from 182.5 to 176.2 tok/s). Which rows share a block changes no row's arithmetic.
  const int row_tiles = MODE == kStore && m <= 8 ? 2 : 1;
  g.tasks_before[0] = 0;
  for (int i = 0; i < g.count; ++i)  // a task per row_tiles 16-row tiles
    g.tasks_before[i + 1] =
        g.tasks_before[i] + (g.rows[i] + row_tiles * kTileRows - 1) / (row_tiles * kTileRows);
  const auto blocks = static_cast<unsigned>(g.tasks_before[g.count]);
  const int mc = static_cast<int>(m);
  // A residual product of fewer tiles than multiprocessors with more k-blocks than 8 warps take in one pass
  // (0.8B's down: 64 tiles, 56 k-blocks) splits k over 16 warps, so each block makes one pass instead of two
  // (0.8B decode 762 -> 774 tok/s). The choice depends on the shape alone, for every row count:
  // batch-invariant.
  const bool wide = MODE == kAccumulate && static_cast<int>(blocks) < multiprocessor_count() &&
                    g.cols / kTileK > 4 * kGemvWarps;
  // k-blocks in flight per warp, measured on the 9B shape (H200, BENCHMARKS.md session 15): 4 for one tile
  // (169 against 160 tok/s with 2, 162 with 8: 255 registers), 2 for two tiles (SwiGLU's gate and up, or
  // two row tiles: the same bytes).
  // Up to 4 activation rows stream their weights (bf16_stream_rows: the same outputs). The 5- to 8-row
  // windows stay on the tile kernel: their activations take ring space, and 8 rows streamed cost 7.46 ms
  // against 6.28 on the 9B shape (H200, BENCHMARKS.md session 22; 2 rows 5.22 against 5.55, 4 rows 5.70
  // against 5.70).
  if (m <= 4 && bf16_streaming()) {
    const bool norm = g.norm_weight != nullptr;
    if constexpr (MODE == kSwiglu) {
      if (norm ? launch_bf16_stream<MODE, 1, kGemvWarps, true>(g, x, mc, s)
               : launch_bf16_stream<MODE, 1, kGemvWarps, false>(g, x, mc, s))
        return;
    } else if constexpr (MODE == kStore) {
      if (norm ? launch_bf16_stream<MODE, 2, kGemvWarps, true>(g, x, mc, s)
               : launch_bf16_stream<MODE, 2, kGemvWarps, false>(g, x, mc, s))
        return;
    } else {
      if (!norm && (wide ? launch_bf16_stream<MODE, 1, 2 * kGemvWarps, false>(g, x, mc, s)
                         : launch_bf16_stream<MODE, 1, kGemvWarps, false>(g, x, mc, s)))
        return;
    }
  }
  if (g.norm_weight != nullptr) {  // the pre-norm taken: stored products and SwiGLU (tiles_take_norm)
    if constexpr (MODE == kAccumulate) {
      fail(ErrorKind::kInternal, "bf16 tiles: a norm in a residual product");
    } else if constexpr (MODE == kSwiglu) {
      if (m <= 8)
        return launch_pdl(bf16_tile_rows<1, MODE, 2, 1, kGemvWarps, true>, blocks, kGemvWarps * 32, 0, s, g,
                          x, mc);
      return launch_pdl(bf16_tile_rows<2, MODE, 2, 1, kGemvWarps, true>, blocks, kGemvWarps * 32, 0, s, g, x,
                        mc);
    } else {
      if (row_tiles == 2)
        return launch_pdl(bf16_tile_rows<1, MODE, 2, 2, kGemvWarps, true>, blocks, kGemvWarps * 32, 0, s, g,
                          x, mc);
      return launch_pdl(bf16_tile_rows<2, MODE, 2, 1, kGemvWarps, true>, blocks, kGemvWarps * 32, 0, s, g, x,
                        mc);
    }
  }
  if (m <= 8) {
    if constexpr (MODE == kSwiglu) {
      return launch_pdl(bf16_tile_rows<1, MODE, 2>, blocks, kGemvWarps * 32, 0, s, g, x, mc);
    } else {
      if (row_tiles == 2)
        return launch_pdl(bf16_tile_rows<1, MODE, 2, 2>, blocks, kGemvWarps * 32, 0, s, g, x, mc);
      if (wide)
        return launch_pdl(bf16_tile_rows<1, MODE, 4, 1, 2 * kGemvWarps>, blocks, 2 * kGemvWarps * 32, 0, s, g,
                          x, mc);
      return launch_pdl(bf16_tile_rows<1, MODE, 4>, blocks, kGemvWarps * 32, 0, s, g, x, mc);
    }
  }
  if (wide)
    return launch_pdl(bf16_tile_rows<2, MODE, 2, 1, 2 * kGemvWarps>, blocks, 2 * kGemvWarps * 32, 0, s, g, x,
                      mc);
  return launch_pdl(bf16_tile_rows<2, MODE, 2>, blocks, kGemvWarps * 32, 0, s, g, x, mc);
}

// Any shape (cols not a multiple of 8, unaligned data): one weight row per warp, lane l reduces
// k = l, l + 32, ...  (same mapping for every M: batch-invariant too).
template <typename W, int MODE>
__global__ void gemv_rows_scalar(const GemvGroup<W> g, const float* __restrict__ x, int m_count) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  const int warp = blockIdx.x * kGemvWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= g.tasks_before[g.count]) return;
  int j = 0;
  while (warp >= g.tasks_before[j + 1]) ++j;
  const int r = warp - g.tasks_before[j];
  const int cols = g.cols, rows = g.rows[j];
  for (int m = 0; m < m_count; ++m) {
    const float* xm = x + static_cast<size_t>(m) * cols;
    float s0 = 0.0f, s1 = 0.0f;
    const W* w0 = g.w[MODE == kSwiglu ? 0 : j] + static_cast<size_t>(r) * cols;
    for (int k = lane; k < cols; k += 32) s0 = fmaf(to_float(w0[k]), xm[k], s0);
    s0 = warp_sum(s0);
    if constexpr (MODE == kSwiglu) {
      const W* w1 = g.w[1] + static_cast<size_t>(r) * cols;
      for (int k = lane; k < cols; k += 32) s1 = fmaf(to_float(w1[k]), xm[k], s1);
      s1 = warp_sum(s1);
    }
    if (lane != 0) continue;
    float* out = g.y[j] + static_cast<size_t>(m) * rows + r;
    if constexpr (MODE == kSwiglu)
      *out = silu(s0) * s1;
    else if constexpr (MODE == kAccumulate)
      *out += s0;
    else
      *out = s0;
  }
}

// Whether bf16 products of `cols` columns, these weights (their first `count`) and x of m rows run on
// bf16_tile_rows: what launch_gemv decides by, and tiles_take_norm too (a norm goes only into that kernel).
bool bf16_tiles_run(int64_t cols, const float* x, int64_t m, const void* const* weights, int count) {
  bool run =
      bf16_tensor_rows() && m <= 2 * 8 && cols % kTileK == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int i = 0; i < count; ++i) run &= reinterpret_cast<uintptr_t>(weights[i]) % 16 == 0;
  return run;
}

template <typename W, int MODE>
void launch_gemv(GemvGroup<W> g, const float* x, int64_t m, cudaStream_t s) {
  bool aligned = g.cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (int i = 0; i < (MODE == kSwiglu ? 2 : g.count); ++i)
    aligned &= reinterpret_cast<uintptr_t>(g.w[i]) % 16 == 0;
  int total_rows = 0;
  for (int i = 0; i < g.count; ++i) total_rows += g.rows[i];
  g.prefetch_bytes = prefetch_bytes_per_row(MODE == kSwiglu ? 2 * total_rows : total_rows,
                                            static_cast<int64_t>(g.cols) * sizeof(W));
  if constexpr (std::is_same_v<W, __nv_bfloat16>) {
    const void* weights[kMaxGroup];
    for (int i = 0; i < kMaxGroup; ++i) weights[i] = g.w[i];
    if (bf16_tiles_run(g.cols, x, m, weights, MODE == kSwiglu ? 2 : g.count))
      return launch_bf16_tiles<MODE>(g, x, m, s);
  }
  if (g.norm_weight != nullptr) fail(ErrorKind::kInternal, "gemv: a norm outside the bf16 tile kernel");
  // Enough warps to keep every SM streaming: 2 rows per warp below 8192 rows (which rows share a warp
  // changes no row's arithmetic, so this choice keeps batch invariance).
  const bool narrow = MODE != kSwiglu && total_rows < 8192 && std::is_same_v<W, __nv_bfloat16>;
  const int rows_per_warp = narrow ? 2 : kGemvRows;
  const int per_warp = !aligned ? 1 : MODE == kSwiglu ? rows_per_warp / 2 : rows_per_warp;
  g.tasks_before[0] = 0;
  for (int i = 0; i < g.count; ++i)
    g.tasks_before[i + 1] = g.tasks_before[i] + (g.rows[i] + per_warp - 1) / per_warp;
  const unsigned blocks = blocks_for(g.tasks_before[g.count], kGemvWarps);
  if (!aligned) {
    gemv_rows_scalar<W, MODE><<<blocks, kGemvWarps * 32, 0, s>>>(g, x, static_cast<int>(m));
    return;
  }
  switch (m) {
#define MTPX_GEMV_CASE(M)                                                                           \
  case M:                                                                                           \
    if constexpr (MODE != kSwiglu && std::is_same_v<W, __nv_bfloat16>)                              \
      if (narrow) return launch_pdl(gemv_rows<W, M, MODE, 2>, blocks, kGemvWarps * 32, 0, s, g, x); \
    return launch_pdl(gemv_rows<W, M, MODE, kGemvRows>, blocks, kGemvWarps * 32, 0, s, g, x);
    MTPX_GEMV_CASE(1)
    MTPX_GEMV_CASE(2)
    MTPX_GEMV_CASE(3)
    MTPX_GEMV_CASE(4)
    MTPX_GEMV_CASE(5)
    MTPX_GEMV_CASE(6)
    MTPX_GEMV_CASE(7)
    MTPX_GEMV_CASE(8)
    MTPX_GEMV_CASE(9)
    MTPX_GEMV_CASE(10)
    MTPX_GEMV_CASE(11)
    MTPX_GEMV_CASE(12)
    MTPX_GEMV_CASE(13)
    MTPX_GEMV_CASE(14)
    MTPX_GEMV_CASE(15)
#undef MTPX_GEMV_CASE
    default:
      fail(ErrorKind::kInternal, "gemv: {} rows", m);
  }
}

// x = hi + lo (+ a remainder below the 16-bit type's precision squared).
template <typename T>
__global__ void split_to(const float* __restrict__ x, T* __restrict__ hi, T* __restrict__ lo, int64_t n) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, __half>) {
      const __half h = __float2half_rn(x[i]);
      hi[i] = h, lo[i] = __float2half_rn(x[i] - __half2float(h));
    } else {
      const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
      hi[i] = h, lo[i] = __float2bfloat16_rn(x[i] - __bfloat162float(h));
    }
  }
}

void check_cublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    fail(ErrorKind::kInternal, "cuBLAS {} failed (status {})", what, static_cast<int>(st));
}

template <int MODE>
void row_kernels(const Matrix* ws, int count, const float* x, int64_t m, float* const* ys, cudaStream_t s,
                 RowNorm norm = {}) {
  if (ws[0].type == Dtype::kAffine) return affine::rows(MODE, ws, count, x, m, ys, s);
  auto fill = [&](auto* typed_null) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(typed_null)>>;
    GemvGroup<W> g{};
    g.norm_weight = norm.weight;
    g.norm_eps = norm.eps;
    g.count = MODE == kSwiglu ? 1 : count;
    g.cols = static_cast<int>(ws[0].cols);
    for (int i = 0; i < count; ++i) {
      g.w[i] = static_cast<const W*>(ws[i].data);
      g.rows[i] = static_cast<int>(ws[i].rows);
      g.y[i] = MODE == kSwiglu && i > 0 ? nullptr : ys[i];
    }
    launch_gemv<W, MODE>(g, x, m, s);
  };
  switch (ws[0].type) {
    case Dtype::kBF16:
      fill(static_cast<const __nv_bfloat16*>(nullptr));
      break;
    case Dtype::kF16:
      fill(static_cast<const __half*>(nullptr));
      break;
    case Dtype::kF32:
      fill(static_cast<const float*>(nullptr));
      break;
    case Dtype::kAffine:
      break;
  }
  check_launch("gemv");
}

// y (+)= x W^T through cuBLAS, row-major y[m, rows] = column-major y^T = W x^T with W^T stored [cols, rows].
// bf16/f16 weights: x is split as x_hi + x_lo, both in the weight's dtype (two products, f32 accumulation),
// so the prompt keeps ~16 bits of its float32 activations instead of bf16's 8. Affine weights: blocks of
// rows are dequantized to bf16 (Workspace::dequant) and multiplied as bf16 weights. x_split: the halves of
// this x are already in the scratch (the previous product took the same x in the same 16-bit type).
void gemm(const Matrix& w, const float* x, int64_t m, float* y, bool accumulate, const Workspace& ws,
          bool x_split = false) {
  const cudaStream_t s = as_stream(ws.stream);
  const auto h = static_cast<cublasHandle_t>(ws.cublas);
  const int rows = static_cast<int>(w.rows), cols = static_cast<int>(w.cols), n = static_cast<int>(m);
  const float alpha = 1.0f, beta0 = accumulate ? 1.0f : 0.0f, beta1 = 1.0f;
  if (w.type == Dtype::kF32) {
    check_cublas(cublas_api().sgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &alpha,
                                    static_cast<const float*>(w.data), cols, x, cols, &beta0, y, rows),
                 "sgemm");
    return;
  }
  const bool half = w.type == Dtype::kF16;
  const cudaDataType_t type = half ? CUDA_R_16F : CUDA_R_16BF;
  const int64_t count = m * cols;
  void* hi = ws.scratch;
  void* lo = static_cast<char*>(ws.scratch) + count * 2;
  if (!x_split) {
    if (half)
      split_to<<<elementwise_blocks(count), 256, 0, s>>>(x, static_cast<__half*>(hi),
                                                         static_cast<__half*>(lo), count);
    else
      split_to<<<elementwise_blocks(count), 256, 0, s>>>(x, static_cast<__nv_bfloat16*>(hi),
                                                         static_cast<__nv_bfloat16*>(lo), count);
    check_launch("split_to");
  }
  // Rows [r0, r0 + nr) of y from weights `wd` holding those rows.
  auto product = [&](const void* wd, int r0, int nr) {
    check_cublas(
        cublas_api().gemm_ex(h, CUBLAS_OP_T, CUBLAS_OP_N, nr, n, cols, &alpha, wd, type, cols, hi, type, cols,
                             &beta0, y + r0, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "gemm");
    check_cublas(
        cublas_api().gemm_ex(h, CUBLAS_OP_T, CUBLAS_OP_N, nr, n, cols, &alpha, wd, type, cols, lo, type, cols,
                             &beta1, y + r0, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "gemm");
  };
  if (w.type != Dtype::kAffine) return product(w.data, 0, rows);
  if (ws.dequant == nullptr) fail(ErrorKind::kInternal, "gemm: no dequantization buffer");
  const int block = static_cast<int>(std::max<int64_t>(1, kDequantBytes / (2 * w.cols)));
  for (int r0 = 0; r0 < rows; r0 += block) {
    const int nr = std::min(block, rows - r0);
    affine::dequantize_bf16(w, r0, nr, ws.dequant, ws.stream);
    product(ws.dequant, r0, nr);
  }
}

}  // namespace

const char* affine_unsupported(int bits, int64_t group_size, int64_t cols) {
  if (bits < 2 || bits > 8 || bits == 7) return "bits must be 2, 3, 4, 5, 6 or 8";
  if (group_size != 32 && group_size != 64 && group_size != 128) return "group_size must be 32, 64 or 128";
  if (cols % group_size != 0) return "cols must be a multiple of group_size";
  return "";
}

void matmul(const Matrix& w, const float* x, int64_t m, float* y, bool accumulate, const Workspace& ws) {
  if (m <= 0) return;
  const cudaStream_t s = as_stream(ws.stream);
  if (m >= kGemmMinRows) return gemm(w, x, m, y, accumulate, ws);
  float* const ys[1] = {y};
  if (accumulate)
    row_kernels<kAccumulate>(&w, 1, x, m, ys, s);
  else
    row_kernels<kStore>(&w, 1, x, m, ys, s);
}

// Whether the row kernels of these products of m rows take their input's RMSNorm: bf16 weights of one
// width on bf16_tile_rows.
bool tiles_take_norm(const Matrix* w, int count, const float* x, int64_t m) {
  if (count < 1 || count > kMaxGroup || !fused_row_norms() || m < 1 || m >= kGemmMinRows) return false;
  const void* weights[kMaxGroup];
  for (int i = 0; i < count; ++i) {
    if (w[i].type != Dtype::kBF16 || w[i].cols != w[0].cols) return false;
    weights[i] = w[i].data;
  }
  return bf16_tiles_run(w[0].cols, x, m, weights, count);
}

// x normalized into `normed` where the products cannot take the norm (then x is `normed`).
const float* apply_norm_unless_taken(const Matrix* w, int count, const float* x, int64_t m, RowNorm& norm,
                                     float* normed, void* stream) {
  if (norm.weight == nullptr || tiles_take_norm(w, count, x, m)) return x;
  if (normed == nullptr) fail(ErrorKind::kInternal, "matmul with a norm: no scratch for the normalized rows");
  rms_norm_rows(x, w[0].cols, norm.weight, norm.eps, m, w[0].cols, normed, w[0].cols, stream);
  norm = {};
  return normed;
}

void matmul_group(const Matrix* w, float* const* y, int count, const float* x, int64_t m, const Workspace& ws,
                  RowNorm norm, float* normed) {
  if (count < 1 || count > kMaxGroup) fail(ErrorKind::kInternal, "matmul_group: {} matrices", count);
  x = apply_norm_unless_taken(w, count, x, m, norm, normed, ws.stream);
  bool same = true;
  for (int i = 0; i < count; ++i)
    same &= w[i].type == w[0].type && w[i].cols == w[0].cols && w[i].bits == w[0].bits &&
            w[i].group_size == w[0].group_size && w[i].scale_type == w[0].scale_type;
  if (m >= kGemmMinRows) {  // x is split once for all of them where they take the same type
    for (int i = 0; i < count; ++i) gemm(w[i], x, m, y[i], false, ws, /*x_split=*/i > 0 && same);
    return;
  }
  if (!same) {
    for (int i = 0; i < count; ++i) matmul(w[i], x, m, y[i], false, ws);
    return;
  }
  if (m > 0) row_kernels<kStore>(w, count, x, m, y, as_stream(ws.stream), norm);
}

void matmul_swiglu(const Matrix& gate, const Matrix& up, const float* x, int64_t m, float* out,
                   float* up_scratch, const Workspace& ws, RowNorm norm, float* normed) {
  if (m <= 0) return;
  const Matrix both[2] = {gate, up};
  const bool one_launch = m < kGemmMinRows && gate.type == up.type && gate.rows == up.rows &&
                          gate.cols == up.cols && gate.bits == up.bits && gate.group_size == up.group_size &&
                          gate.scale_type == up.scale_type;
  // The norm goes into the product only where one launch computes both.
  x = apply_norm_unless_taken(both, one_launch ? 2 : 0, x, m, norm, normed, ws.stream);
  if (!one_launch) {
    matmul(gate, x, m, out, false, ws);
    if (m >= kGemmMinRows)  // x as split for gate where up takes the same type
      gemm(up, x, m, up_scratch, false, ws, /*x_split=*/gate.type == up.type && gate.cols == up.cols);
    else
      matmul(up, x, m, up_scratch, false, ws);
    swiglu(out, up_scratch, m * gate.rows, out, ws.stream);
    return;
  }
  float* const ys[1] = {out};
  row_kernels<kSwiglu>(both, 2, x, m, ys, as_stream(ws.stream), norm);
}

}  // namespace mtpx::cuda
