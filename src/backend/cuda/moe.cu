// Mixture-of-experts kernels (kernels.h): routing and the plan of a pass, the grouped expert products and
// the weighted sum of the experts' outputs.
//
// Routing (a warp per row): the row's logits in registers (E / 32 per lane), softmax in float32 (the lane's
// values summed in order, then the fixed butterfly), then k rounds of a warp argmax (larger value first,
// lower index on equal values) and one more for the (k+1)-th value. torch.topk's CPU order only matters
// where it changes which experts are chosen: where the k-th and (k+1)-th probabilities are equal (or a
// probability is NaN), one lane routes the row again with libstdc++'s algorithms as ATen runs them
// (util/libstdcxx_select.h). Equal values inside the top k may come out in another order than torch's, but
// they weigh the same and their sum takes the same operands in the same order. The chosen experts are
// stored in ascending index order, the order the weighted sum adds them in (transformers' expert loop).
//
// Plan: the (row, slot) entries counted per expert (shared-memory atomics), then a block scan over the
// experts gives each its entries' place and its tasks (runs of at most kMoeTaskRows entries). Which entries
// share a task never changes an entry's arithmetic.
//
// Expert products: a block per (task, 8 or 16 output features); a warp takes two weight rows (SwiGLU: gate
// row r and up row r) for all the task's entries, lane l reducing k = 8l, 8l + 256, ... (the row kernels'
// mapping, matmul.cu and affine.cu), one accumulator per entry, then the fixed butterfly: an entry's output
// is the same whichever entries run beside it (batch invariance: a verify window's rows are their decode
// steps bit for bit).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/affine_math.cuh"
#include "backend/cuda/device_math.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/runtime.h"
#include "util/error.h"
#include "util/libstdcxx_select.h"

namespace mtpx::cuda {
namespace {

constexpr int kPlanHeader = 2;  // plan[0]: tasks, plan[1]: distinct experts; then tasks [3 each], entries
constexpr int kRouteWarps = 8;

struct Scored {
  float value;
  int32_t index;
};
// ATen topk's order (largest): NaN first, then larger values.
struct TorchOrder {
  __host__ __device__ bool operator()(const Scored& a, const Scored& b) const {
    return (a.value != a.value && b.value == b.value) || a.value > b.value;
  }
};

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Routes row `t` of the logits with the calling warp (E <= 32 * PER_LANE); `pairs` (E of them, shared) for
// a tied row. The chosen experts are written in ascending index order (the order moe_combine adds them in).
template <int PER_LANE>
__device__ void route_row(const float* __restrict__ logits, int t, int E, int k, int32_t* __restrict__ chosen,
                          float* __restrict__ weights, Scored* pairs) {
  const int lane = threadIdx.x % 32;
  const float* row = logits + static_cast<size_t>(t) * E;
  float v[PER_LANE];
  float m = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < E ? row[e] : -INFINITY;
    nan |= v[j] != v[j];
    m = fmaxf(m, v[j]);
  }
  m = warp_max(m);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j)
    if (lane + 32 * j < E) sum += (v[j] = expf(v[j] - m));
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j)
    if (lane + 32 * j < E) v[j] /= sum;
  nan = __any_sync(0xffffffffu, nan);
  // k + 1 rounds of the warp's largest unchosen value (lower index first among equal ones).
  uint32_t taken = 0;
  float kth = 0.0f, top_value = 0.0f;  // lane s < k keeps slot s's value and index
  int top_index = 0;
  bool tie = nan;
  for (int round = 0; round <= k && !tie; ++round) {
    if (round == E) break;  // every expert chosen: nothing below the k-th
    float best = -INFINITY;
    int best_index = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      const int e = lane + 32 * j;
      if (e < E && !(taken >> j & 1u) && (v[j] > best || best_index == 0x7fffffff))
        best = v[j], best_index = e;
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, off);
      const int oi = __shfl_xor_sync(0xffffffffu, best_index, off);
      if (ov > best || (ov == best && oi < best_index)) best = ov, best_index = oi;
    }
    if (round == k) {
      tie = best == kth;  // the (k+1)-th equals the k-th: torch's algorithm decides which are chosen
      break;
    }
    if (best_index % 32 == lane) taken |= 1u << (best_index / 32);
    if (lane == round) top_value = best, top_index = best_index;
    kth = best;
  }
  if (tie) {  // rare: one lane runs ATen's algorithm (util/libstdcxx_select.h)
    __syncwarp();
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j)
      if (lane + 32 * j < E) pairs[lane + 32 * j] = {v[j], lane + 32 * j};
    __syncwarp();
    if (lane == 0) {
      if (static_cast<int64_t>(k) * 64 <= E) {
        libstdcxx::partial_sort(pairs, int64_t{k}, int64_t{E}, TorchOrder{});
      } else {
        libstdcxx::nth_element(pairs, int64_t{k - 1}, int64_t{E}, TorchOrder{});
        libstdcxx::sort(pairs, int64_t{k - 1}, TorchOrder{});
      }
    }
    __syncwarp();
    if (lane < k) top_value = pairs[lane].value, top_index = pairs[lane].index;
    __syncwarp();
  }
  // Renormalized in torch's order, as router_top_value.sum() adds them; stored by ascending expert.
  float top_sum = 0.0f;
  int rank = 0;  // lane < k: how many chosen experts have a lower index than its own
  for (int s = 0; s < k; ++s) {
    top_sum += __shfl_sync(0xffffffffu, top_value, s);
    rank += __shfl_sync(0xffffffffu, top_index, s) < top_index;
  }
  if (lane < k) {
    chosen[static_cast<size_t>(t) * k + rank] = top_index;
    weights[static_cast<size_t>(t) * k + rank] = top_value / top_sum;
  }
}

// Exclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024); *total gets the sum.
__device__ int block_exclusive_scan(int v, int* scratch /* [33] shared */, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int inclusive = v;
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += o;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int w = 0; w < warps; ++w) {
      const int s = scratch[w];
      scratch[w] = running;
      running += s;
    }
    scratch[32] = running;
  }
  __syncthreads();
  *total = scratch[32];
  return scratch[warp] + inclusive - v;
}

// The plan of `entries` = T * k chosen experts (kernels.h), by the whole block. counts: E ints, shared.
__device__ void plan_entries(const int32_t* __restrict__ chosen, int t_count, int k, int E, int max_tasks,
                             int32_t* __restrict__ plan, unsigned long long* traffic, int* counts,
                             int* scan_scratch) {
  const int n = t_count * k;
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&counts[chosen[i]], 1);
  __syncthreads();
  // Thread j owns experts [j * per, (j + 1) * per): its entries and tasks, then their places by a scan.
  const int per = (E + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int e0 = min(E, static_cast<int>(threadIdx.x) * per), e1 = min(E, e0 + per);
  int my_entries = 0, my_tasks = 0, my_distinct = 0;
  for (int e = e0; e < e1; ++e) {
    const int c = counts[e];
    my_entries += c;
    my_tasks += (c + static_cast<int>(kMoeTaskRows) - 1) / static_cast<int>(kMoeTaskRows);
    my_distinct += c > 0;
  }
  int entries_total = 0, tasks_total = 0, distinct = 0;
  int entry_at = block_exclusive_scan(my_entries, scan_scratch, &entries_total);
  int task_at = block_exclusive_scan(my_tasks, scan_scratch, &tasks_total);
  block_exclusive_scan(my_distinct, scan_scratch, &distinct);
  int32_t* const tasks = plan + kPlanHeader;
  int32_t* const entries = plan + kPlanHeader + 3 * max_tasks;
  __syncthreads();  // every count read before it becomes a cursor
  for (int e = e0; e < e1; ++e) {
    const int c = counts[e];
    for (int j = 0; j < c; j += static_cast<int>(kMoeTaskRows), ++task_at) {
      tasks[3 * task_at] = e;
      tasks[3 * task_at + 1] = entry_at + j;
      tasks[3 * task_at + 2] = min(static_cast<int>(kMoeTaskRows), c - j);
    }
    counts[e] = entry_at;  // the cursor where e's entries go
    entry_at += c;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) entries[atomicAdd(&counts[chosen[i]], 1)] = i;
  if (threadIdx.x == 0) {
    plan[0] = tasks_total;
    plan[1] = distinct;
    if (traffic != nullptr) {
      atomicAdd(traffic, 1ull);
      atomicAdd(traffic + 1, static_cast<unsigned long long>(t_count));
      atomicAdd(traffic + 2, static_cast<unsigned long long>(distinct));
      atomicMax(traffic + 3, static_cast<unsigned long long>(distinct));
    }
  }
}

