// Group-wise affine (MLX) quantized matrices on the GPU. A row's codes are a little-endian bit stream;
// 32 consecutive codes take 4 * bits bytes, always 4-byte aligned (cols is a multiple of the group size,
// itself a multiple of 32), so a lane reads its 32 codes as `bits` whole words.
//
// Row kernels: a warp computes 2 output rows for all M (<= 8 per launch) activation rows; lane l takes the
// chunks of 8 codes k = 8l + 256i, i = 0, 1, ... (as the float kernels: a warp's loads of x and of the codes
// are contiguous; a chunk lies in one group, groups being >= 32 codes). Per row and chunk:
//   xsum = sum_c x_c, dot1 = sum_c (1 + c / 2^B) x_c   (fixed orders)
//   acc = fma(bias, xsum, acc); acc = fma(scale * 2^B, dot1 - xsum, acc)
// since sum_c code_c x_c = 2^B (dot1 - xsum); then a fixed butterfly over the lanes. Neither the number of
// activation rows nor which rows share a warp changes any of these operations: batch-invariant, as
// kernels.h requires. 1 + c / 2^B is the float whose mantissa's top B bits are c: one shift and one
// bitwise op per code, no conversion instruction. The offset 1 is at most 2^B / (2^B - 1) times the
// code term, so the subtraction costs no precision worth the name (unlike the exponent trick
// float(0x4B000000 | c) - 2^23, which would need a subtraction per code to stay exact).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "backend/cuda/affine.h"
#include "backend/cuda/affine_math.cuh"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/runtime.h"
#include "util/error.h"

namespace mtpx::cuda::affine {
namespace {

constexpr int kMaxGroup = 4;
constexpr int kMaxRowsPerLaunch = 8;  // activation rows per launch; more run as several launches

struct AffineGroup {
  const uint32_t* codes[kMaxGroup];
  const void* scales[kMaxGroup];  // bf16 or float32 (scales_f32)
  const void* biases[kMaxGroup];
  float* y[kMaxGroup];
  int rows[kMaxGroup];
  int warps_before[kMaxGroup + 1];
  int count;
  int cols;
  int groups;      // per row
  int group_log2;  // group_size = 1 << group_log2
  bool scales_f32;
  uint32_t prefetch_bytes;  // of each row's codes, before griddep_wait (device_math.cuh)
};

__device__ __forceinline__ float code_to_float(uint32_t c) {
  return __uint_as_float(0x4B000000u | c) - 8388608.0f;
}

template <int B, int M, int MODE>
__global__ void __launch_bounds__(kGemvWarps * 32)
    affine_rows_kernel(const AffineGroup g, const float* __restrict__ x, int x_stride) {
  constexpr int R = 2;  // weight rows per warp (SwiGLU: one gate row and one up row)
  constexpr float kCodeScale = static_cast<float>(1 << B);
  const int warp = blockIdx.x * kGemvWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= g.warps_before[g.count]) return;
  int j = 0;
  while (warp >= g.warps_before[j + 1]) ++j;
  const int per_matrix = MODE == kSwiglu ? 1 : R;
  const int row0 = (warp - g.warps_before[j]) * per_matrix;
  const int cols = g.cols, words_per_row = cols / 32 * B;
  const uint32_t* wr[R];
  size_t sb[R];  // index of the row's first scale and bias
  const void *scales[R], *biases[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int mi = MODE == kSwiglu ? i : j;
    const int r =
        min(MODE == kSwiglu ? row0 : row0 + i, g.rows[j] - 1);  // past the end: computed, not stored
    wr[i] = g.codes[mi] + static_cast<size_t>(r) * words_per_row;
    sb[i] = static_cast<size_t>(r) * g.groups;
    scales[i] = g.scales[mi], biases[i] = g.biases[mi];
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
#pragma unroll 4  // 4 chunks' loads in flight per lane
  for (int k = lane * 8; k < cols; k += 256) {
    uint64_t w[R];
    float scale[R], bias[R];
    const int grp = k >> g.group_log2;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      w[i] = load_chunk<B>(wr[i], k / 8);
      scale[i] = scale_at(scales[i], sb[i] + grp, g.scales_f32) * kCodeScale;
      bias[i] = scale_at(biases[i], sb[i] + grp, g.scales_f32);
    }
    float q[R][8];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int c = 0; c < 8; ++c) q[i][c] = code_plus_one<B>(w[i], c);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float* xm = x + static_cast<size_t>(m) * x_stride + k;
      const float4 a = __ldg(reinterpret_cast<const float4*>(xm));
      const float4 b = __ldg(reinterpret_cast<const float4*>(xm) + 1);
      const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      float xsum = 0.0f;
#pragma unroll
      for (int c = 0; c < 8; ++c) xsum += xv[c];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; ++c) dot = fmaf(q[i][c], xv[c], dot);
        acc[i][m] = fmaf(scale[i], dot - xsum, fmaf(bias[i], xsum, acc[i][m]));
      }
    }
  }
  finish_rows<M, MODE, R>(acc, g, j, row0, per_matrix, lane);
}

