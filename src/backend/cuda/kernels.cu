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

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// Sum over the block in a fixed order (per warp, then the warps in index order). Every thread gets it.
template <typename T>
__device__ T block_sum(T v, T* scratch /* [32] shared */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// Eight consecutive weights (16- or 32-byte aligned) widened to float32.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float out[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);  // bf16 is the high half of a float32
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load8(const __half* p, float out[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x, out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float out[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)),
               b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z,
  out[7] = b.w;
}

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

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// (a, b) as a bf16 pair rounded to nearest (a in the low half: the lower k), and the remainders likewise.
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const __nv_bfloat162 l = __floats2bfloat162_rn(a - __low2float(h), b - __high2float(h));
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

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

// Lets `kernel` take `bytes` of dynamic shared memory: above 48 KiB a launch must ask for it (a host-side
// attribute, set before every launch rather than kept as process state: cheap next to a prefill kernel).
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes, const char* what) {
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      e != cudaSuccess)
    fail(ErrorKind::kInternal, "CUDA: {} shared memory: {}", what, cudaGetErrorString(e));
}

void check_cublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    fail(ErrorKind::kInternal, "cuBLAS {} failed (status {})", what, static_cast<int>(st));
}

// ---- small row-wise kernels

template <typename W>
__global__ void embed_kernel(const W* __restrict__ table, const int32_t* __restrict__ tokens, int64_t h,
                             float* __restrict__ out) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  const int64_t t = blockIdx.x;
  const W* row = table + static_cast<int64_t>(tokens[t]) * h;
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) out[t * h + i] = to_float(row[i]);
}

__global__ void rms_norm_kernel(const float* __restrict__ x, int64_t x_stride, const float* __restrict__ w,
                                float eps, int64_t n, float* out, int64_t out_stride) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  __shared__ float scratch[32];
  const float* xr = x + blockIdx.x * x_stride;
  float* o = out + blockIdx.x * out_stride;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = block_sum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) o[i] = (xr[i] * scale) * w[i];
}

// The same with the row in registers: each thread loads its V float4 of x and of the weight at once, so
// the row costs one memory round trip, not two (x again and w after the reduction). Measured on the H200
// (BENCHMARKS.md, session 15): 0.8B decode 660 against 623 tok/s, 9B 172 against 170.
template <int V>
__global__ void rms_norm_regs_kernel(const float* __restrict__ x, int64_t x_stride,
                                     const float* __restrict__ w, float eps, int n, float* out,
                                     int64_t out_stride) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  __shared__ float scratch[32];
  const float4* xr = reinterpret_cast<const float4*>(x + blockIdx.x * x_stride);
  const float4* wr = reinterpret_cast<const float4*>(w);
  float4* o = reinterpret_cast<float4*>(out + blockIdx.x * out_stride);
  const int n4 = n / 4;
  float4 xv[V], wv[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int i = threadIdx.x + v * blockDim.x;
    xv[v] = i < n4 ? xr[i] : make_float4(0, 0, 0, 0);
    wv[v] = i < n4 ? wr[i] : make_float4(0, 0, 0, 0);
  }
  float ss = 0.0f;
#pragma unroll
  for (int v = 0; v < V; ++v)
    ss = fmaf(xv[v].x, xv[v].x, ss), ss = fmaf(xv[v].y, xv[v].y, ss), ss = fmaf(xv[v].z, xv[v].z, ss),
    ss = fmaf(xv[v].w, xv[v].w, ss);
  ss = block_sum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int i = threadIdx.x + v * blockDim.x;
    if (i < n4)
      o[i] = make_float4((xv[v].x * scale) * wv[v].x, (xv[v].y * scale) * wv[v].y,
                         (xv[v].z * scale) * wv[v].z, (xv[v].w * scale) * wv[v].w);
  }
}

__global__ void add_kernel(float* __restrict__ x, const float* __restrict__ y, int64_t n) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

__global__ void swiglu_kernel(const float* gate, const float* __restrict__ up, int64_t n, float* out) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = silu(gate[i]) * up[i];
}

unsigned elementwise_blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<unsigned>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

// ---- attention

// blockIdx = (t, head over nq + nkv); dynamic shared memory: D floats.
__global__ void qk_norm_rope_kernel(float* qg, float* k, const float* __restrict__ v,
                                    const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                    float eps, int64_t nq, int64_t nkv, int64_t d, int64_t rotary_dim,
                                    double theta, const int32_t* __restrict__ pos, float* key_cache,
                                    float* value_cache) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  extern __shared__ float buf[];
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, head = blockIdx.y;
  const int64_t p = pos[0] + t;
  const bool is_q = head < nq;
  const int64_t hk = head - nq;
  float* src = is_q ? qg + (t * nq + head) * 2 * d : k + (t * nkv + hk) * d;
  const float* w = is_q ? q_norm : k_norm;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) ss = fmaf(src[i], src[i], ss);
  ss = block_sum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) buf[i] = (src[i] * scale) * w[i];
  __syncthreads();
  // Partial RoPE on the first rotary_dim channels, pairs (i, i + half); as transformers computes it:
  // inv_freq and the angle in float32, cos/sin of the float32 angle.
  const int64_t half = rotary_dim / 2;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float r = buf[i];
    if (i < rotary_dim) {
      const int64_t j = i < half ? i : i - half;
      const float inv_freq =
          static_cast<float>(1.0 / pow(theta, static_cast<double>(2 * j) / static_cast<double>(rotary_dim)));
      const float angle = static_cast<float>(p) * inv_freq;
      const float c = static_cast<float>(cos(static_cast<double>(angle)));
      const float s = static_cast<float>(sin(static_cast<double>(angle)));
      r = i < half ? buf[i] * c - buf[i + half] * s : buf[i] * c + buf[i - half] * s;
    }
    src[i] = r;
    if (!is_q) {
      key_cache[(p * nkv + hk) * d + i] = r;
      value_cache[(p * nkv + hk) * d + i] = v[(t * nkv + hk) * d + i];
    }
  }
}

// Decode and verify rows, split over the keys ("flash decoding"). The kernel this replaces walked a row's
// keys in four warps, one key after another: a memory round trip per key and warp. H200 (BENCHMARKS.md,
// session 17), decode tok/s against it: 9B at 4096 tokens of context 73 -> 172, at 32768 14 -> 152; 0.8B at
// 32768 20 -> 561; the 9B verify window of 4 rows (argmax on the device) 1.10 -> 1.05 decode steps. Here
// blockIdx = (t, tile of GT query heads sharing a key-value head, split s): the row's n keys are cut into
// splits of split_keys(n, splits) keys, and each warp of a split's block loads kSplitKeysPerWarp keys (and
// their values) at once and keeps an online softmax per head. The block merges its warps in warp order; a row
// with one split writes o directly, else each split writes (m, l, acc) and the split that finishes last (a
// counter per row and tile, left at zero again) merges them in split order. Batch-invariant: the splits, the
// warps' keys and both merge orders depend only on the row's own key count n and the launch's `splits`, which
// the launcher derives from the head counts and the device, never from the number of rows.
constexpr int kSplitWarps = 8;
constexpr int kSplitKeysPerWarp = 4;
constexpr int kMinSplitKeys = 64;
constexpr int kMaxSplits = 64;

__host__ __device__ constexpr int split_keys(int n, int splits) {
  const int per = (n + splits - 1) / splits;
  const int keys = (per + 31) / 32 * 32;
  return keys > kMinSplitKeys ? keys : kMinSplitKeys;
}

template <int EPL>
__device__ __forceinline__ void load_lane_row(const float* p, float (&out)[EPL]) {
  if constexpr (EPL % 4 == 0) {
#pragma unroll
    for (int e = 0; e < EPL; e += 4) {
      const float4 v = *reinterpret_cast<const float4*>(p + e);
      out[e] = v.x, out[e + 1] = v.y, out[e + 2] = v.z, out[e + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < EPL; ++e) out[e] = p[e];
  }
}

template <int EPL, int GT>  // head_dim = 32 * EPL; GT query heads per block
__global__ void __launch_bounds__(kSplitWarps * 32)
    attention_split_kernel(const float* __restrict__ qg, const float* __restrict__ key_cache,
                           const float* __restrict__ value_cache, int nq, int nkv, int splits,
                           const int32_t* __restrict__ pos, float* __restrict__ o, int32_t* counters,
                           float2* partial_ml, float* partial_acc) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  constexpr int D = 32 * EPL, U = kSplitKeysPerWarp;
  __shared__ float warp_m[kSplitWarps][GT], warp_l[kSplitWarps][GT];
  __shared__ __align__(16) float warp_acc[kSplitWarps][GT][D];
  __shared__ float split_weight[GT][kMaxSplits], inverse_l[GT];
  __shared__ bool last;
  const int t = blockIdx.x, split = blockIdx.z, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = nq / nkv, tiles = group / GT;
  const int hk = blockIdx.y / tiles, h0 = hk * group + (blockIdx.y % tiles) * GT;
  const int n = pos[0] + t + 1, chunk = split_keys(n, splits), active = (n + chunk - 1) / chunk;
  if (split >= active) return;
  const int k0 = split * chunk, k1 = min(n, k0 + chunk);
  const float scale = 1.0f / sqrtf(static_cast<float>(D));
  float qv[GT][EPL], acc[GT][EPL], m[GT], l[GT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    load_lane_row<EPL>(qg + (static_cast<size_t>(t) * nq + h0 + g) * 2 * D + lane * EPL, qv[g]);
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.0f;
  }
  // Keys j0 .. j0 + U - 1 per pass (j0 < k1, so the first is always a key and m stays finite).
  for (int j0 = k0 + warp * U; j0 < k1; j0 += kSplitWarps * U) {
    float kr[U][EPL], vr[U][EPL];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t row = (static_cast<size_t>(min(j0 + u, k1 - 1)) * nkv + hk) * D + lane * EPL;
      load_lane_row<EPL>(key_cache + row, kr[u]);
      load_lane_row<EPL>(value_cache + row, vr[u]);
    }
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float score[U];
      float top = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) dot = fmaf(qv[g][e], kr[u][e], dot);
        score[u] = j0 + u < k1 ? warp_sum(dot) * scale : -INFINITY;
        top = fmaxf(top, score[u]);
      }
      const float corr = expf(m[g] - top);
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = expf(score[u] - top);
        l[g] += p;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(p, vr[u][e], acc[g][e]);
      }
      m[g] = top;
    }
  }
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    if (lane == 0) warp_m[warp][g] = m[g], warp_l[warp][g] = l[g];
#pragma unroll
    for (int e = 0; e < EPL; ++e) warp_acc[warp][g][lane * EPL + e] = acc[g][e];
  }
  __syncthreads();
  // The block's (m, l, acc) per head: warps in order (a warp without keys has m = -inf and weighs 0).
  const size_t row_split = (static_cast<size_t>(t) * nq + h0) * kMaxSplits + split;
  for (int i = threadIdx.x; i < GT * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float top = -INFINITY;
    for (int w = 0; w < kSplitWarps; ++w) top = fmaxf(top, warp_m[w][g]);
    float sum_l = 0.0f, sum_acc = 0.0f;
    for (int w = 0; w < kSplitWarps; ++w) {
      const float weight = expf(warp_m[w][g] - top);
      sum_l = fmaf(warp_l[w][g], weight, sum_l);
      sum_acc = fmaf(warp_acc[w][g][d], weight, sum_acc);
    }
    const size_t head = static_cast<size_t>(t) * nq + h0 + g;
    if (active == 1) {
      o[head * D + d] = sum_acc / sum_l * sigmoid(qg[head * 2 * D + D + d]);
    } else {
      partial_acc[(row_split + static_cast<size_t>(g) * kMaxSplits) * D + d] = sum_acc;
      if (d == 0) partial_ml[row_split + static_cast<size_t>(g) * kMaxSplits] = make_float2(top, sum_l);
    }
  }
  if (active == 1) return;
  // The last split of this row and tile to finish merges them all (CUDA programming guide, "Memory Fence
  // Functions": the fence orders this block's partials before its count).
  __threadfence();
  __syncthreads();
  int32_t* counter = counters + static_cast<size_t>(t) * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == active - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (warp < GT) {  // warp g: each split's weight e^(m_s - M) and 1 / sum_s l_s e^(m_s - M) for head g
    const size_t base = row_split - split + static_cast<size_t>(warp) * kMaxSplits;
    float ms[kMaxSplits / 32], ls[kMaxSplits / 32], top = -INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      const int sp = lane + 32 * i;
      const float2 ml = sp < active ? __ldcg(partial_ml + base + sp) : make_float2(-INFINITY, 0.0f);
      ms[i] = ml.x, ls[i] = ml.y, top = fmaxf(top, ml.x);
    }
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    float sum_l = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      const int sp = lane + 32 * i;
      const float weight = sp < active ? expf(ms[i] - top) : 0.0f;
      if (sp < active) split_weight[warp][sp] = weight;
      sum_l = fmaf(ls[i], weight, sum_l);
    }
    sum_l = warp_sum(sum_l);
    if (lane == 0) inverse_l[warp] = 1.0f / sum_l;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < GT * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    const float* part = partial_acc + (row_split - split + static_cast<size_t>(g) * kMaxSplits) * D + d;
    float sum_acc = 0.0f;
    for (int sp = 0; sp < active; ++sp)
      sum_acc = fmaf(__ldcg(part + static_cast<size_t>(sp) * D), split_weight[g][sp], sum_acc);
    const size_t head = static_cast<size_t>(t) * nq + h0 + g;
    o[head * D + d] = sum_acc * inverse_l[g] * sigmoid(qg[head * 2 * D + D + d]);
  }
  if (threadIdx.x == 0) *counter = 0;
}

