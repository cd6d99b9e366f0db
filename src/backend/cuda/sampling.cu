// Sampling on the device: argmax, top-k candidates and their masses, the top-p boundary, draws below the
// candidates.

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