// ---- 4-bit rows with int8 activations (the CPU's kAvx512Vnni scheme, quant_matmul.h). The float kernel
// above spends ~3 instructions per code and reads 4 bytes of x per half byte of weights: it streamed at
// 0.7-1.1 TB/s. Here each block first quantizes the M activation rows into shared memory, per run of 32
// values exactly as the CPU does: s = max|x| / 127 (0 below 1e-30), xq = x * (1 / s) rounded to nearest
// even and clamped to [-127, 127], and the run's float sum. A lane then takes whole runs: 16 bytes of codes
// per row (the run's 32 codes, one group), split into low and high nibbles by two bitwise ops per word and
// multiplied with xq by dp4a (the int8 bytes are stored even-index first to match the nibbles):
//   d = sum_c code_c * xq_c   (exact in int32: |d| <= 32 * 15 * 127)
//   acc = fma(bias_g, xsum_run, acc); acc = fma(scale_g * s_run, d, acc)      (runs in order)
// then the fixed butterfly. Each activation row's quantization and sums depend on that row only, and its
// runs are visited in the same order for any M: batch-invariant. The blocks are persistent (a few per SM,
// looping over the row tasks) so that x is quantized a few hundred times per product, not once per row.
constexpr int kRun = 32;  // values per activation scale (kActivationBlock on the CPU)

__device__ __forceinline__ uint32_t pack_int8(float a, float b, float c, float d, float inverse) {
  auto q = [&](float v) {
    const int i = max(-127, min(127, __float2int_rn(v * inverse)));
    return static_cast<uint32_t>(i) & 0xffu;
  };
  return q(a) | q(b) << 8 | q(c) << 16 | q(d) << 24;
}

// Thread t quantizes runs t, t + blockDim.x, ... of the M rows into shared memory.
template <int M>
__device__ void quantize_runs(const float* __restrict__ x, int x_stride, int runs, int4* q, float* scale,
                              float* sum) {
  for (int u = threadIdx.x; u < M * runs; u += blockDim.x) {
    const int m = u / runs, r = u % runs;
    const float4* src = reinterpret_cast<const float4*>(x + static_cast<size_t>(m) * x_stride + r * kRun);
    float v[kRun];
#pragma unroll
    for (int i = 0; i < kRun / 4; ++i) {
      const float4 f = src[i];
      v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
    float peak = 0.0f, total = 0.0f;
#pragma unroll
    for (int i = 0; i < kRun; ++i) peak = fmaxf(peak, fabsf(v[i])), total += v[i];
    const bool zeros = peak < 1e-30f;
    const float s = zeros ? 0.0f : peak / 127.0f, inverse = zeros ? 0.0f : 1.0f / s;
    uint32_t even[4], odd[4];  // word c: values 8c + 0, 2, 4, 6 (even) and 8c + 1, 3, 5, 7 (odd)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      even[c] = pack_int8(v[8 * c], v[8 * c + 2], v[8 * c + 4], v[8 * c + 6], inverse);
      odd[c] = pack_int8(v[8 * c + 1], v[8 * c + 3], v[8 * c + 5], v[8 * c + 7], inverse);
    }
    // Word order as the codes': word c of the run's 16 bytes holds codes 8c .. 8c + 7.
    q[(2 * m) * runs + r] = make_int4(even[0], odd[0], even[1], odd[1]);
    q[(2 * m + 1) * runs + r] = make_int4(even[2], odd[2], even[3], odd[3]);
    scale[m * runs + r] = s;
    sum[m * runs + r] = total;
  }
}