// Prompt prefill on tensor cores: blockIdx = (tile of kFlashWarps * tpw tokens, key-value head). Warp w takes
// 16 query rows, row r = query head hk * group + r % group of token t0 + w * tpw + r / group (tpw = 16 /
// group tokens), so all rows of the block share the keys, which go through shared memory 32 at a time. Per
// tile S = Q K^T and O += P V run as mma.sync.m16n8k16 (bf16 operands, float32 accumulation) with each
// float operand split into bf16 hi + lo and three products (hi hi + hi lo + lo hi: about 16 bits of each
// operand, as the prompt's matrix products keep of the activations), with an online softmax in float32
// between them. S's accumulator fragments are P's operand fragments (keys 16 s .. 16 s + 15 of a row are
// n-tiles 2 s and 2 s + 1), so P never leaves the registers. K rows and V (transposed, key pairs along a
// row) are stored as bf16 pairs with row strides that put a warp's fragment loads in distinct banks.
// H200 (BENCHMARKS.md, session 16): 9B prefill of 2048 tokens 13070 -> 15542 tok/s against the float32
// kernel it replaces (one lane per key, dot products out of shared memory: 4.3 ms per layer).
constexpr int kFlashWarps = 8;
constexpr int kFlashKeys = 32;

constexpr int64_t flash_smem_words(int64_t d) {
  const int64_t qw = d / 2 + 8, vw = kFlashKeys / 2 + 4;
  return 2 * (kFlashWarps * 16 * qw + kFlashKeys * qw + d * vw);
}

template <int D>
__global__ void __launch_bounds__(kFlashWarps * 32)
    attention_prefill_kernel(const float* __restrict__ qg, const float* __restrict__ key_cache,
                             const float* __restrict__ value_cache, int64_t t_count, int64_t nq, int64_t nkv,
                             int tpw, const int32_t* __restrict__ pos, float* __restrict__ o) {
  griddep_wait();
  griddep_launch_dependents();            // a row kernel after this one may start its prefetch
  constexpr int QW = D / 2 + 8;           // words per Q or K row: a half-warp's 64-bit loads of rows g, at
                                          // word g * QW + 2 q, hit 32 distinct banks (QW = 8 or 24 mod 32)
  constexpr int VW = kFlashKeys / 2 + 4;  // words per V^T row: rows g at word g * VW + q, distinct banks
  constexpr int KSTEPS = D / 16, DT = D / 8, NT = kFlashKeys / 8;
  extern __shared__ uint32_t words[];
  uint32_t* const q_hi = words;  // [warps][16][QW]
  uint32_t* const q_lo = q_hi + kFlashWarps * 16 * QW;
  uint32_t* const k_hi = q_lo + kFlashWarps * 16 * QW;  // [keys][QW]
  uint32_t* const k_lo = k_hi + kFlashKeys * QW;
  uint32_t* const v_hi = k_lo + kFlashKeys * QW;  // [D][VW]: word kp of row d holds keys 2 kp, 2 kp + 1
  uint32_t* const v_lo = v_hi + D * VW;
  const int group = static_cast<int>(nq / nkv);
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int g = lane / 4, q = lane % 4;
  const int64_t hk = blockIdx.y, p0 = pos[0];
  const int64_t block_t0 = static_cast<int64_t>(blockIdx.x) * kFlashWarps * tpw, t0 = block_t0 + warp * tpw;
  auto row_valid = [&](int r) { return r < group * tpw && t0 + r / group < t_count; };
  auto row_keys = [&](int r) { return row_valid(r) ? p0 + t0 + r / group + 1 : int64_t{0}; };
  auto row_offset = [&](int r) { return ((t0 + r / group) * nq + hk * group + r % group) * D; };  // in o
  const int64_t block_keys =
      p0 + (block_t0 + kFlashWarps * tpw < t_count ? block_t0 + kFlashWarps * tpw : t_count);
  const int64_t warp_keys = t0 < t_count ? p0 + (t0 + tpw < t_count ? t0 + tpw : t_count) : 0;
  uint32_t* const qh = q_hi + warp * 16 * QW;
  uint32_t* const ql = q_lo + warp * 16 * QW;
  for (int idx = lane; idx < 16 * (D / 2); idx += 32) {
    const int r = idx / (D / 2), w = idx % (D / 2);
    float a = 0.0f, b = 0.0f;
    if (row_valid(r)) {
      const float* src = qg + 2 * row_offset(r) + 2 * w;  // qg rows are [query | gate], 2 D floats
      a = src[0], b = src[1];
    }
    split_pair(a, b, qh[r * QW + w], ql[r * QW + w]);
  }
  const int64_t keys_lo = row_keys(g), keys_hi = row_keys(g + 8);  // rows g and g + 8 of the fragments
  const float scale = 1.0f / sqrtf(static_cast<float>(D));
  float acc[DT][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // l: this lane's columns only
  for (int64_t kt = 0; kt < block_keys; kt += kFlashKeys) {
    __syncthreads();  // the previous tile is consumed
#pragma unroll 4
    for (int idx = static_cast<int>(threadIdx.x); idx < kFlashKeys * (D / 2); idx += kFlashWarps * 32) {
      const int r = idx / (D / 2), w = idx % (D / 2);
      const int64_t j = kt + r;
      float a = 0.0f, b = 0.0f;
      if (j < block_keys) {
        const float2 v = *reinterpret_cast<const float2*>(key_cache + (j * nkv + hk) * D + 2 * w);
        a = v.x, b = v.y;
      }
      split_pair(a, b, k_hi[r * QW + w], k_lo[r * QW + w]);
    }
#pragma unroll 4
    for (int idx = static_cast<int>(threadIdx.x); idx < (kFlashKeys / 2) * D; idx += kFlashWarps * 32) {
      const int kp = idx / D, d = idx % D;
      const int64_t j = kt + 2 * kp;
      const float a = j < block_keys ? value_cache[(j * nkv + hk) * D + d] : 0.0f;
      const float b = j + 1 < block_keys ? value_cache[((j + 1) * nkv + hk) * D + d] : 0.0f;
      split_pair(a, b, v_hi[d * VW + kp], v_lo[d * VW + kp]);
    }
    __syncthreads();
    if (kt >= warp_keys) continue;  // past every row of this warp (warp-uniform)
    // S = Q K^T. A lane's k-slots (2q, 2q + 1) and (2q + 8, 2q + 9) of step s are dims 16 s + 4 q .. + 3 for
    // both operands: a dot product may take k in any order as long as A and B agree.
    float s[NT][4] = {};
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const uint2 a_hi0 = *reinterpret_cast<const uint2*>(&qh[g * QW + 8 * ks + 2 * q]);
      const uint2 a_hi1 = *reinterpret_cast<const uint2*>(&qh[(g + 8) * QW + 8 * ks + 2 * q]);
      const uint2 a_lo0 = *reinterpret_cast<const uint2*>(&ql[g * QW + 8 * ks + 2 * q]);
      const uint2 a_lo1 = *reinterpret_cast<const uint2*>(&ql[(g + 8) * QW + 8 * ks + 2 * q]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint2 b_hi = *reinterpret_cast<const uint2*>(&k_hi[(8 * nt + g) * QW + 8 * ks + 2 * q]);
        const uint2 b_lo = *reinterpret_cast<const uint2*>(&k_lo[(8 * nt + g) * QW + 8 * ks + 2 * q]);
        mma_bf16(s[nt], a_hi0.x, a_hi1.x, a_hi0.y, a_hi1.y, b_hi.x, b_hi.y);
        mma_bf16(s[nt], a_hi0.x, a_hi1.x, a_hi0.y, a_hi1.y, b_lo.x, b_lo.y);
        mma_bf16(s[nt], a_lo0.x, a_lo1.x, a_lo0.y, a_lo1.y, b_hi.x, b_hi.y);
      }
    }
    // Online softmax per row (a row's 32 scores are spread over the four lanes of its group).
    float m_new[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = kt + 8 * nt + 2 * q + (e & 1);
        const float v = key < (e < 2 ? keys_lo : keys_hi) ? s[nt][e] * scale : -INFINITY;
        s[nt][e] = v;
        m_new[e / 2] = fmaxf(m_new[e / 2], v);
      }
    float corr[2], m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 1));
      m_new[r] = fmaxf(m_new[r], __shfl_xor_sync(0xffffffffu, m_new[r], 2));
      m_use[r] = m_new[r] == -INFINITY ? 0.0f : m_new[r];  // a row with no key yet: everything is 0
      corr[r] = expf(m_run[r] - m_use[r]);
      m_run[r] = m_new[r];
      l_run[r] *= corr[r];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = expf(s[nt][e] - m_use[e / 2]);
        l_run[e / 2] += s[nt][e];
      }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      acc[dt][0] *= corr[0], acc[dt][1] *= corr[0], acc[dt][2] *= corr[1], acc[dt][3] *= corr[1];
      // O += P V over k-steps of 16 keys (n-tiles 2 kk and 2 kk + 1 of S)
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
      uint32_t p_hi[4], p_lo[4];
      split_pair(s[2 * kk][0], s[2 * kk][1], p_hi[0], p_lo[0]);
      split_pair(s[2 * kk][2], s[2 * kk][3], p_hi[1], p_lo[1]);
      split_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], p_hi[2], p_lo[2]);
      split_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], p_hi[3], p_lo[3]);
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const int at = (8 * dt + g) * VW + 8 * kk + q;
        const uint32_t bh0 = v_hi[at], bh1 = v_hi[at + 4], bl0 = v_lo[at], bl1 = v_lo[at + 4];
        mma_bf16(acc[dt], p_hi[0], p_hi[1], p_hi[2], p_hi[3], bh0, bh1);
        mma_bf16(acc[dt], p_hi[0], p_hi[1], p_hi[2], p_hi[3], bl0, bl1);
        mma_bf16(acc[dt], p_lo[0], p_lo[1], p_lo[2], p_lo[3], bh0, bh1);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = g + 8 * r;
    if (!row_valid(row)) continue;
    const int64_t at = row_offset(row);
    const float* gate = qg + 2 * at + D;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      const int d = 8 * dt + 2 * q;
      float2 out;
      out.x = acc[dt][2 * r] / l * sigmoid(gate[d]);
      out.y = acc[dt][2 * r + 1] / l * sigmoid(gate[d + 1]);
      *reinterpret_cast<float2*>(o + at + d) = out;
    }
  }
}

// ---- Gated DeltaNet

constexpr int kMaxConvKernel = 8;

