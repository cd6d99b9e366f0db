// Device helpers shared by the kernel files of backend/cuda (included by .cu files only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace mtpx::cuda {

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly in a fixed order: every lane ends with the same, reproducible total.
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// What the row kernels do with a finished dot product.
enum RowEpilogue : int {
  kStore = 0,       // y = x W^T
  kAccumulate = 1,  // y += x W^T (the residual update)
  kSwiglu = 2,      // y = silu(x gate^T) * (x up^T)
};

// Row kernels run 8 warps per block.
inline constexpr int kGemvWarps = 8;

}  // namespace mtpx::cuda