// R weight rows per warp (swiglu: R/2 gate + R/2 up rows), U runs in flight per lane, S warps per task.
template <int M, int MODE, int R, int U, int S>
__global__ void __launch_bounds__(kGemvWarps * 32)
    affine4_int8_rows(const AffineGroup g, const float* __restrict__ x, int x_stride) {
  extern __shared__ int4 shared[];
  __shared__ float partial[S > 1 ? kGemvWarps : 1][R][M];  // S > 1: each warp's sums, added in slice order
  const int runs = g.cols / kRun, lane = threadIdx.x % 32, warp_in_block = threadIdx.x / 32;
  const int total_tasks = g.warps_before[g.count];
  int4* xq = shared;  // [M][2][runs]: per run, the words of even-index bytes, then of odd-index bytes
  float* xscale = reinterpret_cast<float*>(xq + 2 * M * runs);
  float* xsum = xscale + M * runs;
  const int per_matrix = MODE == kSwiglu ? R / 2 : R;
  const int words_per_row = g.cols / 8;
  // A task is R weight rows; S warps of a block share one, warp s taking the runs of slice s.
  constexpr int per_block = kGemvWarps / S;
  // (S == 1 spelled out so that its code is the one-warp-per-task kernel's, register for register.)
  const int slice = S == 1 ? 0 : warp_in_block % S;
  const int slice_runs = (runs + S - 1) / S;
  const int run_begin = S == 1 ? 0 : min(runs, slice * slice_runs);
  const int run_end = S == 1 ? runs : min(runs, run_begin + slice_runs);
  // The rows of task `task`: matrix j, rows row0 .. row0 + per_matrix - 1 (past the end: the last row,
  // computed and not stored).
  auto rows_of = [&](int task, int& j, int& row0, const uint4*(&wr)[R], size_t(&sb)[R]) {
    j = 0;
    while (task >= g.warps_before[j + 1]) ++j;
    row0 = (task - g.warps_before[j]) * per_matrix;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int mi = MODE == kSwiglu ? (i < R / 2 ? 0 : 1) : j;
      const int r = min(row0 + (MODE == kSwiglu ? i % (R / 2) : i), g.rows[j] - 1);
      wr[i] = reinterpret_cast<const uint4*>(g.codes[mi] + static_cast<size_t>(r) * words_per_row);
      sb[i] = static_cast<size_t>(r) * g.groups;
    }
  };
  const int first = blockIdx.x * per_block + warp_in_block / S;
  if (first < total_tasks) {
    int j, row0;
    const uint4* wr[R];
    size_t sb[R];
    rows_of(first, j, row0, wr, sb);
    const uint32_t bytes =
        S == 1 ? g.prefetch_bytes
               : min(g.prefetch_bytes / S / 16 * 16, static_cast<uint32_t>(run_end - run_begin) * 16);
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (lane == i) prefetch_l2(wr[i] + run_begin, bytes);
  }
  griddep_wait();
  griddep_launch_dependents();
  quantize_runs<M>(x, x_stride, runs, xq, xscale, xsum);
  __syncthreads();
  // S > 1: the whole block takes each step (its warps meet at __syncthreads), tasks past the end idle.
  for (int step = S == 1 ? first : blockIdx.x * per_block; step < total_tasks;
       step += gridDim.x * per_block) {
    const int task = S == 1 ? step : step + warp_in_block / S;
    int j, row0;
    float acc[R][M];
    auto zero = [&] {
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[i][m] = 0.0f;
    };
    if constexpr (S > 1) zero();  // an idle warp's share of the sums
    if (S == 1 || task < total_tasks) {
      const uint4* wr[R];
      size_t sb[R];
      rows_of(task, j, row0, wr, sb);
      const void* scales[R];
      const void* biases[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int mi = MODE == kSwiglu ? (i < R / 2 ? 0 : 1) : j;
        scales[i] = g.scales[mi], biases[i] = g.biases[mi];
      }
      if constexpr (S == 1) zero();  // (here, as before slices: the same registers)
#pragma unroll U
      for (int r = run_begin + lane; r < run_end; r += 32) {
        const int grp = (r * kRun) >> g.group_log2;
        uint32_t lo[R][4], hi[R][4];
        float scale[R], bias[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const uint4 w = __ldg(wr[i] + r);
          const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int c = 0; c < 4; ++c)
            lo[i][c] = words[c] & 0x0f0f0f0fu, hi[i][c] = (words[c] >> 4) & 0x0f0f0f0fu;
          scale[i] = scale_at(scales[i], sb[i] + grp, g.scales_f32);
          bias[i] = scale_at(biases[i], sb[i] + grp, g.scales_f32);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const int4 a = xq[(2 * m) * runs + r], b = xq[(2 * m + 1) * runs + r];
          const int even[4] = {a.x, a.z, b.x, b.z}, odd[4] = {a.y, a.w, b.y, b.w};
          const float s = xscale[m * runs + r], total = xsum[m * runs + r];
#pragma unroll
          for (int i = 0; i < R; ++i) {
            int d = 0;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              d = __dp4a(static_cast<int>(lo[i][c]), even[c], d);
              d = __dp4a(static_cast<int>(hi[i][c]), odd[c], d);
            }
            acc[i][m] = fmaf(scale[i] * s, static_cast<float>(d), fmaf(bias[i], total, acc[i][m]));
          }
        }
      }
      // finish_rows (device_math.cuh), written out: called here it moved the register allocation of the
      // several-row variants (M = 3: 128 -> 136 registers, one block per SM instead of two).
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[i][m] = warp_sum(acc[i][m]);
    }
    if constexpr (S > 1) {  // the slices' sums, added in slice order by the task's first warp
      if (lane == 0)
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int m = 0; m < M; ++m) partial[warp_in_block][i][m] = acc[i][m];
      __syncthreads();
      if (slice == 0 && lane == 0)
        for (int s = 1; s < S; ++s)