// silu(sum_j w[j] row(t + j)): the conv's output for token t of one channel, where row(r) is row r of
// [conv_state (kc - 1 rows); qkv] and w the channel's kc weights. Every conv kernel goes through it (the
// same fmaf sequence for a token whichever kernel runs it).
template <typename Index, typename Row>
__device__ __forceinline__ float conv_output(const float* __restrict__ w, Index kc, Row row, Index t) {
  float s = 0.0f;
  for (Index j = 0; j < kc; ++j) s = fmaf(w[j], row(t + j), s);
  return silu(s);
}

// The DeltaNet gates of one (token, value head) entry i = t * hv + h: beta = sigmoid(b), g = -exp(a_log)
// softplus(a + dt_bias).
__device__ __forceinline__ void deltanet_gates(int64_t i, int64_t h, const float* __restrict__ b,
                                               const float* __restrict__ a, const float* __restrict__ a_log,
                                               const float* __restrict__ dt_bias, float* __restrict__ beta,
                                               float* __restrict__ g) {
  beta[i] = sigmoid(b[i]);
  g[i] = -expf(a_log[h]) * softplus(a[i] + dt_bias[h]);
}

// x == nullptr: only the state moves on (the prefill path's outputs come from conv_rows_kernel).
__global__ void conv_kernel(const float* __restrict__ qkv, float* conv_state, const float* __restrict__ w,
                            int64_t t_count, int64_t channels, int64_t kc, float* __restrict__ x,
                            float* __restrict__ conv_before) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  const int64_t ch = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (ch >= channels) return;
  float old[kMaxConvKernel];
  for (int64_t r = 0; r < kc - 1; ++r) {
    old[r] = conv_state[r * channels + ch];
    if (conv_before != nullptr) conv_before[r * channels + ch] = old[r];
  }
  auto row = [&](int64_t r) { return r < kc - 1 ? old[r] : qkv[(r - (kc - 1)) * channels + ch]; };
  if (x != nullptr)
    for (int64_t t = 0; t < t_count; ++t) x[t * channels + ch] = conv_output(w + ch * kc, kc, row, t);
  for (int64_t r = 0; r < kc - 1; ++r) conv_state[r * channels + ch] = row(t_count + r);
}

// Prompt prefill: x for kConvRows tokens per thread, all tokens in parallel (conv_kernel walks every token
// of a channel in one thread: 1.3 ms per 9B layer at 2048 tokens). The same fmaf sequence per output as
// conv_kernel. conv_state is only read here; conv_kernel without outputs then moves it on.
constexpr int64_t kConvRows = 16;

__global__ void conv_rows_kernel(const float* __restrict__ qkv, const float* __restrict__ conv_state,
                                 const float* __restrict__ w, int64_t t_count, int64_t channels, int64_t kc,
                                 float* __restrict__ x) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  const int64_t ch = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (ch >= channels) return;
  auto row = [&](int64_t r) {
    return r < kc - 1 ? conv_state[r * channels + ch] : qkv[(r - (kc - 1)) * channels + ch];
  };
  const int64_t t_end = (blockIdx.y + 1) * kConvRows < t_count ? (blockIdx.y + 1) * kConvRows : t_count;
  for (int64_t t = blockIdx.y * kConvRows; t < t_end; ++t)
    x[t * channels + ch] = conv_output(w + ch * kc, kc, row, t);
}

__device__ __forceinline__ void conv_rollback_channel(const float* __restrict__ conv_before,
                                                      const float* __restrict__ qkv, int64_t keep,
                                                      int64_t channels, int64_t kc,
                                                      float* __restrict__ conv_state) {
  const int64_t ch = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (ch >= channels) return;
  for (int64_t r = 0; r < kc - 1; ++r) {
    const int64_t src = keep + r;
    conv_state[r * channels + ch] =
        src < kc - 1 ? conv_before[src * channels + ch] : qkv[(src - (kc - 1)) * channels + ch];
  }
}

// blockIdx = (t, segment): segments 0..2hk-1 are the q and k heads (l2 norm), segment 2hk the gates.
__global__ void deltanet_prepare_kernel(float* x, const float* __restrict__ b, const float* __restrict__ a,
                                        const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                        int64_t hk, int64_t hv, int64_t dk, int64_t conv_dim,
                                        float* __restrict__ beta, float* __restrict__ g) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, seg = blockIdx.y;
  if (seg == 2 * hk) {
    for (int64_t h = threadIdx.x; h < hv; h += blockDim.x)
      deltanet_gates(t * hv + h, h, b, a, a_log, dt_bias, beta, g);
    return;
  }
  float* xs = x + t * conv_dim + seg * dk;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) ss = fmaf(xs[i], xs[i], ss);
  ss = block_sum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss + 1e-6f);
  const float q_scale = 1.0f / sqrtf(static_cast<float>(dk));
  for (int64_t i = threadIdx.x; i < dk; i += blockDim.x) {
    float v = xs[i] * scale;
    if (seg < hk) v *= q_scale;
    xs[i] = v;
  }
}

// Decode and verify rows (T < kGemmMinRows): conv_kernel and deltanet_prepare_kernel in one launch (one
// kernel boundary less per DeltaNet layer). Block b < 2 hk takes the dk channels of q head b (k head b - hk):
// thread i runs channel i's conv over the T tokens in registers (conv_kernel's fmaf sequence), then each
// token's l2 norm is a block sum over the head (deltanet_prepare_kernel's arithmetic: one element per
// thread). The v channels follow in blocks of kConvPrepareThreads (conv only); the last block computes the
// gates. Batch-invariant: each token's outputs use only the state and the tokens before it, in the same
// order for any T. H200 (BENCHMARKS.md, session 17): decode unchanged (0.8B) to 1% faster (9B); the 0.8B
// 4-row window 1.14 -> 1.09 decode steps.
constexpr int kConvPrepareThreads = 128;
constexpr int kConvPrepareMaxRows = kGemmMinRows - 1;

__global__ void __launch_bounds__(kConvPrepareThreads)
    conv_prepare_kernel(const float* __restrict__ qkv, float* conv_state, const float* __restrict__ w,
                        const float* __restrict__ b, const float* __restrict__ a,
                        const float* __restrict__ a_log, const float* __restrict__ dt_bias, int t_count,
                        int hk, int hv, int dk, int channels, int kc, float* __restrict__ x,
                        float* __restrict__ conv_before, float* __restrict__ beta, float* __restrict__ g,
                        bool preload) {
  __shared__ float scratch[32];
  const int seg = blockIdx.x,
            v_blocks = (channels - 2 * hk * dk + kConvPrepareThreads - 1) / kConvPrepareThreads;
  const bool gates = seg == 2 * hk + v_blocks, qk = seg < 2 * hk;
  const int ch =
      qk ? seg * dk + threadIdx.x : 2 * hk * dk + (seg - 2 * hk) * kConvPrepareThreads + threadIdx.x;
  const bool own = !gates && (qk ? static_cast<int>(threadIdx.x) < dk : ch < channels);
  float old[kMaxConvKernel], out[kConvPrepareMaxRows];
  // The conv state before the wait (early_loads()): the previous kernel (the in_proj product) does not
  // write it, and every kernel before that one has completed once this one runs.
  auto load_state = [&] {
    if (own)
      for (int r = 0; r < kc - 1; ++r) old[r] = conv_state[r * channels + ch];
  };
  if (preload) load_state();
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  if (!preload) load_state();
  if (gates) {
    for (int i = threadIdx.x; i < t_count * hv; i += blockDim.x)
      deltanet_gates(i, i % hv, b, a, a_log, dt_bias, beta, g);
    return;
  }
  if (own) {
    if (conv_before != nullptr)
      for (int r = 0; r < kc - 1; ++r) conv_before[r * channels + ch] = old[r];
    auto row = [&](int r) { return r < kc - 1 ? old[r] : qkv[(r - (kc - 1)) * channels + ch]; };
#pragma unroll
    for (int t = 0; t < kConvPrepareMaxRows; ++t) {
      if (t >= t_count) break;
      out[t] = conv_output(w + ch * kc, kc, row, t);
    }
    for (int r = 0; r < kc - 1; ++r) conv_state[r * channels + ch] = row(t_count + r);
  }
  const float q_scale = 1.0f / sqrtf(static_cast<float>(dk));
#pragma unroll
  for (int t = 0; t < kConvPrepareMaxRows; ++t) {
    if (t >= t_count) break;
    float v = own ? out[t] : 0.0f;
    if (qk) {  // uniform per block: every thread reaches the block sum
      const float ss = block_sum(fmaf(v, v, 0.0f), scratch);
      v *= 1.0f / sqrtf(ss + 1e-6f);
      if (seg < hk) v *= q_scale;
    }
    if (own) x[static_cast<size_t>(t) * channels + ch] = v;
  }
}

// blockIdx = (value head, block of kDeltaColumns columns); a warp holds those columns of the head's
// [Dk, Dv] state in registers over the window, each column split over kDeltaParts lanes (lane = part *
// kDeltaColumns + column), each lane Dk / kDeltaParts entries. Per token (§4.2): S = e^g S; kv = k^T S;
// delta = beta (v - kv); S += k delta^T; o = q^T S, with kv and o each summed in four interleaved partial
// sums per lane and the lanes of a column combined by a butterfly of shuffles, which gives every one of
// them the same float ((a + b) + (c + d) up to the order of commutative additions). The inputs of
// kDeltaChunk tokens (q, k, v, g, beta) are staged in shared memory by one cooperative load and read back
// as float4. Why: with a whole column per thread a token took 4,200 cycles (ncu: one warp per SM, an
// instruction every 8 cycles, 72% of the stalls on shared-memory loads) and the recurrence was 45% of a
// 9B prefill. Batch-invariant: the same operations per token whatever the window or chunk.
constexpr int kDeltaChunk = 16;
constexpr int kDeltaParts = 4;
constexpr int kDeltaColumns = 32 / kDeltaParts;  // columns per block of one warp

