// Gated DeltaNet: conv1d state, gates, the delta rule (recurrent, chunked for prompts), rollback, gated norm.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/runtime.h"
#include "util/error.h"

namespace mtpx::cuda {
namespace {

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

}  // namespace

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

}  // namespace mtpx::cuda