#pragma unroll
          for (int i = 0; i < R; ++i)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[i][m] += partial[warp_in_block + s][i][m];
      __syncthreads();  // partial is written again by the next task
    }
    if (lane != 0 || slice != 0 || (S > 1 && task >= total_tasks)) continue;
    float* y = g.y[j];
#pragma unroll
    for (int i = 0; i < per_matrix; ++i) {
      const int r = row0 + i;
      if (r >= g.rows[j]) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float* out = y + static_cast<size_t>(m) * g.rows[j] + r;
        if constexpr (MODE == kSwiglu)
          *out = silu(acc[i][m]) * acc[i + R / 2][m];
        else if constexpr (MODE == kAccumulate)
          *out += acc[i][m];
        else
          *out = acc[i][m];
      }
    }
  }
}

// Shared memory of affine4_int8_rows for M activation rows of `cols` values.
size_t int8_activation_bytes(int m, int cols) {
  const size_t runs = static_cast<size_t>(cols / kRun);
  return static_cast<size_t>(m) * runs * (2 * sizeof(int4) + 2 * sizeof(float));
}
// At most this much per block (of the 227 KiB an SM of sm_90 offers one block).
constexpr size_t kMaxInt8ActivationBytes = 200 << 10;

template <int M, int MODE, int R, int U, int S>
void launch_int8(const AffineGroup& g, const float* x, int x_stride, int total_tasks, cudaStream_t s) {
  auto kernel = affine4_int8_rows<M, MODE, R, U, S>;
  static const bool configured = [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kMaxInt8ActivationBytes)) == cudaSuccess;
  }();
  if (!configured) fail(ErrorKind::kInternal, "CUDA: cannot give the int8 row kernel its shared memory");
  const size_t smem = int8_activation_bytes(M, g.cols);
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGemvWarps * 32, smem) != cudaSuccess ||
      per_sm < 1)
    fail(ErrorKind::kInternal, "CUDA: the int8 row kernel fits no SM ({} bytes of shared memory)", smem);
  constexpr int per_block = kGemvWarps / S;
  const int blocks = std::min((total_tasks + per_block - 1) / per_block, per_sm * multiprocessor_count());
  launch_pdl(kernel, static_cast<unsigned>(blocks), kGemvWarps * 32, smem, s, g, x, x_stride);
}