// The block (value head blockIdx.x, kDeltaColumns state columns from blockIdx.y) of delta_rule_kernel;
// o == nullptr: the state only (a rollback's replay).
template <int DK>
__device__ __forceinline__ void delta_rule_block(const float* __restrict__ x, const float* __restrict__ g,
                                                 const float* __restrict__ beta, const float* s_in,
                                                 float* s_out, float* __restrict__ s_before,
                                                 float* __restrict__ o, int64_t t_count, int64_t hk,
                                                 int64_t hv, int64_t dv, int64_t conv_dim, bool preload) {
  constexpr int kPart = DK / kDeltaParts;
  static_assert(kPart % 4 == 0, "whole float4 per lane");
  __shared__ __align__(16) float qs[kDeltaChunk][DK];
  __shared__ __align__(16) float ks[kDeltaChunk][DK];
  __shared__ float vs[kDeltaChunk][kDeltaColumns], gs[kDeltaChunk], bs[kDeltaChunk];
  const int64_t h = blockIdx.x;
  const int column = threadIdx.x % kDeltaColumns, part = threadIdx.x / kDeltaColumns;
  const int64_t j = blockIdx.y * static_cast<int64_t>(kDeltaColumns) + column;
  const int64_t key_head = h / (hv / hk);
  const bool active = j < dv;
  const size_t base = static_cast<size_t>(h) * DK * dv + static_cast<size_t>(part) * kPart * dv;
  float S[kPart];
  // The state before the wait (early_loads()): the previous kernel (the conv) does not write it, and every
  // kernel before that one has completed once this one runs (it called griddep_launch_dependents() only
  // after its own wait), the previous step's delta rule and a rollback's included.
  auto load_state = [&] {
#pragma unroll
    for (int i = 0; i < kPart; ++i) S[i] = active ? s_in[base + i * dv + j] : 0.0f;
  };
  if (preload) load_state();
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  if (!preload) load_state();
  if (s_before != nullptr && active) {
#pragma unroll
    for (int i = 0; i < kPart; ++i) s_before[base + i * dv + j] = S[i];
  }
  // The sum over a column's lanes, the same float in each of them.
  auto column_sum = [](float v) {
    v += __shfl_xor_sync(0xffffffffu, v, kDeltaColumns);
    return v + __shfl_xor_sync(0xffffffffu, v, 2 * kDeltaColumns);
  };
  static_assert(kDeltaParts == 4, "column_sum combines four lanes");
  for (int64_t c0 = 0; c0 < t_count; c0 += kDeltaChunk) {
    const int n = static_cast<int>(t_count - c0 < kDeltaChunk ? t_count - c0 : kDeltaChunk);
    __syncthreads();  // the previous chunk is consumed
    // Staged in batches of kStageBatch loads per array and thread issued before any is stored, so a batch
    // costs one memory latency (a loop of load-then-store waits for every load: 3,800 cycles per token).
    constexpr int kStageBatch = 16;
    for (int idx0 = 0; idx0 < n * DK; idx0 += 32 * kStageBatch) {
      float qv[kStageBatch], kv_[kStageBatch];
#pragma unroll
      for (int u = 0; u < kStageBatch; ++u) {
        const int idx = idx0 + threadIdx.x + 32 * u;
        const float* xt = x + (c0 + idx / DK) * conv_dim;
        qv[u] = idx < n * DK ? xt[key_head * DK + idx % DK] : 0.0f;
        kv_[u] = idx < n * DK ? xt[hk * DK + key_head * DK + idx % DK] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kStageBatch; ++u) {
        const int idx = idx0 + threadIdx.x + 32 * u;
        if (idx < n * DK) qs[idx / DK][idx % DK] = qv[u], ks[idx / DK][idx % DK] = kv_[u];
      }
    }
    {
      static_assert(kDeltaChunk * kDeltaColumns % 32 == 0 && kDeltaChunk <= 32);
      constexpr int kPer = kDeltaChunk * kDeltaColumns / 32;
      float vv[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int idx = threadIdx.x + 32 * u, t = idx / kDeltaColumns, c = idx % kDeltaColumns;
        const int64_t col = blockIdx.y * static_cast<int64_t>(kDeltaColumns) + c;
        vv[u] = t < n && col < dv ? x[(c0 + t) * conv_dim + 2 * hk * DK + h * dv + col] : 0.0f;
      }
      const bool own = threadIdx.x < n;
      const float gv = own ? g[(c0 + threadIdx.x) * hv + h] : 0.0f;
      const float bv = own ? beta[(c0 + threadIdx.x) * hv + h] : 0.0f;
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int idx = threadIdx.x + 32 * u;
        vs[idx / kDeltaColumns][idx % kDeltaColumns] = vv[u];
      }
      if (own) gs[threadIdx.x] = gv, bs[threadIdx.x] = bv;
    }
    __syncthreads();
    for (int t = 0; t < n; ++t) {  // every lane runs (the shuffles need the whole warp)
      const float decay = expf(gs[t]);
      const float4* q4 = reinterpret_cast<const float4*>(qs[t] + part * kPart);
      const float4* k4 = reinterpret_cast<const float4*>(ks[t] + part * kPart);
      float kv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < kPart; i += 4) {
        const float4 k = k4[i / 4];
        S[i] *= decay, S[i + 1] *= decay, S[i + 2] *= decay, S[i + 3] *= decay;
        kv[0] = fmaf(k.x, S[i], kv[0]);
        kv[1] = fmaf(k.y, S[i + 1], kv[1]);
        kv[2] = fmaf(k.z, S[i + 2], kv[2]);
        kv[3] = fmaf(k.w, S[i + 3], kv[3]);
      }
      const float delta = (vs[t][column] - column_sum((kv[0] + kv[1]) + (kv[2] + kv[3]))) * bs[t];
      float out[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < kPart; i += 4) {
        const float4 k = k4[i / 4], q = q4[i / 4];
        S[i] = fmaf(k.x, delta, S[i]);
        S[i + 1] = fmaf(k.y, delta, S[i + 1]);
        S[i + 2] = fmaf(k.z, delta, S[i + 2]);
        S[i + 3] = fmaf(k.w, delta, S[i + 3]);
        out[0] = fmaf(q.x, S[i], out[0]);
        out[1] = fmaf(q.y, S[i + 1], out[1]);
        out[2] = fmaf(q.z, S[i + 2], out[2]);
        out[3] = fmaf(q.w, S[i + 3], out[3]);
      }
      const float out_all = column_sum((out[0] + out[1]) + (out[2] + out[3]));
      if (active && part == 0 && o != nullptr) o[((c0 + t) * hv + h) * dv + j] = out_all;
    }
  }
  if (active) {
#pragma unroll
    for (int i = 0; i < kPart; ++i) s_out[base + i * dv + j] = S[i];
  }
}

template <int DK>
__global__ void delta_rule_kernel(const float* __restrict__ x, const float* __restrict__ g,
                                  const float* __restrict__ beta, const float* s_in, float* s_out,
                                  float* __restrict__ s_before, float* __restrict__ o, int64_t t_count,
                                  int64_t hk, int64_t hv, int64_t dv, int64_t conv_dim, bool preload) {
  delta_rule_block<DK>(x, g, beta, s_in, s_out, s_before, o, t_count, hk, hv, dv, conv_dim, preload);
}

// A rollback's replay in every DeltaNet layer of a chunk at once: layer blockIdx.z, each block as
// delta_rule_kernel's (the same operations: the state is bit for bit the one-layer launch's).
constexpr int kRollbackLayersPerLaunch = 48;
struct RollbackLayers {
  DeltaNetRollbackLayer layer[kRollbackLayersPerLaunch];
};

template <int DK>
__global__ void delta_replay_kernel(const RollbackLayers layers, int64_t t_count, int64_t hk, int64_t hv,
                                    int64_t dv, int64_t conv_dim) {
  const DeltaNetRollbackLayer& l = layers.layer[blockIdx.z];
  delta_rule_block<DK>(l.x, l.g, l.beta, l.ssm_before, l.ssm, nullptr, nullptr, t_count, hk, hv, dv, conv_dim,
                       false);
}

__global__ void conv_replay_kernel(const RollbackLayers layers, int64_t keep, int64_t channels, int64_t kc) {
  const DeltaNetRollbackLayer& l = layers.layer[blockIdx.y];
  conv_rollback_channel(l.conv_before, l.qkv, keep, channels, kc, l.conv);
}

// Prompt prefill: the chunked form of the delta rule (spec §4.3, as gated_deltanet.cpp's
// delta_rule_chunked), chunks of C = 64 tokens per value head. The token-by-token recurrence above is a
// chain of T dependent steps per head (1.75 ms per 9B layer at 2048 tokens, a quarter of the prefill);
// here only the state hand-over between chunks is sequential and everything else is small matrix
// products. Two kernels:
//   delta_chunk_matrices_kernel, one block per (value head, chunk), all chunks in parallel: what depends
//   only on q, k, g and beta. G = cumsum(g) in the chunk, P[i][j] = (q_i . k_j) e^{G_i - G_j} (j <= i) and
//   Tinv = (I + A)^-1 with A[i][j] = beta_i (k_i . k_j) e^{G_i - G_j} (j < i), by forward substitution, one
//   column per four lanes.
//   delta_chunk_scan_kernel, one block per (value head, kDeltaScanColumns state columns), chunk after
//   chunk: R = beta (V - e^G (K S)); Vnew = Tinv R (= U - W S of §4.3: Tinv is linear, so W is never
//   formed); O = e^G (Q S) + P Vnew; S = e^{G_last} S + (K e^{G_last - G})^T Vnew.
// Rows past the prompt's end are zero (beta = g = 0), as §4.3 pads. Prefill only: the order of the sums
// differs from the recurrence (verify windows and decode keep delta_rule_kernel, batch-invariant).
// H200 (BENCHMARKS.md, session 16), 9B layer at 2048 tokens: 0.17 ms for the matrices, 0.72 ms for the scan.
constexpr int kDeltaChunkRows = 64;  // C
constexpr int kDeltaMatricesThreads = 256;
constexpr int kDeltaScanThreads = 256;
constexpr int kDeltaScanColumns = 32;  // state columns per scan block
constexpr int kDeltaScanStride = 48;   // row stride of the column slices: lanes 0-15 and 16-31 of a
                                       // warp write rows ti and ti + 1 into different banks

// Shared-memory floats of the two kernels for key dimension dk.
constexpr int64_t delta_matrices_smem_floats(int64_t dk) {
  return 2 * kDeltaChunkRows * (dk + 1) + kDeltaChunkRows * (kDeltaChunkRows + 1) +
         kDeltaChunkRows * (kDeltaChunkRows + 8) + 2 * kDeltaChunkRows;
}
constexpr int64_t delta_scan_smem_floats(int64_t dk) {
  return 2 * kDeltaChunkRows * (dk + 4) + 2 * kDeltaChunkRows * (kDeltaChunkRows + 4) +
         (dk + 2 * kDeltaChunkRows) * kDeltaScanStride + 3 * kDeltaChunkRows;
}

// Stages kCount floats into shared memory with kThreads threads: value i = src(i) goes to dst(i, value).
// Each thread issues kStageLoads loads before it stores any, so a batch costs one memory latency (a
// load-then-store loop waits out every load, as delta_rule_kernel's staging explains).
constexpr int kStageLoads = 16;
template <int kThreads, int kCount, typename Src, typename Dst>
__device__ __forceinline__ void stage(int tid, Src src, Dst dst) {
  for (int base = tid; base < kCount; base += kStageLoads * kThreads) {
    float v[kStageLoads];
#pragma unroll
    for (int u = 0; u < kStageLoads; ++u) {
      const int i = base + u * kThreads;
      v[u] = i < kCount ? src(i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kStageLoads; ++u) {
      const int i = base + u * kThreads;
      if (i < kCount) dst(i, v[u]);
    }
  }
}

// Stages one key head's q (or k) rows of a chunk: kDeltaChunkRows token rows of DK floats, `stride` apart
// from `rows`, into dst with row stride kDstStride; rows from n on are zero (past the prompt's end).
template <int kThreads, int DK, int kDstStride>
__device__ __forceinline__ void stage_head_rows(int tid, const float* rows, int64_t stride, int n,
                                                float* dst) {
  stage<kThreads, kDeltaChunkRows * DK>(
      tid, [&](int i) { return i / DK < n ? rows[(i / DK) * stride + i % DK] : 0.0f; },
      [&](int i, float v) { dst[(i / DK) * kDstStride + i % DK] = v; });
}

// Per (value head h, chunk): tinv and p [C][C] at ((h * chunks + chunk) * C * C), G [C] at
// ((h * chunks + chunk) * C).
template <int DK>
__global__ void __launch_bounds__(kDeltaMatricesThreads)
    delta_chunk_matrices_kernel(const float* __restrict__ x, const float* __restrict__ g,
                                const float* __restrict__ beta, int64_t t_count, int64_t hk, int64_t hv,
                                int64_t conv_dim, float* __restrict__ tinv, float* __restrict__ p,
                                float* __restrict__ g_cum) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  constexpr int C = kDeltaChunkRows, KS = DK + 1, AS = C + 1, XS = C + 8;
  static_assert(kDeltaMatricesThreads == 4 * C && C == 64, "tiles of 4 x 4, one column per 4 lanes");
  extern __shared__ float smem[];
  float* ks = smem;         // [C][KS] k rows of the chunk
  float* qs = ks + C * KS;  // [C][KS] q rows
  float* as = qs + C * KS;  // [C][AS] A
  float* xs = as + C * AS;  // [C][XS] Tinv (XS = 72: the four lanes of a column read rows 4s + part,
                            // banks 8 part + column: no conflicts)
  float* gs = xs + C * XS;  // [C] G
  float* bs = gs + C;       // [C] beta
  const int64_t h = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y, t0 = chunk * C;
  const int n = static_cast<int>(t_count - t0 < C ? t_count - t0 : C);
  const int64_t key_head = h / (hv / hk);
  const int tid = static_cast<int>(threadIdx.x);
  const float* const k_rows = x + t0 * conv_dim + hk * DK + key_head * DK;
  const float* const q_rows = x + t0 * conv_dim + key_head * DK;
  stage_head_rows<kDeltaMatricesThreads, DK, KS>(tid, k_rows, conv_dim, n, ks);
  stage_head_rows<kDeltaMatricesThreads, DK, KS>(tid, q_rows, conv_dim, n, qs);
  if (tid < C) {
    gs[tid] = tid < n ? g[(t0 + tid) * hv + h] : 0.0f;
    bs[tid] = tid < n ? beta[(t0 + tid) * hv + h] : 0.0f;
  }
  __syncthreads();
  if (tid == 0) {  // G, summed in token order as the CPU does
    float acc = 0.0f;
    for (int i = 0; i < C; ++i) gs[i] = acc += gs[i];
  }
  __syncthreads();
  // k_i . k_j and q_i . k_j for rows i = ti + 16 r and columns j = tj + 16 c (KS odd: the 16 columns of a
  // warp's lanes fall in 16 banks; its two row indices are broadcasts).
  const int ti = tid / 16, tj = tid % 16;
  float kk[4][4] = {}, qk[4][4] = {};
  for (int d = 0; d < DK; ++d) {
    float ki[4], qi[4], kj[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) ki[r] = ks[(ti + 16 * r) * KS + d], qi[r] = qs[(ti + 16 * r) * KS + d];
#pragma unroll
    for (int c = 0; c < 4; ++c) kj[c] = ks[(tj + 16 * c) * KS + d];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        kk[r][c] = fmaf(ki[r], kj[c], kk[r][c]), qk[r][c] = fmaf(qi[r], kj[c], qk[r][c]);
  }
  const size_t base = (static_cast<size_t>(h) * chunks + chunk) * C * C;
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int i = ti + 16 * r, j = tj + 16 * c;
      const float decay = j <= i ? expf(gs[i] - gs[j]) : 0.0f;  // G_i - G_j <= 0 for j <= i
      as[i * AS + j] = j < i ? bs[i] * kk[r][c] * decay : 0.0f;
      p[base + i * C + j] = j <= i ? qk[r][c] * decay : 0.0f;
    }
  __syncthreads();
  // (I + A) x = e_j, column j by forward substitution: x_j = 1, x_i = -sum_{j <= m < i} A[i][m] x_m. The
  // four lanes of column j (lanes l, l + 8, l + 16, l + 24 of a warp) take m = 4 s + part and add up.
  const int lane = tid % 32, j = 8 * (tid / 32) + lane % 8, part = lane / 8;
  for (int i = 0; i < C; ++i) {
    float s = 0.0f;
    if (i > j)
      for (int m = 4 * (j / 4) + part; m < i; m += 4) s = fmaf(as[i * AS + m], xs[m * XS + j], s);
    s += __shfl_xor_sync(0xffffffffu, s, 8);
    s += __shfl_xor_sync(0xffffffffu, s, 16);
    if (part == 0) xs[i * XS + j] = i < j ? 0.0f : i == j ? 1.0f : -s;
    __syncwarp();  // row i of column j is read by the column's other lanes from the next i on
  }
  __syncthreads();
  for (int idx = tid; idx < C * C; idx += kDeltaMatricesThreads)
    tinv[base + idx] = xs[(idx / C) * XS + idx % C];
  if (tid < C) g_cum[(static_cast<size_t>(h) * chunks + chunk) * C + tid] = gs[tid];
}

