// Embedding, RMSNorm and elementwise kernels.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <type_traits>

#include "backend/cuda/affine.h"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/runtime.h"
#include "util/error.h"

namespace mtpx::cuda {
namespace {

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

}  // namespace

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

// One link of dependent_launch_seconds' chain: block b adds one to its cell, which the previous link wrote.
__global__ void relay_kernel(float* cells) {
  griddep_wait();
  griddep_launch_dependents();
  if (threadIdx.x == 0) cells[blockIdx.x] += 1.0f;
}

double dependent_launch_seconds(int launches, int blocks, int reps) {
  Stream s;
  Buffer cells(static_cast<size_t>(blocks) * sizeof(float));
  s.zero(cells.data(), static_cast<size_t>(blocks) * sizeof(float));
  s.begin_capture();
  for (int i = 0; i < launches; ++i)
    launch_pdl(relay_kernel, static_cast<unsigned>(blocks), 128, 0, as_stream(s.handle()), cells.as<float>());
  void* graph = s.end_capture();
  s.launch_graph(graph);  // warm-up
  s.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) s.launch_graph(graph);
  s.synchronize();
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Stream::destroy_graph(graph);
  float first = 0.0f;  // every link ran: the cell counts (reps + 1) * launches
  s.to_host(&first, cells.data(), sizeof(float));
  s.synchronize();
  if (first != static_cast<float>((reps + 1) * launches))
    fail(ErrorKind::kInternal, "dependent_launch_seconds: the chain ran {} links of {}", first,
         (reps + 1) * launches);
  return t / (static_cast<double>(reps) * launches);
}

}  // namespace mtpx::cuda