// Shared memory of the route+plan kernel: the warps' tie buffers, the counts, the scan's scratch.
size_t route_plan_shared_bytes(int64_t E) {
  return static_cast<size_t>(kRouteWarps * E) * sizeof(Scored) + static_cast<size_t>(E) * sizeof(int) +
         33 * sizeof(int);
}

// Decode and verify passes (T < kGemmMinRows): routing and the plan in one launch.
template <int PER_LANE>
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_plan_kernel(const float* __restrict__ logits, int t_count, int E, int k, int max_tasks,
                      int32_t* __restrict__ chosen, float* __restrict__ weights, int32_t* __restrict__ plan,
                      unsigned long long* traffic) {
  extern __shared__ uint4 shared_words[];
  auto* const pairs = reinterpret_cast<Scored*>(shared_words);
  auto* const counts = reinterpret_cast<int*>(pairs + kRouteWarps * E);
  int* const scan_scratch = counts + E;
  griddep_wait();
  griddep_launch_dependents();
  const int warp = threadIdx.x / 32;
  for (int t = warp; t < t_count; t += kRouteWarps)
    route_row<PER_LANE>(logits, t, E, k, chosen, weights, pairs + warp * E);
  __syncthreads();
  plan_entries(chosen, t_count, k, E, max_tasks, plan, traffic, counts, scan_scratch);
}

// Prompts: a warp per row over many blocks, then the plan in one block.
template <int PER_LANE>
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(const float* __restrict__ logits, int t_count, int E, int k, int32_t* __restrict__ chosen,
                 float* __restrict__ weights) {
  extern __shared__ uint4 shared_words[];
  auto* const pairs = reinterpret_cast<Scored*>(shared_words);
  griddep_wait();
  griddep_launch_dependents();
  const int warp = threadIdx.x / 32, t = blockIdx.x * kRouteWarps + warp;
  if (t < t_count) route_row<PER_LANE>(logits, t, E, k, chosen, weights, pairs + warp * E);
}

__global__ void __launch_bounds__(1024)
    plan_kernel(const int32_t* __restrict__ chosen, int t_count, int E, int k, int max_tasks,
                int32_t* __restrict__ plan, unsigned long long* traffic) {
  extern __shared__ uint4 shared_words[];
  auto* const counts = reinterpret_cast<int*>(shared_words);
  griddep_wait();
  griddep_launch_dependents();
  plan_entries(chosen, t_count, k, E, max_tasks, plan, traffic, counts, counts + E);
}