// acc[j][r][q] += sum_k a[j][(ti + 16 r) * LDA + k] * b[k * kDeltaScanStride + tc + 16 q] for k = 0..K-1 in
// order: the scan's products of NA row-major operands (rows ti + 16 r of a thread) against one column slice
// of kDeltaScanColumns, the rows read as float4 (LDA and the rows' offsets multiples of 4 floats: a warp's
// two rows 4 banks apart never share a bank).
template <int NA, int K, int LDA>
__device__ __forceinline__ void rows_times_slice(const float* const (&a)[NA], const float* b, int ti, int tc,
                                                 float (*acc)[4][2]) {
  static_assert(K % 4 == 0 && LDA % 4 == 0 && kDeltaScanColumns == 32);
  for (int k = 0; k < K; k += 4) {
    float4 a4[NA][4];
#pragma unroll
    for (int j = 0; j < NA; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) a4[j][r] = *reinterpret_cast<const float4*>(&a[j][(ti + 16 * r) * LDA + k]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float b0 = b[(k + e) * kDeltaScanStride + tc], b1 = b[(k + e) * kDeltaScanStride + tc + 16];
#pragma unroll
      for (int j = 0; j < NA; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float av = (&a4[j][r].x)[e];
          acc[j][r][0] = fmaf(av, b0, acc[j][r][0]), acc[j][r][1] = fmaf(av, b1, acc[j][r][1]);
        }
    }
  }
}

// Per (value head, kDeltaScanColumns columns of the state): the chunks in order. Thread (ti, tc) owns rows
// ti + 16 r and columns tc, tc + 16 of each [C, columns] product, and rows ti + 16 r of the state update.
// The row operands (K, Q, Tinv and P rows) are read as float4: rows padded to a multiple of 4 floats, 4
// banks apart, so a warp's two rows never share a bank; the sums still run over k in order.
template <int DK>
__global__ void __launch_bounds__(kDeltaScanThreads)
    delta_chunk_scan_kernel(const float* __restrict__ x, const float* __restrict__ beta,
                            const float* __restrict__ tinv, const float* __restrict__ p,
                            const float* __restrict__ g_cum, float* state, float* __restrict__ o,
                            int64_t t_count, int64_t hk, int64_t hv, int64_t dv, int64_t conv_dim) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  constexpr int C = kDeltaChunkRows, KS = DK + 4, MS = C + 4, VS = kDeltaScanStride, SR = DK / 16;
  static_assert(kDeltaScanThreads == 16 * 16 && kDeltaScanColumns == 32 && DK % 16 == 0);
  extern __shared__ __align__(16) float smem[];
  float* ks = smem;          // [C][KS]
  float* qs = ks + C * KS;   // [C][KS]
  float* ts = qs + C * KS;   // [C][MS] Tinv
  float* ps = ts + C * MS;   // [C][MS] P
  float* ss = ps + C * MS;   // [DK][VS] the state's columns
  float* rs = ss + DK * VS;  // [C][VS] R
  float* us = rs + C * VS;   // [C][VS] Vnew
  float* gs = us + C * VS;   // [C] G
  float* bs = gs + C;        // [C] beta
  float* fs = bs + C;        // [C] e^{G_last - G_i}
  const int64_t h = blockIdx.x, col0 = static_cast<int64_t>(blockIdx.y) * kDeltaScanColumns;
  const int64_t key_head = h / (hv / hk), chunks = (t_count + C - 1) / C;
  const int tid = static_cast<int>(threadIdx.x), ti = tid / 16, tc = tid % 16;
  float* const s_head = state + static_cast<size_t>(h) * DK * dv;
  for (int idx = tid; idx < DK * kDeltaScanColumns; idx += kDeltaScanThreads) {
    const int d = idx / kDeltaScanColumns, c = idx % kDeltaScanColumns;
    ss[d * VS + c] = col0 + c < dv ? s_head[d * dv + col0 + c] : 0.0f;
  }
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t t0 = chunk * C;
    const int n = static_cast<int>(t_count - t0 < C ? t_count - t0 : C);
    const size_t base = (static_cast<size_t>(h) * chunks + chunk) * C * C;
    __syncthreads();  // the previous chunk is done with the buffers
    const float* const k_rows = x + t0 * conv_dim + hk * DK + key_head * DK;
    const float* const q_rows = x + t0 * conv_dim + key_head * DK;
    stage_head_rows<kDeltaScanThreads, DK, KS>(tid, k_rows, conv_dim, n, ks);
    stage_head_rows<kDeltaScanThreads, DK, KS>(tid, q_rows, conv_dim, n, qs);
    stage<kDeltaScanThreads, C * C>(
        tid, [&](int i) { return tinv[base + i]; }, [&](int i, float v) { ts[(i / C) * MS + i % C] = v; });
    stage<kDeltaScanThreads, C * C>(
        tid, [&](int i) { return p[base + i]; }, [&](int i, float v) { ps[(i / C) * MS + i % C] = v; });
    if (tid < C) {
      gs[tid] = g_cum[(static_cast<size_t>(h) * chunks + chunk) * C + tid];
      bs[tid] = tid < n ? beta[(t0 + tid) * hv + h] : 0.0f;
    }
    __syncthreads();
    if (tid < C) fs[tid] = expf(gs[C - 1] - gs[tid]);
    // K S and Q S (the state before the chunk), rows ti + 16 r, columns tc and tc + 16.
    float sums[2][4][2] = {};  // K S and Q S
    rows_times_slice<2, DK, KS>({ks, qs}, ss, ti, tc, sums);
    float(&ksum)[4][2] = sums[0];
    float(&qsum)[4][2] = sums[1];
    // R = beta (V - e^G (K S))
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int m = ti + 16 * r, c = tc + 16 * q;
        const int64_t col = col0 + c;
        const float v = m < n && col < dv ? x[(t0 + m) * conv_dim + 2 * hk * DK + h * dv + col] : 0.0f;
        rs[m * VS + c] = bs[m] * (v - expf(gs[m]) * ksum[r][q]);
      }
    __syncthreads();
    // Vnew = Tinv R (Tinv is unit lower-triangular: m <= i)
    float u[4][2] = {};
    rows_times_slice<1, C, MS>({ts}, rs, ti, tc, &u);
#pragma unroll
    for (int r = 0; r < 4; ++r)
      us[(ti + 16 * r) * VS + tc] = u[r][0], us[(ti + 16 * r) * VS + tc + 16] = u[r][1];
    __syncthreads();
    // O = e^G (Q S) + P Vnew
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float e = expf(gs[ti + 16 * r]);
      qsum[r][0] *= e, qsum[r][1] *= e;
    }
    rows_times_slice<1, C, MS>({ps}, us, ti, tc, &qsum);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int i = ti + 16 * r;
        const int64_t col = col0 + tc + 16 * q;
        if (i < n && col < dv) o[((t0 + i) * hv + h) * dv + col] = qsum[r][q];
      }
    // S = e^{G_last} S + (K e^{G_last - G})^T Vnew, each thread its own entries (every read of S in this
    // chunk came before the barrier ahead of the Vnew product)
    float snew[SR][2] = {};
    for (int i = 0; i < C; ++i) {
      const float f = fs[i], v0 = us[i * VS + tc] * f, v1 = us[i * VS + tc + 16] * f;
#pragma unroll
      for (int r = 0; r < SR; ++r) {
        const float kv = ks[i * KS + ti + 16 * r];
        snew[r][0] = fmaf(kv, v0, snew[r][0]), snew[r][1] = fmaf(kv, v1, snew[r][1]);
      }
    }
    const float e_last = expf(gs[C - 1]);
#pragma unroll
    for (int r = 0; r < SR; ++r)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        float& s = ss[(ti + 16 * r) * VS + tc + 16 * q];
        s = fmaf(e_last, s, snew[r][q]);
      }
  }
  __syncthreads();
  for (int idx = tid; idx < DK * kDeltaScanColumns; idx += kDeltaScanThreads) {
    const int d = idx / kDeltaScanColumns, c = idx % kDeltaScanColumns;
    if (col0 + c < dv) s_head[d * dv + col0 + c] = ss[d * VS + c];
  }
}

__global__ void gated_rms_norm_kernel(float* o, const float* __restrict__ z, const float* __restrict__ w,
                                      float eps, int64_t n) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  __shared__ float scratch[32];
  float* r = o + blockIdx.x * n;
  const float* zr = z + blockIdx.x * n;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(r[i], r[i], ss);
  ss = block_sum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) r[i] = ((r[i] * scale) * w[i]) * silu(zr[i]);
}