// Any bits (2..8): one row per warp, codes read bit by bit from the words, the same chunks per lane as the
// fast kernel; same per-row order for any M.
template <int MODE>
__global__ void affine_rows_generic(const AffineGroup g, const float* __restrict__ x, int x_stride,
                                    int m_count, int bits) {
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  const int warp = blockIdx.x * kGemvWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= g.warps_before[g.count]) return;
  int j = 0;
  while (warp >= g.warps_before[j + 1]) ++j;
  const int r = warp - g.warps_before[j];
  const int cols = g.cols, words_per_row = cols / 32 * bits;
  const uint32_t mask = (1u << bits) - 1u;
  for (int m = 0; m < m_count; ++m) {
    const float* xm = x + static_cast<size_t>(m) * x_stride;
    float result[2];
    for (int i = 0; i < (MODE == kSwiglu ? 2 : 1); ++i) {
      const int mi = MODE == kSwiglu ? i : j;
      const uint32_t* wr = g.codes[mi] + static_cast<size_t>(r) * words_per_row;
      const size_t sb = static_cast<size_t>(r) * g.groups;
      float acc = 0.0f;
      for (int k = lane * 8; k < cols; k += 256) {
        float dot = 0.0f, xsum = 0.0f;
        for (int c = 0; c < 8; ++c) {
          const int bit = (k + c) * bits, word = bit / 32, shift = bit % 32;
          uint32_t v = wr[word] >> shift;
          if (shift + bits > 32) v |= wr[word + 1] << (32 - shift);
          dot = fmaf(code_to_float(v & mask), xm[k + c], dot);
          xsum += xm[k + c];
        }
        const int grp = k >> g.group_log2;
        acc = fmaf(scale_at(g.biases[mi], sb + grp, g.scales_f32), xsum,
                   fmaf(scale_at(g.scales[mi], sb + grp, g.scales_f32), dot, acc));
      }
      result[i] = warp_sum(acc);
    }
    if (lane != 0) continue;
    float* out = g.y[j] + static_cast<size_t>(m) * g.rows[j] + r;
    if constexpr (MODE == kSwiglu)
      *out = silu(result[0]) * result[1];
    else if constexpr (MODE == kAccumulate)
      *out += result[0];
    else
      *out = result[0];
  }
}

// Warps that share a task of the int8 row kernel: a product of few rows (the residual updates: 4096 rows of
// 4096 or 12288 columns on the 9B shape, 2048 tasks of 2 rows, 16 warps per SM) splits each row's runs
// over 2 warps, so that twice as many loads are in flight. A function of the matrix shape only, never of
// the activation rows: each row's sum takes the same order in every launch (batch invariance).
int int8_slices(int mode, int64_t total_rows, int runs) {
  if (mode == kSwiglu || !int8_row_slices()) return 1;
  const int64_t resident_warps = int64_t{4} * kGemvWarps * multiprocessor_count();
  return total_rows <= resident_warps && runs >= 2 * 32 ? 2 : 1;
}

