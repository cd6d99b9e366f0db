// Gated attention: q/k norms and partial RoPE into the KV cache, decode (split keys) and prompt (flash)
// attention.

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

}  // namespace

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

}  // namespace mtpx::cuda