// The first index of the row's maximum (cpu::argmax), or -1 when the row holds NaN or Inf (the host then
// reports the non-finite logits, as the CPU path does).
__global__ void argmax_kernel(const float* __restrict__ logits, int64_t vocab, int64_t limit, int32_t* out) {
  griddep_wait();
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  __shared__ float best_v[1024];
  __shared__ int32_t best_i[1024];
  __shared__ int non_finite;
  if (threadIdx.x == 0) non_finite = 0;
  __syncthreads();
  const float* row = logits + blockIdx.x * vocab;
  float bv = -INFINITY;
  int32_t bi = 0x7fffffff;
  bool bad = false;
  for (int64_t i = threadIdx.x; i < limit; i += blockDim.x) {
    const float v = row[i];
    bad |= !isfinite(v);
    if (v > bv) bv = v, bi = static_cast<int32_t>(i);
  }
  if (bad) non_finite = 1;
  best_v[threadIdx.x] = bv, best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const float ov = best_v[threadIdx.x + stride];
      const int32_t oi = best_i[threadIdx.x + stride];
      if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x]))
        best_v[threadIdx.x] = ov, best_i[threadIdx.x] = oi;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = non_finite ? -1 : best_i[0] == 0x7fffffff ? 0 : best_i[0];
}

// An unsigned key in the order of the floats (-0 and +0 equal, as the host's comparisons have them).
__device__ inline uint32_t order_key(float v) {
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
__device__ inline float key_value(uint32_t key) {  // order_key's inverse (+0 for zero)
  return __uint_as_float((key & 0x80000000u) != 0 ? key & 0x7fffffffu : ~key);
}

// The radix select of one row (topk_candidates), in global memory: the passes run as separate kernels
// over many blocks per row (one block per row streamed at one SM's rate: 0.3 ms per row of 248320 logits).
constexpr int kTopKBlocks = 32;  // blocks per row of the streaming passes

struct TopKRow {
  uint32_t hist[256];
  uint32_t prefix, mask;  // the digits of the k-th largest key chosen so far
  long long remaining;    // of the k: how many of the largest are still at or below the digits chosen
  int count, non_finite;
  uint32_t max_key;             // the row's largest key
  double mass[kTopKBlocks][2];  // each block's sums of the candidates' and the rest's weights
  // topp_band's select by mass: the weights in fixed point per digit, the digits chosen so far, and the
  // mass (fixed point) of the prefix still to place at or below them; then each block's sums of the band.
  unsigned long long mass_hist[256];
  uint32_t p_prefix, p_mask;
  unsigned long long p_remaining;
  double band[kTopKBlocks][3];  // the weights above the boundary (below the candidates), at it, its count
};

__global__ void topk_init_kernel(TopKRow* rows, int64_t k) {
  TopKRow& r = rows[blockIdx.x];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) r.hist[i] = 0;
  if (threadIdx.x == 0)
    r.prefix = 0, r.mask = 0, r.remaining = k, r.count = 0, r.non_finite = 0, r.max_key = 0;
}

// Histogram of digit (key >> shift) & 255 over the keys that match the digits chosen so far. Lanes of a warp
// that hit the same bin add once (the top digits of a row's logits are few, so most lanes do).
__global__ void topk_histogram_kernel(const float* __restrict__ logits, int64_t vocab, int64_t limit,
                                      int shift, TopKRow* rows) {
  __shared__ uint32_t hist[256];
  TopKRow& r = rows[blockIdx.y];
  const float* row = logits + blockIdx.y * vocab;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const uint32_t p = r.prefix, m = r.mask;
  bool bad = false;
  uint32_t top = 0;  // the largest key seen (the first pass counts every key)
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x; base < limit; base += stride) {
    const int64_t i = base + threadIdx.x;
    const bool in = i < limit;
    const float v = in ? row[i] : 0.0f;
    bad |= in && !isfinite(v);
    const uint32_t key = order_key(v);
    const bool counted = in && (key & m) == p;
    top = counted ? max(top, key) : top;
    const uint32_t bin = counted ? (key >> shift) & 255u : 256u;
    const unsigned lanes = __match_any_sync(0xffffffffu, bin);
    if (counted && (threadIdx.x & 31) == __ffs(lanes) - 1) atomicAdd(&hist[bin], __popc(lanes));
  }
  if (bad) atomicOr(&r.non_finite, 1);
  if (m == 0) {  // the first pass: the row's maximum (order-free: any order of atomicMax gives it)
    top = __reduce_max_sync(0xffffffffu, top);
    if ((threadIdx.x & 31) == 0) atomicMax(&r.max_key, top);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x)
    if (hist[i] != 0) atomicAdd(&r.hist[i], hist[i]);
}

// Chooses the digit of the k-th largest key among the matching ones, and clears the histogram.
__global__ void topk_digit_kernel(int shift, TopKRow* rows) {
  TopKRow& r = rows[blockIdx.x];
  if (threadIdx.x == 0) {
    long long above = 0;
    for (int d = 255; d >= 0; --d) {
      if (above + r.hist[d] >= r.remaining) {
        r.prefix |= static_cast<uint32_t>(d) << shift;
        r.mask |= 255u << shift;
        r.remaining -= above;
        break;
      }
      above += r.hist[d];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x) r.hist[i] = 0;
}

__global__ void topk_collect_kernel(const float* __restrict__ logits, int64_t vocab, int64_t limit,
                                    int64_t cap, TopKRow* rows, int32_t* __restrict__ ids,
                                    float* __restrict__ values) {
  TopKRow& r = rows[blockIdx.y];
  const float* row = logits + blockIdx.y * vocab;
  const uint32_t kth = r.prefix;  // the k-th largest key
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < limit; i += stride) {
    const float v = row[i];
    if (order_key(v) >= kth) {
      const int at = atomicAdd(&r.count, 1);
      if (at < cap) {
        ids[blockIdx.y * cap + at] = static_cast<int32_t>(i);
        values[blockIdx.y * cap + at] = v;
      }
    }
  }
}

// The weights exp(logit / T - max / T) of a row's ids < limit summed in double, those at or above the k-th
// largest key (the candidates) and those below (the rest) apart: each block over a fixed set of ids in a
// fixed order, then its threads in a fixed order, so a row's sums depend on its logits alone
// (batch-invariant). The host computes the candidates' weights the same way (decode/sampler.cpp:
// truncate_survivors).
__global__ void topk_mass_kernel(const float* __restrict__ logits, int64_t vocab, int64_t limit, double inv_t,
                                 TopKRow* rows) {
  __shared__ double scratch[32];
  TopKRow& r = rows[blockIdx.y];
  const float* row = logits + blockIdx.y * vocab;
  const uint32_t kth = r.prefix;
  const double max_scaled = static_cast<double>(key_value(r.max_key)) * inv_t;
  double candidates = 0.0, rest = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < limit; i += stride) {
    const float v = row[i];
    const double w = exp(static_cast<double>(v) * inv_t - max_scaled);
    if (order_key(v) >= kth)
      candidates += w;
    else
      rest += w;
  }
  candidates = block_sum(candidates, scratch);
  rest = block_sum(rest, scratch);
  if (threadIdx.x == 0) r.mass[blockIdx.x][0] = candidates, r.mass[blockIdx.x][1] = rest;
}

// counts[row] (-1: NaN or Inf), and with `masses` the row's two sums (the blocks' in block order).
__global__ void topk_counts_kernel(const TopKRow* rows, int32_t* counts, double* masses) {
  const TopKRow& r = rows[blockIdx.x];
  if (threadIdx.x == 0) counts[blockIdx.x] = r.non_finite ? -1 : r.count;
  if (masses != nullptr && threadIdx.x < 2) {
    double total = 0.0;
    for (int b = 0; b < kTopKBlocks; ++b) total += r.mass[b][threadIdx.x];
    masses[2 * blockIdx.x + threadIdx.x] = total;
  }
}

// Where top-p's prefix ends below a row's candidates (topp_band): a radix select like the k-th largest's,
// by mass instead of count. Each id's weight exp(logit / T - max / T) is added to its digit's bin as fixed
// point (weight x 2^scale_bits, rounded): integer sums are exact in any order, so the bins and the key they
// choose do not depend on the order of the atomics or on the other rows (batch-invariant). The host checks
// the key against the double sums of topp_band_sums_kernel, so the rounding (at most 2^-scale_bits per id)
// only ever sends a row back whole, never truncates it differently.
__device__ __forceinline__ unsigned long long fixed_weight(float v, double inv_t, double max_scaled,
                                                           double scale) {
  return __double2ull_rn(exp(static_cast<double>(v) * inv_t - max_scaled) * scale);
}

__global__ void topp_init_kernel(TopKRow* rows) {
  TopKRow& r = rows[blockIdx.x];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) r.mass_hist[i] = 0;
  if (threadIdx.x == 0) r.p_prefix = 0, r.p_mask = 0, r.p_remaining = 0;
}

__global__ void topp_histogram_kernel(const float* __restrict__ logits, int64_t vocab, int64_t limit,
                                      int shift, double inv_t, double scale, TopKRow* rows) {
  __shared__ unsigned long long hist[256];
  TopKRow& r = rows[blockIdx.y];
  const float* row = logits + blockIdx.y * vocab;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const uint32_t p = r.p_prefix, m = r.p_mask;
  const double max_scaled = static_cast<double>(key_value(r.max_key)) * inv_t;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < limit; i += stride) {
    const float v = row[i];
    const uint32_t key = order_key(v);
    if ((key & m) == p) atomicAdd(&hist[(key >> shift) & 255u], fixed_weight(v, inv_t, max_scaled, scale));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x)
    if (hist[i] != 0) atomicAdd(&r.mass_hist[i], hist[i]);
}

// Chooses the digit of the key at which the mass from the top reaches top_p of the row's (the first pass
// sets that target from its bins' total), and clears the bins.
__global__ void topp_digit_kernel(int shift, double top_p, TopKRow* rows) {
  TopKRow& r = rows[blockIdx.x];
  if (threadIdx.x == 0) {
    if (r.p_mask == 0) {
      unsigned long long total = 0;
      for (int d = 0; d < 256; ++d) total += r.mass_hist[d];
      r.p_remaining = max(1ull, __double2ull_rn(top_p * static_cast<double>(total)));
    }
    unsigned long long above = 0;
    int d = 255;
    for (; d > 0; --d) {
      if (above + r.mass_hist[d] >= r.p_remaining) break;
      above += r.mass_hist[d];
    }
    r.p_prefix |= static_cast<uint32_t>(d) << shift;
    r.p_mask |= 255u << shift;
    r.p_remaining = above >= r.p_remaining ? 1ull : r.p_remaining - above;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x) r.mass_hist[i] = 0;
}

// In double, in an order fixed by the row's length (as topk_mass_kernel): the weights of the ids between
// the boundary key and the candidates' (exclusive), of those at the boundary, and their count.
__global__ void topp_band_sums_kernel(const float* __restrict__ logits, int64_t vocab, int64_t limit,
                                      double inv_t, TopKRow* rows) {
  __shared__ double scratch[32];
  TopKRow& r = rows[blockIdx.y];
  const float* row = logits + blockIdx.y * vocab;
  const uint32_t candidates_key = r.prefix, boundary = r.p_prefix;
  const double max_scaled = static_cast<double>(key_value(r.max_key)) * inv_t;
  double above = 0.0, at = 0.0, count = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < limit; i += stride) {
    const float v = row[i];
    const uint32_t key = order_key(v);
    if (key < boundary || key >= candidates_key) continue;
    const double w = exp(static_cast<double>(v) * inv_t - max_scaled);
    if (key == boundary)
      at += w, count += 1.0;
    else
      above += w;
  }
  above = block_sum(above, scratch);
  at = block_sum(at, scratch);
  count = block_sum(count, scratch);
  if (threadIdx.x == 0)
    r.band[blockIdx.x][0] = above, r.band[blockIdx.x][1] = at, r.band[blockIdx.x][2] = count;
}

__global__ void topp_result_kernel(const TopKRow* rows, TopPBand* out) {
  const TopKRow& r = rows[blockIdx.x];
  if (threadIdx.x != 0) return;
  double sums[3] = {0.0, 0.0, 0.0};
  for (int b = 0; b < kTopKBlocks; ++b)
    for (int j = 0; j < 3; ++j) sums[j] += r.band[b][j];
  out[blockIdx.x] = {.above_mass = sums[0],
                     .boundary_mass = sums[1],
                     .boundary_count = static_cast<int32_t>(sums[2]),
                     .boundary = key_value(r.p_prefix)};
}