// The 4-bit rows with int8 activations, in launches of at most 8 activation rows and as many as fit the
// shared memory (each row's arithmetic is the same in any launch).
template <int MODE>
void launch_rows_int8(AffineGroup g, const float* x, int64_t m, int64_t total_rows, cudaStream_t s) {
  // Rows per warp and runs in flight per lane, measured on the 9B shape's 4-bit decode step (H200,
  // BENCHMARKS.md, session 14): one activation row runs fastest with the most warps (2 rows per warp, 1 + 1
  // for SwiGLU) and 4 runs in flight, 336 against 317 tok/s for 4 rows per warp and 2 runs (278 for 4 and 4);
  // several rows (verify windows) share each x load among 4 weight rows where there are enough rows.
  const int64_t fit = static_cast<int64_t>(kMaxInt8ActivationBytes / int8_activation_bytes(1, g.cols));
  const int64_t per_launch = std::min<int64_t>(kMaxRowsPerLaunch, fit);
  if (per_launch < 1) fail(ErrorKind::kUnsupported, "CUDA: 4-bit rows of {} columns", g.cols);
  const int slices = int8_slices(MODE, total_rows, g.cols / kRun);
  for (int64_t m0 = 0; m0 < m; m0 += per_launch) {
    const int mc = static_cast<int>(std::min<int64_t>(per_launch, m - m0));
    // Split rows (slices == 2) keep 2-row tasks: the launch below compiles no 4-row split kernel.
    const bool four = mc > 1 && slices == 1 && (MODE == kSwiglu || total_rows >= 8192);
    const int per_matrix = MODE == kSwiglu ? (four ? 2 : 1) : four ? 4 : 2;
    AffineGroup part = g;
    part.warps_before[0] = 0;
    for (int i = 0; i < g.count; ++i) {
      part.warps_before[i + 1] = part.warps_before[i] + (g.rows[i] + per_matrix - 1) / per_matrix;
      part.y[i] = g.y[i] + m0 * g.rows[i];
    }
    const int total_tasks = part.warps_before[g.count];
    const float* xp = x + m0 * g.cols;
    auto launch = [&](auto m_constant) {
      constexpr int M = decltype(m_constant)::value;
      auto with_slices = [&](auto s_constant) {
        constexpr int S = decltype(s_constant)::value;
        if constexpr (M == 1)
          launch_int8<M, MODE, 2, 4, S>(part, xp, g.cols, total_tasks, s);
        else if constexpr (S > 1)
          launch_int8<M, MODE, 2, 2, S>(part, xp, g.cols, total_tasks, s);
        else if (four)
          launch_int8<M, MODE, 4, 2, S>(part, xp, g.cols, total_tasks, s);
        else if constexpr (MODE != kSwiglu)
          launch_int8<M, MODE, 2, 2, S>(part, xp, g.cols, total_tasks, s);
      };
      if constexpr (MODE == kSwiglu)
        with_slices(std::integral_constant<int, 1>{});
      else if (slices == 2)
        with_slices(std::integral_constant<int, 2>{});
      else
        with_slices(std::integral_constant<int, 1>{});
    };
    switch (mc) {
#define MTPX_INT8_CASE(M)                     \
  case M:                                     \
    launch(std::integral_constant<int, M>{}); \
    break;
      MTPX_INT8_CASE(1)
      MTPX_INT8_CASE(2)
      MTPX_INT8_CASE(3)
      MTPX_INT8_CASE(4)
      MTPX_INT8_CASE(5)
      MTPX_INT8_CASE(6)
      MTPX_INT8_CASE(7)
      MTPX_INT8_CASE(8)
#undef MTPX_INT8_CASE
    }
  }
  check_launch("affine rows (int8 activations)");
}

