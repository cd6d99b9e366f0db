// Device helpers shared by the kernel files of backend/cuda (included by .cu files only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "backend/cuda/runtime.h"
#include "util/error.h"

namespace mtpx::cuda {

// Butterfly in a fixed order: every lane ends with the same, reproducible total.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

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

// What the row kernels do with a finished dot product.
enum RowEpilogue : int {
  kStore = 0,       // y = x W^T
  kAccumulate = 1,  // y += x W^T (the residual update)
  kSwiglu = 2,      // y = silu(x gate^T) * (x up^T)
};

// A warp's finished rows: each accumulator reduced over the lanes (fixed butterfly), then lane 0 stores
// rows row0 .. row0 + per_matrix - 1 of matrix j's output g.y[j] [M, g.rows[j]] (those past the end were
// computed, not stored) through the epilogue. SwiGLU: accumulators i < R / 2 are gate rows, i + R / 2 the
// matching up rows.
template <int M, int MODE, int R, typename Group>
__device__ __forceinline__ void finish_rows(float (&acc)[R][M], const Group& g, int j, int row0,
                                            int per_matrix, int lane) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[i][m] = warp_sum(acc[i][m]);
  if (lane != 0) return;
  const int rows = g.rows[j];
  float* y = g.y[j];
#pragma unroll
  for (int i = 0; i < per_matrix; ++i) {
    const int r = row0 + i;
    if (r >= rows) break;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float* out = y + static_cast<size_t>(m) * rows + r;
      if constexpr (MODE == kSwiglu)
        *out = silu(acc[i][m]) * acc[i + R / 2][m];
      else if constexpr (MODE == kAccumulate)
        *out += acc[i][m];
      else
        *out = acc[i][m];
    }
  }
}

// kernels.h passes streams as void* (its callers need no CUDA headers).
inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
inline unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

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

// Grid of an elementwise kernel of 256 threads a block; past 4096 blocks its loop strides over the rest.
inline unsigned elementwise_blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<unsigned>(b < 4096 ? (b > 0 ? b : 1) : 4096);
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

// One m16n8k16 tensor-core step, bf16 operands, float32 accumulation (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type").
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

// Row kernels run 8 warps per block.
inline constexpr int kGemvWarps = 8;

// ---- Programmatic dependent launch (sm_90; CUDA programming guide, "Programmatic Dependent Launch").
// A matrix product is a few microseconds of streaming at this scale, and each one starts with an empty
// memory pipe: its first loads wait a DRAM round trip after the previous kernel drained. A row kernel
// launched with launch_pdl() may become resident while the previous kernel of the stream still runs. Before
// griddep_wait() it touches only its weights (which no kernel writes): it asks L2 for the first bytes of
// its rows, so the weights stream across the kernel boundary. griddep_wait() returns once every earlier
// kernel of the stream has completed and its writes are visible, so everything after it (x, y) is ordered
// as with a plain launch. A kernel calls griddep_launch_dependents() to let the next one start; the row
// kernels do so after their wait, so at most one kernel runs ahead. Without the attribute both are no-ops.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Bulk prefetch of [p, p + bytes) into L2 (p 16-byte aligned, bytes a multiple of 16).
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (bytes > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Bytes of each weight row a row kernel prefetches before its wait: about kPrefetchBytes in all (what
// the memory system moves in the ~2 us a kernel boundary costs), in whole 128-byte lines, at most the row.
inline constexpr int64_t kPrefetchBytes = int64_t{8} << 20;
inline uint32_t prefetch_bytes_per_row(int64_t total_rows, int64_t row_bytes) {
  const int64_t per_row =
      std::min(kPrefetchBytes / std::max<int64_t>(total_rows, 1) / 128 * 128, row_bytes / 16 * 16);
  return static_cast<uint32_t>(std::max<int64_t>(per_row, 0));
}

// kernel<<<blocks, threads, shared_bytes, s>>>(args...), with programmatic stream serialization when
// pdl_enabled(). The small kernels (norms, attention, the DeltaNet steps, argmax) launch this way too: each
// calls griddep_wait() first and griddep_launch_dependents() after it, so it reads nothing before its
// predecessor is done and lets at most one kernel run ahead, and its launch and block scheduling overlap the
// previous kernel's tail instead of following it. Measured on the H200 (BENCHMARKS.md, session 17): 0.8B
// decode 633 -> 691 tok/s, 9B 4-bit 353 -> 374, 9B 173.5 -> 174.5. (Session 14 tried it with the trigger
// before the wait: every kernel then ran ahead, each row kernel's prefetch competed with the streaming one,
// and decode was slower.)
template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 blocks, unsigned threads, size_t shared_bytes, cudaStream_t s,
                Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = blocks;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = shared_bytes;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) fail(ErrorKind::kInternal, "CUDA: kernel launch failed: {}", cudaGetErrorString(e));
}

}  // namespace mtpx::cuda