// A draw below a row's top ids (draw_below): kDrawBlocks blocks each sum the weights of one contiguous
// range of ids, then one block finds the range, the thread's stretch of it and the id where the running
// sum passes the target, each step in id order.
constexpr int kDrawBlocks = 64;
constexpr int kDrawThreads = 256;

__device__ __forceinline__ bool in_band(float v, float below, float at_least) {
  return v < below && v >= at_least;
}
__device__ __forceinline__ double weight_below(const float* row, int64_t i, float below, float at_least,
                                               double inv_t, double max_scaled) {
  const float v = row[i];
  return in_band(v, below, at_least) ? exp(static_cast<double>(v) * inv_t - max_scaled) : 0.0;
}

__global__ void __launch_bounds__(kDrawThreads)
    draw_below_sums_kernel(const float* __restrict__ row, int64_t limit, float below, float at_least,
                           double inv_t, double max_scaled, double* sums) {
  __shared__ double scratch[32];
  const int64_t range = (limit + kDrawBlocks - 1) / kDrawBlocks, begin = blockIdx.x * range,
                end = min(limit, begin + range);
  double sum = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
    sum += weight_below(row, i, below, at_least, inv_t, max_scaled);
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) sums[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kDrawThreads)
    draw_below_find_kernel(const float* __restrict__ row, int64_t limit, float below, float at_least,
                           double inv_t, double max_scaled, double target, const double* __restrict__ sums,
                           int32_t* out) {
  __shared__ double stretch_sums[kDrawThreads];
  __shared__ int64_t chosen_range;
  __shared__ double target_in_range;
  __shared__ int last_id[kDrawThreads];
  if (threadIdx.x == 0) {  // the range holding the target; past every weight (rounding), the last weighing
    double before = 0.0;
    chosen_range = -1;
    target_in_range = INFINITY;
    for (int b = 0; b < kDrawBlocks; ++b) {
      if (sums[b] <= 0.0) continue;
      chosen_range = b;
      if (target < before + sums[b]) {
        target_in_range = target - before;
        break;
      }
      before += sums[b];
    }
    if (chosen_range < 0) *out = -1;  // no id below the top
  }
  __syncthreads();
  if (chosen_range < 0) return;
  const int64_t range = (limit + kDrawBlocks - 1) / kDrawBlocks, begin = chosen_range * range,
                end = min(limit, begin + range);
  const int64_t stretch = (range + kDrawThreads - 1) / kDrawThreads, from = begin + threadIdx.x * stretch,
                to = min(end, from + stretch);
  double sum = 0.0;
  int last = -1;
  for (int64_t i = from; i < to; ++i) {
    const double w = weight_below(row, i, below, at_least, inv_t, max_scaled);
    sum += w;
    if (in_band(row[i], below, at_least)) last = static_cast<int>(i);
  }
  stretch_sums[threadIdx.x] = sum;
  last_id[threadIdx.x] = last;
  __syncthreads();
  if (threadIdx.x != 0) return;
  // The stretch holding the target, then the id in it; past every weight (rounding), the last id below.
  double before = 0.0;
  int t = 0;
  while (t < kDrawThreads - 1 && before + stretch_sums[t] <= target_in_range) before += stretch_sums[t++];
  const int64_t t_from = begin + t * stretch, t_to = min(end, t_from + stretch);
  for (int64_t i = t_from; i < t_to; ++i) {
    if (!in_band(row[i], below, at_least)) continue;
    before += weight_below(row, i, below, at_least, inv_t, max_scaled);
    if (target_in_range < before) {
      *out = static_cast<int32_t>(i);
      return;
    }
  }
  int fallback = -1;
  for (int u = 0; u < kDrawThreads; ++u) fallback = max(fallback, last_id[u]);
  *out = fallback;  // -1: no id below (the range chosen had none: rounding at the last range)
}

}  // namespace

namespace {

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

void embed_rows(const Matrix& table, const int32_t* tokens, int64_t t_count, float* out, void* stream) {
  const cudaStream_t s = as_stream(stream);
  const auto grid = static_cast<unsigned>(t_count);
  switch (table.type) {
    case Dtype::kBF16:
      embed_kernel<<<grid, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(table.data), tokens, table.cols,
                                        out);
      break;
    case Dtype::kF16:
      embed_kernel<<<grid, 256, 0, s>>>(static_cast<const __half*>(table.data), tokens, table.cols, out);
      break;
    case Dtype::kF32:
      embed_kernel<<<grid, 256, 0, s>>>(static_cast<const float*>(table.data), tokens, table.cols, out);
      break;
    case Dtype::kAffine:
      return affine::embed(table, tokens, t_count, out, stream);
  }
  check_launch("embed_rows");
}

void rms_norm_rows(const float* x, int64_t x_stride, const float* weight, float eps, int64_t rows, int64_t n,
                   float* out, int64_t out_stride, void* stream) {
  // One block per row. In registers (4 float4 per thread) where the row and its strides allow it.
  constexpr int kV = 4;
  const bool vectors = n % 4 == 0 && x_stride % 4 == 0 && out_stride % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(weight) % 16 == 0 && n <= 1024 * 4 * kV;
  if (vectors) {
    const int threads = std::max(32, static_cast<int>((n / 4 + kV - 1) / kV + 31) / 32 * 32);
    launch_pdl(rms_norm_regs_kernel<kV>, static_cast<unsigned>(rows), threads, 0, as_stream(stream), x,
               x_stride, weight, eps, static_cast<int>(n), out, out_stride);
    check_launch("rms_norm_rows");
    return;
  }
  // Else up to 1024 threads: a decode row (one block) is latency-bound, so use many lanes.
  const int threads = n >= 4096 ? 1024 : n >= 1024 ? 256 : 128;
  launch_pdl(rms_norm_kernel, static_cast<unsigned>(rows), threads, 0, as_stream(stream), x, x_stride, weight,
             eps, n, out, out_stride);
  check_launch("rms_norm_rows");
}

void add_inplace(float* x, const float* y, int64_t n, void* stream) {
  add_kernel<<<elementwise_blocks(n), 256, 0, as_stream(stream)>>>(x, y, n);
  check_launch("add_inplace");
}

void swiglu(const float* gate, const float* up, int64_t n, float* out, void* stream) {
  launch_pdl(swiglu_kernel, elementwise_blocks(n), 256, 0, as_stream(stream), gate, up, n, out);
  check_launch("swiglu");
}

void qk_norm_rope_store(float* qg, float* k, const float* v, const float* q_norm, const float* k_norm,
                        float eps, int64_t t_count, int64_t nq, int64_t nkv, int64_t head_dim,
                        int64_t rotary_dim, double rope_theta, const int32_t* pos, float* key_cache,
                        float* value_cache, void* stream) {
  const dim3 grid(static_cast<unsigned>(t_count), static_cast<unsigned>(nq + nkv));
  launch_pdl(qk_norm_rope_kernel, grid, 128, static_cast<size_t>(head_dim) * sizeof(float), as_stream(stream),
             qg, k, v, q_norm, k_norm, eps, nq, nkv, head_dim, rotary_dim, rope_theta, pos, key_cache,
             value_cache);
  check_launch("qk_norm_rope_store");
}

int64_t attention_scratch_bytes(int64_t t_count, int64_t nq, int64_t head_dim) {
  const int64_t heads = t_count * nq;
  return (heads * 4 + 255) / 256 * 256 + heads * kMaxSplits * (8 + head_dim * 4);
}

void attention(const float* qg, const float* key_cache, const float* value_cache, int64_t t_count, int64_t nq,
               int64_t nkv, int64_t head_dim, const int32_t* pos, float* o, void* scratch, void* stream) {
  const cudaStream_t s = as_stream(stream);
  if (nkv < 1 || nq % nkv != 0 || nq / nkv > 16)
    fail(ErrorKind::kUnsupported,
         "--device cuda: {} query heads over {} key-value heads (at most 16 per group)", nq, nkv);
  const int64_t group = nq / nkv;
  if (t_count >= kGemmMinRows) {
    const int tpw = static_cast<int>(16 / group);
    const dim3 tiles(static_cast<unsigned>((t_count + kFlashWarps * tpw - 1) / (kFlashWarps * tpw)),
                     static_cast<unsigned>(nkv));
    const size_t smem = static_cast<size_t>(flash_smem_words(head_dim)) * sizeof(uint32_t);
    auto launch = [&](auto kernel) {
      allow_shared_memory(kernel, smem, "attention_prefill");
      kernel<<<tiles, kFlashWarps * 32, smem, s>>>(qg, key_cache, value_cache, t_count, nq, nkv, tpw, pos, o);
    };
    switch (head_dim) {
      case 32:
        launch(attention_prefill_kernel<32>);
        break;
      case 64:
        launch(attention_prefill_kernel<64>);
        break;
      case 128:
        launch(attention_prefill_kernel<128>);
        break;
      case 256:
        launch(attention_prefill_kernel<256>);
        break;
      default:
        fail(ErrorKind::kUnsupported, "--device cuda: head_dim {} is not supported (32, 64, 128, 256)",
             head_dim);
    }
    check_launch("attention_prefill");
    return;
  }
  if (scratch == nullptr) fail(ErrorKind::kInternal, "attention: no scratch for the split keys");
  const int heads_per_block = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
  const int64_t tiles = nkv * (group / heads_per_block);
  // Enough splits for about two blocks per SM on a long row (a short one uses fewer: split_keys).
  const int splits =
      static_cast<int>(std::clamp<int64_t>((2 * multiprocessor_count() + tiles - 1) / tiles, 1, kMaxSplits));
  auto* counters = static_cast<int32_t*>(scratch);
  const int64_t heads = t_count * nq;
  auto* ml = reinterpret_cast<float2*>(static_cast<char*>(scratch) + (heads * 4 + 255) / 256 * 256);
  auto* acc = reinterpret_cast<float*>(ml + heads * kMaxSplits);
  const dim3 grid(static_cast<unsigned>(t_count), static_cast<unsigned>(tiles),
                  static_cast<unsigned>(splits));
  auto launch = [&](auto kernel) {
    launch_pdl(kernel, grid, kSplitWarps * 32, 0, s, qg, key_cache, value_cache, static_cast<int>(nq),
               static_cast<int>(nkv), splits, pos, o, counters, ml, acc);
  };
  auto by_heads = [&](auto epl) {
    constexpr int EPL = decltype(epl)::value;
    if (heads_per_block == 4) return launch(attention_split_kernel<EPL, 4>);
    if (heads_per_block == 2) return launch(attention_split_kernel<EPL, 2>);
    launch(attention_split_kernel<EPL, 1>);
  };
  switch (head_dim) {
    case 32:
      by_heads(std::integral_constant<int, 1>{});
      break;
    case 64:
      by_heads(std::integral_constant<int, 2>{});
      break;
    case 128:
      by_heads(std::integral_constant<int, 4>{});
      break;
    case 256:
      by_heads(std::integral_constant<int, 8>{});
      break;
    default:
      fail(ErrorKind::kUnsupported, "--device cuda: head_dim {} is not supported (32, 64, 128, 256)",
           head_dim);
  }
  check_launch("attention");
}

void deltanet_conv(const float* qkv, float* conv_state, const float* conv_weight, int64_t t_count,
                   int64_t channels, int64_t kc, float* x, float* conv_before, void* stream) {
  if (kc > kMaxConvKernel)
    fail(ErrorKind::kUnsupported, "--device cuda: conv kernel size {} > {}", kc, kMaxConvKernel);
  if (t_count >= kGemmMinRows) {
    const dim3 grid(blocks_for(channels, 256), static_cast<unsigned>((t_count + kConvRows - 1) / kConvRows));
    conv_rows_kernel<<<grid, 256, 0, as_stream(stream)>>>(qkv, conv_state, conv_weight, t_count, channels, kc,
                                                          x);
    conv_kernel<<<blocks_for(channels, 256), 256, 0, as_stream(stream)>>>(
        qkv, conv_state, conv_weight, t_count, channels, kc, nullptr, conv_before);
  } else {
    launch_pdl(conv_kernel, blocks_for(channels, 256), 256, 0, as_stream(stream), qkv, conv_state,
               conv_weight, t_count, channels, kc, x, conv_before);
  }
  check_launch("deltanet_conv");
}