template <int MODE>
void launch_rows(AffineGroup g, int bits, const float* x, int64_t m, cudaStream_t s) {
  const bool fast = bits == 4 || bits == 8 || bits == 6;
  int64_t total_rows = 0;
  for (int i = 0; i < g.count; ++i) total_rows += g.rows[i];
  // The bulk prefetch needs 16-byte aligned rows: every row start is when the base is and a row's codes
  // (cols * bits / 8 bytes) are a multiple of 16.
  const int64_t row_bytes = static_cast<int64_t>(g.cols) * bits / 8;
  bool aligned = row_bytes % 16 == 0;
  for (int i = 0; i < (MODE == kSwiglu ? 2 : g.count); ++i)
    aligned &= reinterpret_cast<uintptr_t>(g.codes[i]) % 16 == 0;
  g.prefetch_bytes =
      fast && aligned ? prefetch_bytes_per_row(MODE == kSwiglu ? 2 * total_rows : total_rows, row_bytes) : 0;
  const int per_warp = !fast || MODE == kSwiglu ? 1 : 2;
  g.warps_before[0] = 0;
  for (int i = 0; i < g.count; ++i)
    g.warps_before[i + 1] = g.warps_before[i] + (g.rows[i] + per_warp - 1) / per_warp;
  const auto blocks = static_cast<unsigned>((g.warps_before[g.count] + kGemvWarps - 1) / kGemvWarps);
  const int x_stride = g.cols;
  if (bits == 4 && affine_int8_activations() && aligned && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    launch_rows_int8<MODE>(g, x, m, total_rows, s);
    return;
  }
  // Activation rows in launches of at most 8 (each row's arithmetic is the same in any launch).
  for (int64_t m0 = 0; m0 < m; m0 += kMaxRowsPerLaunch) {
    const int mc = static_cast<int>(std::min<int64_t>(kMaxRowsPerLaunch, m - m0));
    AffineGroup part = g;
    for (int i = 0; i < g.count; ++i) part.y[i] = g.y[i] + m0 * g.rows[i];
    const float* xp = x + m0 * x_stride;
    if (!fast) {
      affine_rows_generic<MODE><<<blocks, kGemvWarps * 32, 0, s>>>(part, xp, x_stride, mc, bits);
      continue;
    }
    auto launch = [&](auto bits_constant) {
      constexpr int B = decltype(bits_constant)::value;
      switch (mc) {
#define MTPX_AFFINE_CASE(M) \
  case M:                   \
    return launch_pdl(affine_rows_kernel<B, M, MODE>, blocks, kGemvWarps * 32, 0, s, part, xp, x_stride);
        MTPX_AFFINE_CASE(1)
        MTPX_AFFINE_CASE(2)
        MTPX_AFFINE_CASE(3)
        MTPX_AFFINE_CASE(4)
        MTPX_AFFINE_CASE(5)
        MTPX_AFFINE_CASE(6)
        MTPX_AFFINE_CASE(7)
        MTPX_AFFINE_CASE(8)
#undef MTPX_AFFINE_CASE
      }
    };
    if (bits == 4)
      launch(std::integral_constant<int, 4>{});
    else if (bits == 8)
      launch(std::integral_constant<int, 8>{});
    else
      launch(std::integral_constant<int, 6>{});
  }
  check_launch("affine rows");
}

void rows_impl(int epilogue, const Matrix* ws, int count, const float* x, int64_t m, float* const* ys,
               cudaStream_t s) {
  AffineGroup g{};
  g.scales_f32 = ws[0].scale_type == Dtype::kF32;
  g.count = epilogue == kSwiglu ? 1 : count;
  g.cols = static_cast<int>(ws[0].cols);
  g.groups = static_cast<int>(ws[0].cols / ws[0].group_size);
  g.group_log2 = __builtin_ctzll(static_cast<unsigned long long>(ws[0].group_size));
  for (int i = 0; i < count; ++i) {
    g.codes[i] = static_cast<const uint32_t*>(ws[i].data);
    g.scales[i] = ws[i].scales;
    g.biases[i] = ws[i].biases;
    g.rows[i] = static_cast<int>(ws[i].rows);
    g.y[i] = epilogue == kSwiglu && i > 0 ? nullptr : ys[i];
  }
  switch (epilogue) {
    case kStore:
      return launch_rows<kStore>(g, ws[0].bits, x, m, s);
    case kAccumulate:
      return launch_rows<kAccumulate>(g, ws[0].bits, x, m, s);
    default:
      return launch_rows<kSwiglu>(g, ws[0].bits, x, m, s);
  }
}