// ---- Expert products. B == 0: float weights of type W (VEC: 8 per 16-byte load); B > 0: affine codes
// of B bits (affine.cu's float-activation arithmetic: xsum and dot1 per chunk of 8 codes).
template <typename W, int B, bool VEC, bool SWIGLU, int CAP>
__global__ void __launch_bounds__(kGemvWarps * 32)
    expert_rows_kernel(const ExpertMatrices m0, const ExpertMatrices m1, const int32_t* __restrict__ plan,
                       int max_tasks, int x_div, const float* __restrict__ x, float* __restrict__ y) {
  constexpr int kTask = CAP;  // the most entries a task of this launch holds (<= kMoeTaskRows)
  griddep_wait();
  griddep_launch_dependents();
  const int task = blockIdx.y;
  if (task >= plan[0]) return;
  const int32_t* const t3 = plan + kPlanHeader + 3 * task;
  const int expert = t3[0], n = t3[2];
  const int32_t* const entries = plan + kPlanHeader + 3 * max_tasks + t3[1];
  const int warp = blockIdx.x * kGemvWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int out_rows = static_cast<int>(m0.rows), cols = static_cast<int>(m0.cols);
  const int r0 = SWIGLU ? warp : 2 * warp;
  if (r0 >= out_rows) return;
  const int rows[2] = {r0, SWIGLU ? r0 : min(r0 + 1, out_rows - 1)};  // past the end: computed, not stored
  const ExpertPointers p[2] = {m0.table[expert], SWIGLU ? m1.table[expert] : m0.table[expert]};
  const float* xr[kTask];
#pragma unroll
  for (int m = 0; m < kTask; ++m) xr[m] = x + static_cast<size_t>(m < n ? entries[m] / x_div : 0) * cols;
  float acc[2][kTask];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int m = 0; m < kTask; ++m) acc[i][m] = 0.0f;
  if constexpr (B > 0) {
    constexpr float kCodeScale = static_cast<float>(1 << B);
    const int words_per_row = cols / 32 * B, groups = cols / static_cast<int>(m0.group_size);
    const int group_log2 = __ffs(static_cast<int>(m0.group_size)) - 1;
    const bool scales_f32 = m0.scale_type == Dtype::kF32;
    const uint32_t* wr[2];
    size_t sb[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      wr[i] = static_cast<const uint32_t*>(p[i].data) + static_cast<size_t>(rows[i]) * words_per_row;
      sb[i] = static_cast<size_t>(rows[i]) * groups;
    }
#pragma unroll 2
    for (int k = lane * 8; k < cols; k += 256) {
      float scale[2], bias[2], q[2][8];
      const int grp = k >> group_log2;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint64_t w = affine::load_chunk<B>(wr[i], k / 8);
        scale[i] = affine::scale_at(p[i].scales, sb[i] + grp, scales_f32) * kCodeScale;
        bias[i] = affine::scale_at(p[i].biases, sb[i] + grp, scales_f32);
#pragma unroll
        for (int c = 0; c < 8; ++c) q[i][c] = affine::code_plus_one<B>(w, c);
      }
#pragma unroll
      for (int m = 0; m < kTask; ++m) {
        if (m >= n) break;
        const float4 a = __ldg(reinterpret_cast<const float4*>(xr[m] + k));
        const float4 b = __ldg(reinterpret_cast<const float4*>(xr[m] + k) + 1);
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float xsum = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; ++c) xsum += xv[c];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float dot = 0.0f;
#pragma unroll
          for (int c = 0; c < 8; ++c) dot = fmaf(q[i][c], xv[c], dot);
          acc[i][m] = fmaf(scale[i], dot - xsum, fmaf(bias[i], xsum, acc[i][m]));
        }
      }
    }
  } else if constexpr (VEC) {
    const W* wr[2] = {static_cast<const W*>(p[0].data) + static_cast<size_t>(rows[0]) * cols,
                      static_cast<const W*>(p[1].data) + static_cast<size_t>(rows[1]) * cols};
#pragma unroll 2
    for (int k = lane * 8; k < cols; k += 256) {
      float wf[2][8];
      load8(wr[0] + k, wf[0]);
      load8(wr[1] + k, wf[1]);
#pragma unroll
      for (int m = 0; m < kTask; ++m) {
        if (m >= n) break;
        const float4 a = __ldg(reinterpret_cast<const float4*>(xr[m] + k));
        const float4 b = __ldg(reinterpret_cast<const float4*>(xr[m] + k) + 1);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float s = acc[i][m];
          s = fmaf(wf[i][0], a.x, s), s = fmaf(wf[i][1], a.y, s), s = fmaf(wf[i][2], a.z, s);
          s = fmaf(wf[i][3], a.w, s), s = fmaf(wf[i][4], b.x, s), s = fmaf(wf[i][5], b.y, s);
          s = fmaf(wf[i][6], b.z, s), s = fmaf(wf[i][7], b.w, s);
          acc[i][m] = s;
        }
      }
    }
  } else {  // any width or alignment: lane l takes k = l, l + 32, ...
    const W* wr[2] = {static_cast<const W*>(p[0].data) + static_cast<size_t>(rows[0]) * cols,
                      static_cast<const W*>(p[1].data) + static_cast<size_t>(rows[1]) * cols};
    for (int k = lane; k < cols; k += 32) {
      const float w0 = to_float(wr[0][k]), w1 = to_float(wr[1][k]);
#pragma unroll
      for (int m = 0; m < kTask; ++m) {
        if (m >= n) break;
        const float xv = xr[m][k];
        acc[0][m] = fmaf(w0, xv, acc[0][m]);
        acc[1][m] = fmaf(w1, xv, acc[1][m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kTask; ++m) {
    if (m >= n) break;
    const float a0 = warp_sum(acc[0][m]), a1 = warp_sum(acc[1][m]);
    if (lane != 0) continue;
    float* out = y + static_cast<size_t>(entries[m]) * out_rows;
    if constexpr (SWIGLU) {
      out[r0] = silu(a0) * a1;
    } else {
      out[r0] = a0;
      if (r0 + 1 < out_rows) out[r0 + 1] = a1;
    }
  }
}

// cap: the most entries of a task, min(T, kMoeTaskRows) rounded up to 1, 4 or 16 (a row routes to an expert
// once, so a task of a pass of T rows holds at most T entries): fewer accumulators and registers for decode
// steps and short windows, the same arithmetic per entry.
template <bool SWIGLU>
void launch_expert_rows(const ExpertMatrices& m0, const ExpertMatrices& m1, const void* plan,
                        int64_t max_tasks, int64_t t_count, int x_div, const float* x, float* y,
                        cudaStream_t s) {
  const int cap = t_count == 1 ? 1 : t_count <= 4 ? 4 : static_cast<int>(kMoeTaskRows);
  const int64_t warps = SWIGLU ? m0.rows : (m0.rows + 1) / 2;
  const dim3 grid(blocks_for(warps, kGemvWarps), static_cast<unsigned>(max_tasks));
  const auto* p = static_cast<const int32_t*>(plan);
  const int mt = static_cast<int>(max_tasks);
  const bool vec = m0.cols % 8 == 0;  // the pieces are uploaded 256-byte aligned (cuda_executor.cpp)
#define MTPX_EXPERT_LAUNCH(W, B, V)                                                                           \
  return cap == 1   ? launch_pdl(expert_rows_kernel<W, B, V, SWIGLU, 1>, grid, kGemvWarps * 32, 0, s, m0, m1, \
                                 p, mt, x_div, x, y)                                                          \
         : cap == 4 ? launch_pdl(expert_rows_kernel<W, B, V, SWIGLU, 4>, grid, kGemvWarps * 32, 0, s, m0,     \
                                 m1, p, mt, x_div, x, y)                                                      \
                    : launch_pdl(expert_rows_kernel<W, B, V, SWIGLU, static_cast<int>(kMoeTaskRows)>, grid,   \
                                 kGemvWarps * 32, 0, s, m0, m1, p, mt, x_div, x, y)
  switch (m0.type) {
    case Dtype::kBF16:
      if (vec) MTPX_EXPERT_LAUNCH(__nv_bfloat16, 0, true);
      MTPX_EXPERT_LAUNCH(__nv_bfloat16, 0, false);
    case Dtype::kF16:
      if (vec) MTPX_EXPERT_LAUNCH(__half, 0, true);
      MTPX_EXPERT_LAUNCH(__half, 0, false);
    case Dtype::kF32:
      if (vec) MTPX_EXPERT_LAUNCH(float, 0, true);
      MTPX_EXPERT_LAUNCH(float, 0, false);
    case Dtype::kAffine:
      switch (m0.bits) {
        case 2:
          MTPX_EXPERT_LAUNCH(float, 2, true);
        case 3:
          MTPX_EXPERT_LAUNCH(float, 3, true);
        case 4:
          MTPX_EXPERT_LAUNCH(float, 4, true);
        case 5:
          MTPX_EXPERT_LAUNCH(float, 5, true);
        case 6:
          MTPX_EXPERT_LAUNCH(float, 6, true);
        case 8:
          MTPX_EXPERT_LAUNCH(float, 8, true);
        default:
          break;
      }
      break;
  }
#undef MTPX_EXPERT_LAUNCH
  fail(ErrorKind::kInternal, "moe: experts of type {} and {} bits", static_cast<int>(m0.type), m0.bits);
}

// A block per (row, 256 columns): each thread adds its column's k expert outputs in slot order (ascending
// expert index: route_row stores them so) and the gated shared expert.
__global__ void __launch_bounds__(256)
    combine_kernel(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ weights,
                   const float* __restrict__ shared, const float* __restrict__ shared_gate, int k, int H) {
  griddep_wait();
  griddep_launch_dependents();
  const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= H) return;
  const float g = sigmoid(shared_gate[t]);
  const float* const yt = y + static_cast<size_t>(t) * k * H + i;
  const float* const wt = weights + static_cast<size_t>(t) * k;
  // As the CPU adds them (model/moe.cpp): products rounded, then summed, the shared expert last.
  float o = 0.0f;
  for (int s = 0; s < k; ++s) o = __fadd_rn(o, __fmul_rn(yt[static_cast<size_t>(s) * H], wt[s]));
  o = __fadd_rn(o, __fmul_rn(g, shared[static_cast<size_t>(t) * H + i]));
  x[static_cast<size_t>(t) * H + i] += o;
}

}  // namespace

const char* moe_unsupported(const ExpertMatrices& m, int64_t experts, int64_t k) {
  if (experts < 1 || experts > kMoeMaxExperts) return "the number of experts must be 1..1024";
  if (k < 1 || k > kMoeMaxTopK || k > experts)
    return "experts per token must be 1..32 and at most the experts";
  if (m.type == Dtype::kAffine) {
    if (const char* why = affine_unsupported(m.bits, m.group_size, m.cols); *why != '\0') return why;
    if (m.scale_type != Dtype::kBF16 && m.scale_type != Dtype::kF32) return "scales must be bf16 or float32";
  }
  return "";
}

int64_t moe_max_tasks(int64_t t_count, int64_t k, int64_t experts) {
  return std::min(experts, t_count * k) + t_count * k / kMoeTaskRows;
}

int64_t moe_plan_bytes(int64_t t_count, int64_t k, int64_t experts) {
  return (kPlanHeader + 3 * moe_max_tasks(t_count, k, experts) + t_count * k) *
         static_cast<int64_t>(sizeof(int32_t));
}

void moe_route(const float* logits, int64_t t_count, int64_t experts, int64_t k, int32_t* chosen,
               float* weights, void* plan, unsigned long long* traffic, void* stream) {
  if (t_count <= 0) return;
  const cudaStream_t s = as_stream(stream);
  const int T = static_cast<int>(t_count), E = static_cast<int>(experts), K = static_cast<int>(k);
  const int max_tasks = static_cast<int>(moe_max_tasks(t_count, k, experts));
  auto* const p = static_cast<int32_t*>(plan);
  // The logits a lane holds: E / 32 rounded up to 8, 16 or 32 (its loops are unrolled over them).
  auto launch = [&](auto per_lane) {
    constexpr int kPer = decltype(per_lane)::value;
    if (t_count < kGemmMinRows) {
      const size_t bytes = route_plan_shared_bytes(experts);
      if (bytes > 48 * 1024) allow_shared_memory(route_plan_kernel<kPer>, bytes, "moe routing");
      launch_pdl(route_plan_kernel<kPer>, 1, kRouteWarps * 32, bytes, s, logits, T, E, K, max_tasks, chosen,
                 weights, p, traffic);
    } else {
      const size_t bytes = static_cast<size_t>(kRouteWarps * experts) * sizeof(Scored);
      if (bytes > 48 * 1024) allow_shared_memory(route_kernel<kPer>, bytes, "moe routing");
      launch_pdl(route_kernel<kPer>, blocks_for(t_count, kRouteWarps), kRouteWarps * 32, bytes, s, logits, T,
                 E, K, chosen, weights);
      launch_pdl(plan_kernel, 1, 1024, static_cast<size_t>(experts + 33) * sizeof(int), s, chosen, T, E, K,
                 max_tasks, p, traffic);
    }
  };
  if (experts <= 256)
    launch(std::integral_constant<int, 8>{});
  else if (experts <= 512)
    launch(std::integral_constant<int, 16>{});
  else
    launch(std::integral_constant<int, 32>{});
  check_launch("moe routing");
}

void moe_expert_swiglu(const ExpertMatrices& gate, const ExpertMatrices& up, const void* plan,
                       int64_t t_count, int64_t k, int64_t experts, const float* x, float* act,
                       void* stream) {
  if (t_count <= 0) return;
  launch_expert_rows<true>(gate, up, plan, moe_max_tasks(t_count, k, experts), t_count, static_cast<int>(k),
                           x, act, as_stream(stream));
  check_launch("moe expert swiglu");
}

void moe_expert_down(const ExpertMatrices& down, const void* plan, int64_t t_count, int64_t k,
                     int64_t experts, const float* act, float* y, void* stream) {
  if (t_count <= 0) return;
  launch_expert_rows<false>(down, down, plan, moe_max_tasks(t_count, k, experts), t_count, 1, act, y,
                            as_stream(stream));
  check_launch("moe expert down");
}

void moe_combine(float* x, const float* y, const int32_t* chosen, const float* weights, const float* shared,
                 const float* shared_gate, int64_t t_count, int64_t k, int64_t hidden, void* stream) {
  if (t_count <= 0) return;
  (void)chosen;  // the slots are in ascending expert order already (moe_route)
  launch_pdl(combine_kernel, dim3(blocks_for(hidden, 256), static_cast<unsigned>(t_count)), 256, 0,
             as_stream(stream), x, y, weights, shared, shared_gate, static_cast<int>(k),
             static_cast<int>(hidden));
  check_launch("moe combine");
}

}  // namespace mtpx::cuda