void deltanet_prepare(float* x, const float* b, const float* a, const float* a_log, const float* dt_bias,
                      int64_t t_count, int64_t hk, int64_t hv, int64_t dk, int64_t conv_dim, float* beta,
                      float* g, void* stream) {
  const dim3 grid(static_cast<unsigned>(t_count), static_cast<unsigned>(2 * hk + 1));
  launch_pdl(deltanet_prepare_kernel, grid, 128, 0, as_stream(stream), x, b, a, a_log, dt_bias, hk, hv, dk,
             conv_dim, beta, g);
  check_launch("deltanet_prepare");
}

void deltanet_conv_prepare(const float* qkv, float* conv_state, const float* conv_weight, const float* b,
                           const float* a, const float* a_log, const float* dt_bias, int64_t t_count,
                           int64_t hk, int64_t hv, int64_t dk, int64_t channels, int64_t kc, float* x,
                           float* conv_before, float* beta, float* g, void* stream) {
  if (t_count > kConvPrepareMaxRows || dk > kConvPrepareThreads) {  // prompts: the two kernels
    deltanet_conv(qkv, conv_state, conv_weight, t_count, channels, kc, x, conv_before, stream);
    deltanet_prepare(x, b, a, a_log, dt_bias, t_count, hk, hv, dk, channels, beta, g, stream);
    return;
  }
  if (t_count < 1) return;
  if (kc > kMaxConvKernel)
    fail(ErrorKind::kUnsupported, "--device cuda: conv kernel size {} > {}", kc, kMaxConvKernel);
  const int64_t v_blocks = (channels - 2 * hk * dk + kConvPrepareThreads - 1) / kConvPrepareThreads;
  launch_pdl(conv_prepare_kernel, static_cast<unsigned>(2 * hk + v_blocks + 1), kConvPrepareThreads, 0,
             as_stream(stream), qkv, conv_state, conv_weight, b, a, a_log, dt_bias, static_cast<int>(t_count),
             static_cast<int>(hk), static_cast<int>(hv), static_cast<int>(dk), static_cast<int>(channels),
             static_cast<int>(kc), x, conv_before, beta, g, early_loads());
  check_launch("deltanet_conv_prepare");
}

void delta_rule(const float* x, const float* g, const float* beta, const float* s_in, float* s_out,
                float* s_before, float* o, int64_t t_count, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                int64_t conv_dim, void* stream) {
  const int threads = 32;  // one warp per block, kDeltaColumns columns: many blocks (latency-bound)
  static_assert(kDeltaColumns * kDeltaParts == threads);
  const dim3 grid(static_cast<unsigned>(hv), blocks_for(dv, kDeltaColumns));
  const cudaStream_t s = as_stream(stream);
  switch (dk) {
#define MTPX_DELTA_CASE(DK)                                                                               \
  case DK:                                                                                                \
    launch_pdl(delta_rule_kernel<DK>, grid, threads, 0, s, x, g, beta, s_in, s_out, s_before, o, t_count, \
               hk, hv, dv, conv_dim, early_loads());                                                      \
    break;
    MTPX_DELTA_CASE(16)
    MTPX_DELTA_CASE(32)
    MTPX_DELTA_CASE(64)
    MTPX_DELTA_CASE(128)
#undef MTPX_DELTA_CASE
    default:
      fail(ErrorKind::kUnsupported,
           "--device cuda: linear_key_head_dim {} is not supported (16, 32, 64, 128)", dk);
  }
  check_launch("delta_rule");
}

void deltanet_rollback(const DeltaNetRollbackLayer* layers, int64_t count, int64_t keep, int64_t hk,
                       int64_t hv, int64_t dk, int64_t dv, int64_t conv_dim, int64_t kc, void* stream) {
  const cudaStream_t s = as_stream(stream);
  for (int64_t first = 0; first < count; first += kRollbackLayersPerLaunch) {
    const int64_t n = std::min<int64_t>(count - first, kRollbackLayersPerLaunch);
    RollbackLayers chunk{};
    std::copy_n(layers + first, n, chunk.layer);
    const auto z = static_cast<unsigned>(n);
    const dim3 grid(static_cast<unsigned>(hv), blocks_for(dv, kDeltaColumns), z);
    switch (dk) {
#define MTPX_REPLAY_CASE(DK)                                                        \
  case DK:                                                                          \
    delta_replay_kernel<DK><<<grid, 32, 0, s>>>(chunk, keep, hk, hv, dv, conv_dim); \
    break;
      MTPX_REPLAY_CASE(16)
      MTPX_REPLAY_CASE(32)
      MTPX_REPLAY_CASE(64)
      MTPX_REPLAY_CASE(128)
#undef MTPX_REPLAY_CASE
      default:
        fail(ErrorKind::kUnsupported,
             "--device cuda: linear_key_head_dim {} is not supported (16, 32, 64, 128)", dk);
    }
    conv_replay_kernel<<<dim3(blocks_for(conv_dim, 256), z), 256, 0, s>>>(chunk, keep, conv_dim, kc);
  }
  check_launch("deltanet_rollback");
}

int64_t delta_rule_chunked_scratch_bytes(int64_t t_count, int64_t hv) {
  const int64_t chunks = (t_count + kDeltaChunkRows - 1) / kDeltaChunkRows;
  return hv * chunks * (2 * kDeltaChunkRows * kDeltaChunkRows + kDeltaChunkRows) *
         static_cast<int64_t>(sizeof(float));
}

void delta_rule_chunked(const float* x, const float* g, const float* beta, float* state, float* o,
                        int64_t t_count, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t conv_dim,
                        void* scratch, void* stream) {
  if (t_count <= 0) return;
  const cudaStream_t s = as_stream(stream);
  const int64_t chunks = (t_count + kDeltaChunkRows - 1) / kDeltaChunkRows;
  auto* tinv = static_cast<float*>(scratch);
  float* p = tinv + hv * chunks * kDeltaChunkRows * kDeltaChunkRows;
  float* g_cum = p + hv * chunks * kDeltaChunkRows * kDeltaChunkRows;
  const dim3 matrices_grid(static_cast<unsigned>(hv), static_cast<unsigned>(chunks));
  const dim3 scan_grid(static_cast<unsigned>(hv), blocks_for(dv, kDeltaScanColumns));
  auto launch = [&](auto matrices, auto scan) {
    const size_t matrices_smem = static_cast<size_t>(delta_matrices_smem_floats(dk)) * sizeof(float);
    const size_t scan_smem = static_cast<size_t>(delta_scan_smem_floats(dk)) * sizeof(float);
    allow_shared_memory(matrices, matrices_smem, "delta_rule_chunked");
    allow_shared_memory(scan, scan_smem, "delta_rule_chunked");
    matrices<<<matrices_grid, kDeltaMatricesThreads, matrices_smem, s>>>(x, g, beta, t_count, hk, hv,
                                                                         conv_dim, tinv, p, g_cum);
    scan<<<scan_grid, kDeltaScanThreads, scan_smem, s>>>(x, beta, tinv, p, g_cum, state, o, t_count, hk, hv,
                                                         dv, conv_dim);
  };
  switch (dk) {
    case 16:
      launch(delta_chunk_matrices_kernel<16>, delta_chunk_scan_kernel<16>);
      break;
    case 32:
      launch(delta_chunk_matrices_kernel<32>, delta_chunk_scan_kernel<32>);
      break;
    case 64:
      launch(delta_chunk_matrices_kernel<64>, delta_chunk_scan_kernel<64>);
      break;
    case 128:
      launch(delta_chunk_matrices_kernel<128>, delta_chunk_scan_kernel<128>);
      break;
    default:
      fail(ErrorKind::kUnsupported,
           "--device cuda: linear_key_head_dim {} is not supported (16, 32, 64, 128)", dk);
  }
  check_launch("delta_rule_chunked");
}

void gated_rms_norm(float* o, const float* z, const float* weight, float eps, int64_t rows, int64_t n,
                    void* stream) {
  launch_pdl(gated_rms_norm_kernel, static_cast<unsigned>(rows), 128, 0, as_stream(stream), o, z, weight, eps,
             n);
  check_launch("gated_rms_norm");
}

void argmax_rows(const float* logits, int64_t rows, int64_t vocab, int64_t limit, int32_t* out,
                 void* stream) {
  launch_pdl(argmax_kernel, static_cast<unsigned>(rows), 1024, 0, as_stream(stream), logits, vocab, limit,
             out);
  check_launch("argmax_rows");
}

int64_t topk_scratch_bytes(int64_t rows) { return rows * static_cast<int64_t>(sizeof(TopKRow)); }

void topk_candidates(const float* logits, int64_t rows, int64_t vocab, int64_t limit, int64_t k, int64_t cap,
                     double inv_temperature, int32_t* ids, float* values, int32_t* counts, double* masses,
                     void* scratch, void* stream) {
  cudaStream_t s = as_stream(stream);
  auto* state = static_cast<TopKRow*>(scratch);
  const auto n = static_cast<unsigned>(rows);
  topk_init_kernel<<<n, 256, 0, s>>>(state, k);
  for (int shift = 24; shift >= 0; shift -= 8) {
    topk_histogram_kernel<<<dim3(kTopKBlocks, n), 256, 0, s>>>(logits, vocab, limit, shift, state);
    topk_digit_kernel<<<n, 256, 0, s>>>(shift, state);
  }
  topk_collect_kernel<<<dim3(kTopKBlocks, n), 256, 0, s>>>(logits, vocab, limit, cap, state, ids, values);
  if (inv_temperature > 0.0)
    topk_mass_kernel<<<dim3(kTopKBlocks, n), 256, 0, s>>>(logits, vocab, limit, inv_temperature, state);
  topk_counts_kernel<<<n, 32, 0, s>>>(state, counts, inv_temperature > 0.0 ? masses : nullptr);
  check_launch("topk_candidates");
}

void topp_band(const float* logits, int64_t rows, int64_t vocab, int64_t limit, double inv_temperature,
               double top_p, TopPBand* out, void* scratch, void* stream) {
  cudaStream_t s = as_stream(stream);
  auto* state = static_cast<TopKRow*>(scratch);
  const auto n = static_cast<unsigned>(rows);
  // Fixed point with room for `limit` weights of at most 1 in 63 bits.
  int bits = 0;
  while ((int64_t{1} << bits) <= limit) ++bits;
  const double scale = std::ldexp(1.0, 63 - bits);
  topp_init_kernel<<<n, 256, 0, s>>>(state);
  for (int shift = 24; shift >= 0; shift -= 8) {
    topp_histogram_kernel<<<dim3(kTopKBlocks, n), 256, 0, s>>>(logits, vocab, limit, shift, inv_temperature,
                                                               scale, state);
    topp_digit_kernel<<<n, 256, 0, s>>>(shift, top_p, state);
  }
  topp_band_sums_kernel<<<dim3(kTopKBlocks, n), 256, 0, s>>>(logits, vocab, limit, inv_temperature, state);
  topp_result_kernel<<<n, 32, 0, s>>>(state, out);
  check_launch("topp_band");
}

int64_t draw_below_scratch_bytes() { return kDrawBlocks * static_cast<int64_t>(sizeof(double)); }

void draw_below(const float* row, int64_t limit, float below, float at_least, double inv_temperature,
                double max_scaled, double target, void* scratch, int32_t* out, void* stream) {
  cudaStream_t s = as_stream(stream);
  auto* sums = static_cast<double*>(scratch);
  draw_below_sums_kernel<<<kDrawBlocks, kDrawThreads, 0, s>>>(row, limit, below, at_least, inv_temperature,
                                                              max_scaled, sums);
  draw_below_find_kernel<<<1, kDrawThreads, 0, s>>>(row, limit, below, at_least, inv_temperature, max_scaled,
                                                    target, sums, out);
  check_launch("draw_below");
}

}  // namespace mtpx::cuda