template <typename S>
__global__ void dequantize_kernel(const uint32_t* __restrict__ codes, const S* __restrict__ scales,
                                  const S* __restrict__ biases, int64_t cols, int bits, int group_log2,
                                  int64_t rows, __nv_bfloat16* __restrict__ out) {
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  const int64_t chunks_per_row = cols / 32;
  const int64_t n = rows * chunks_per_row;
  const uint32_t mask = (1u << bits) - 1u;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks_per_row, k = i % chunks_per_row * 32;
    const uint32_t* w = codes + r * chunks_per_row * bits + k / 32 * bits;
    const int64_t grp = r * (cols >> group_log2) + (k >> group_log2);
    const float scale = to_float(scales[grp]), bias = to_float(biases[grp]);
    for (int c = 0; c < 32; ++c) {
      const int bit = c * bits, word = bit / 32, shift = bit % 32;
      uint32_t v = w[word] >> shift;
      if (shift + bits > 32) v |= w[word + 1] << (32 - shift);
      out[r * cols + k + c] = __float2bfloat16_rn(fmaf(scale, code_to_float(v & mask), bias));
    }
  }
}

template <typename S>
__global__ void embed_kernel(const uint32_t* __restrict__ codes, const S* __restrict__ scales,
                             const S* __restrict__ biases, int64_t cols, int bits, int group_log2,
                             const int32_t* __restrict__ tokens, float* __restrict__ out) {
  griddep_launch_dependents();  // a row kernel after this one may start its prefetch
  const int64_t t = blockIdx.x, r = tokens[t];
  const uint32_t mask = (1u << bits) - 1u;
  const uint32_t* row = codes + r * (cols / 32 * bits);
  for (int64_t k = threadIdx.x; k < cols; k += blockDim.x) {
    const int64_t bit = k * bits, word = bit / 32;
    const int shift = static_cast<int>(bit % 32);
    uint32_t v = row[word] >> shift;
    if (shift + bits > 32) v |= row[word + 1] << (32 - shift);
    const int64_t grp = r * (cols >> group_log2) + (k >> group_log2);
    out[t * cols + k] = fmaf(to_float(scales[grp]), code_to_float(v & mask), to_float(biases[grp]));
  }
}

}  // namespace

void rows(int epilogue, const Matrix* ws, int count, const float* x, int64_t m, float* const* ys,
          void* stream) {
  rows_impl(epilogue, ws, count, x, m, ys, static_cast<cudaStream_t>(stream));
}

void dequantize_bf16(const Matrix& w, int64_t row0, int64_t rows, void* out, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const int group_log2 = __builtin_ctzll(static_cast<unsigned long long>(w.group_size));
  const int64_t groups = w.cols / w.group_size, words = w.cols / 32 * w.bits;
  const auto* codes = static_cast<const uint32_t*>(w.data) + row0 * words;
  const int64_t chunks = rows * (w.cols / 32);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((chunks + 255) / 256, 4096));
  auto* o = static_cast<__nv_bfloat16*>(out);
  if (w.scale_type == Dtype::kF32)
    dequantize_kernel<<<blocks, 256, 0, s>>>(codes, static_cast<const float*>(w.scales) + row0 * groups,
                                             static_cast<const float*>(w.biases) + row0 * groups, w.cols,
                                             w.bits, group_log2, rows, o);
  else
    dequantize_kernel<<<blocks, 256, 0, s>>>(
        codes, static_cast<const __nv_bfloat16*>(w.scales) + row0 * groups,
        static_cast<const __nv_bfloat16*>(w.biases) + row0 * groups, w.cols, w.bits, group_log2, rows, o);
  check_launch("affine dequantize");
}

void embed(const Matrix& w, const int32_t* tokens, int64_t t_count, float* out, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const int group_log2 = __builtin_ctzll(static_cast<unsigned long long>(w.group_size));
  const auto grid = static_cast<unsigned>(t_count);
  const auto* codes = static_cast<const uint32_t*>(w.data);
  if (w.scale_type == Dtype::kF32)
    embed_kernel<<<grid, 256, 0, s>>>(codes, static_cast<const float*>(w.scales),
                                      static_cast<const float*>(w.biases), w.cols, w.bits, group_log2, tokens,
                                      out);
  else
    embed_kernel<<<grid, 256, 0, s>>>(codes, static_cast<const __nv_bfloat16*>(w.scales),
                                      static_cast<const __nv_bfloat16*>(w.biases), w.cols, w.bits, group_log2,
                                      tokens, out);
  check_launch("affine embed");
}

}  // namespace mtpx::cuda::affine
