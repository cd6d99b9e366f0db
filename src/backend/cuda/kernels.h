// CUDA kernels for decoding: generic row-wise operations with dimensions as arguments (no model
// knowledge; the model code in src/model/cuda_executor.cpp composes them). Defined in matmul.cu,
// affine.cu, attention.cu, deltanet.cu, row_ops.cu and sampling.cu. Every launcher runs
// asynchronously on `stream` (a cudaStream_t).
//
// Batch invariance (what makes greedy MTP lossless on the GPU, as on the CPU): every kernel computes a
// row with the same sequence of floating-point operations whatever the number of rows launched with it.
// matmul splits the reduction over k the same way for every row count below kGemmMinRows; attention
// gives each query row its own blocks with a key split that depends only on the row's own key count;
// the delta rule runs token by token (in the same order whatever the window). Prompt prefill (>=
// kGemmMinRows rows) uses cuBLAS for the products, a tensor-core attention kernel and the chunked delta rule
// instead: not bitwise equal to the row kernels, but prefill is the same computation in plain and
// speculative decoding (the depthwise conv's prefill kernel does the row kernel's arithmetic, only in
// parallel over tokens).
// Positions are read from device memory (`pos`) so that a captured CUDA graph can be replayed at any
// position.
#pragma once

#include <cstdint>

namespace mtpx::cuda {

enum class Dtype { kF32, kF16, kBF16, kAffine };

// A row-major [rows, cols] weight matrix in device memory (nn.Linear layout: rows = out features).
// kAffine is MLX's group-wise affine quantization (backend/cpu/quant_matmul.h): `data` holds each row's
// codes as a little-endian bit stream of cols * bits bits, and weight[o, k] = scale[o, g] * code + bias[o, g]
// with g = k / group_size; scales and biases are [rows, cols / group_size] of `scale_type` (kBF16 or kF32).
struct Matrix {
  Dtype type = Dtype::kBF16;
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  int bits = 0;
  int64_t group_size = 0;
  Dtype scale_type = Dtype::kBF16;
  const void* scales = nullptr;
  const void* biases = nullptr;
};

// Whether the kernels take an affine matrix of this shape (bits 2..8 but 7, group_size 32/64/128, cols a
// multiple of group_size); empty when they do, else why not.
const char* affine_unsupported(int bits, int64_t group_size, int64_t cols);

inline constexpr int64_t kGemmMinRows = 16;

// Where the matrix products run: the stream, its cuBLAS handle, and scratch for the prompt path (the
// float32 activations split into two 16-bit halves: at least 4 * m * cols bytes). Affine matrices on the
// prompt path are dequantized to bf16 a block of rows at a time into `dequant` (kDequantBytes).
struct Workspace {
  void* stream = nullptr;  // cudaStream_t
  void* cublas = nullptr;  // cublasHandle_t
  void* scratch = nullptr;
  void* dequant = nullptr;
};
inline constexpr int64_t kDequantBytes = int64_t{64} << 20;

// y[m, o] (+)= sum_k x[m, k] W[o, k], float32 x and y (accumulate: add to y, the residual update).
// m < kGemmMinRows: the batch-invariant row kernels; else cuBLAS on x split into hi + lo halves in the
// weight's dtype (float32 weights: sgemm; affine weights: dequantized to bf16 blocks of rows first).
void matmul(const Matrix& w, const float* x, int64_t m, float* y, bool accumulate, const Workspace& ws);
// The RMSNorm of a product's input (rms_norm_rows with this weight and eps), where a product takes it.
struct RowNorm {
  const float* weight = nullptr;  // null: none
  float eps = 0.0f;
};

// Up to 4 products of the same x in one launch: y[i] = x W[i]^T, i < count. With `norm`: of x's rows
// RMS-normalized, inside the products where the row kernels can (bf16 weights on tensor cores, m <= 15:
// the sum of squares comes with the x loads, 1 / rms scales the dot products) and else by rms_norm_rows
// into `normed` ([m, cols] of scratch) first. MTPX_FUSED_NORMS=0 always takes the second way. (The 4-bit
// int8 kernel taking it too was slower: BENCHMARKS.md, session 19.)
void matmul_group(const Matrix* w, float* const* y, int count, const float* x, int64_t m, const Workspace& ws,
                  RowNorm norm = {}, float* normed = nullptr);
// out = silu(x gate^T) * (x up^T) in one launch (up_scratch [m, rows] is used on the prompt path); `norm`
// and `normed` as for matmul_group.
void matmul_swiglu(const Matrix& gate, const Matrix& up, const float* x, int64_t m, float* out,
                   float* up_scratch, const Workspace& ws, RowNorm norm = {}, float* normed = nullptr);

// out[t, :] = float(W[tokens[t], :])  (affine: fma(scale, code, bias) in float32, as the CPU computes it)
void embed_rows(const Matrix& table, const int32_t* tokens, int64_t t_count, float* out, void* stream);

// out[r, :n] = x[r, :n] / sqrt(mean(x^2) + eps) * weight  (row strides in elements)
void rms_norm_rows(const float* x, int64_t x_stride, const float* weight, float eps, int64_t rows, int64_t n,
                   float* out, int64_t out_stride, void* stream);

void add_inplace(float* x, const float* y, int64_t n, void* stream);
// out = silu(gate) * up
void swiglu(const float* gate, const float* up, int64_t n, float* out, void* stream);

// Gated attention, step 1: per token t (position pos[0] + t): RMS-norm and partial RoPE of the query part
// of each qg head ([T, nq, 2D]: query | gate) and of each key head, then keys and values into the
// caches ([capacity, nkv, D]) at their positions.
void qk_norm_rope_store(float* qg, float* k, const float* v, const float* q_norm, const float* k_norm,
                        float eps, int64_t t_count, int64_t nq, int64_t nkv, int64_t head_dim,
                        int64_t rotary_dim, double rope_theta, const int32_t* pos, float* key_cache,
                        float* value_cache, void* stream);

// Gated attention, step 2: o[t, h] = softmax(q k^T / sqrt(D)) v over cache positions 0..pos[0]+t,
// times sigmoid(gate).  qg: [T, nq, 2D]; o: [T, nq, D]. nq a multiple of nkv, at most 16 query heads per
// key-value head. Decode and verify rows (T < kGemmMinRows) split each row's keys over many blocks and need
// `scratch`: device memory of attention_scratch_bytes(T, nq, head_dim) (or more), zeroed before its first
// use (each launch leaves it ready for the next). Prompts do not use it (it may be null).
int64_t attention_scratch_bytes(int64_t t_count, int64_t nq, int64_t head_dim);
void attention(const float* qg, const float* key_cache, const float* value_cache, int64_t t_count, int64_t nq,
               int64_t nkv, int64_t head_dim, const int32_t* pos, float* o, void* scratch, void* stream);

// Gated DeltaNet, causal depthwise conv + SiLU over [conv_state (kc-1 rows); qkv (T rows)] per channel;
// conv_state becomes the last kc-1 rows. With conv_before, the old state is kept there first.
void deltanet_conv(const float* qkv, float* conv_state, const float* conv_weight, int64_t t_count,
                   int64_t channels, int64_t kc, float* x, float* conv_before, void* stream);

// l2-normalizes q and k per key head (q also scaled by Dk^-1/2) inside x [T, conv_dim], and
// beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias)  ([T, Hv]).
void deltanet_prepare(float* x, const float* b, const float* a, const float* a_log, const float* dt_bias,
                      int64_t t_count, int64_t hk, int64_t hv, int64_t dk, int64_t conv_dim, float* beta,
                      float* g, void* stream);

// deltanet_conv then deltanet_prepare (x is the conv's output, normalized in place). Decode and verify rows
// (fewer than kGemmMinRows, dk <= 128) run both in one launch with the same arithmetic.
void deltanet_conv_prepare(const float* qkv, float* conv_state, const float* conv_weight, const float* b,
                           const float* a, const float* a_log, const float* dt_bias, int64_t t_count,
                           int64_t hk, int64_t hv, int64_t dk, int64_t channels, int64_t kc, float* x,
                           float* conv_before, float* beta, float* g, void* stream);

// The gated delta rule, token by token (§4.2), per value head: state [Hv, Dk, Dv] is read from s_in,
// written to s_out (may alias), and copied to s_before first when non-null. o: [T, Hv, Dv].
void delta_rule(const float* x, const float* g, const float* beta, const float* s_in, float* s_out,
                float* s_before, float* o, int64_t t_count, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                int64_t conv_dim, void* stream);

// A recorded window's rollback in every DeltaNet layer in two launches (two per layer cost ~2 launches'
// latency each, 0.27 ms per rollback on a 9B): per layer the delta rule replayed over the window's first
// `keep` tokens from the state before it (delta_rule(x, g, beta, ssm_before, ssm): the same blocks, the
// state bit for bit, no output), then the conv state rebuilt as the last kc-1 rows of [conv_before; qkv rows
// 0..keep-1].
struct DeltaNetRollbackLayer {
  const float *x = nullptr, *g = nullptr, *beta = nullptr, *ssm_before = nullptr, *conv_before = nullptr,
              *qkv = nullptr;
  float *ssm = nullptr, *conv = nullptr;
};
void deltanet_rollback(const DeltaNetRollbackLayer* layers, int64_t count, int64_t keep, int64_t hk,
                       int64_t hv, int64_t dk, int64_t dv, int64_t conv_dim, int64_t kc, void* stream);

// Prompt prefill: the same rule in its chunked form (§4.3, chunks of 64 tokens), state [Hv, Dk, Dv] updated
// in place. Equal to delta_rule up to the order of the sums (not bitwise: prefill only). scratch: device
// memory of delta_rule_chunked_scratch_bytes(t_count, hv).
int64_t delta_rule_chunked_scratch_bytes(int64_t t_count, int64_t hv);
void delta_rule_chunked(const float* x, const float* g, const float* beta, float* state, float* o,
                        int64_t t_count, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t conv_dim,
                        void* scratch, void* stream);

// o[r, :] = rms_norm(o[r, :]) * weight * silu(z[r, :]) for rows of n (the DeltaNet output norm).
void gated_rms_norm(float* o, const float* z, const float* weight, float eps, int64_t rows, int64_t n,
                    void* stream);

// Greedy decoding: out[r] = argmax over the first `limit` logits of row r (lowest index on ties, as
// cpu::argmax), or -1 when those logits hold NaN or Inf.
void argmax_rows(const float* logits, int64_t rows, int64_t vocab, int64_t limit, int32_t* out, void* stream);

// Sampling (the sampler's truncate_candidates): per row, every id < limit whose logit is >= the k-th
// largest of those (counting repeats; -0 equals +0), in any order, at ids / values [row * cap, ..);
// counts[row] = how many (only the first cap are written when there are more), or -1 when the row's first
// `limit` logits hold NaN or Inf. A radix select of the k-th largest (four passes over 8 bits of an
// order-preserving key, each over many blocks per row), then one pass collecting. inv_temperature > 0:
// masses[2 row] and [2 row + 1] get the sums of exp(logit * inv_temperature - max * inv_temperature) over
// those ids and over the other ids < limit (max: the row's largest logit), in double, in an order fixed
// by the row's length alone. scratch: device memory of topk_scratch_bytes(rows).
int64_t topk_scratch_bytes(int64_t rows);
void topk_candidates(const float* logits, int64_t rows, int64_t vocab, int64_t limit, int64_t k, int64_t cap,
                     double inv_temperature, int32_t* ids, float* values, int32_t* counts, double* masses,
                     void* scratch, void* stream);

// Where top-p's prefix ends when it reaches below a row's candidates (CandidateRequest without top-k):
// after topk_candidates on the same logits and scratch (its k-th largest key and row maximum), per row the
// boundary: the lowest logit of the smallest prefix, ranked by logit, whose weights exp(logit / T - max / T)
// reach top_p of the row's (a radix select by mass in fixed point), and in double, in an order fixed by the
// row's length, the weights of the ids < limit above it and below the candidates, and of those at it, with
// their count. The host checks these against top-p's rule with its own sums (the select's rounding can
// pick a neighbouring logit; the host then takes the row whole).
struct TopPBand {
  double above_mass = 0.0, boundary_mass = 0.0;
  int32_t boundary_count = 0;
  float boundary = 0.0f;
};
void topp_band(const float* logits, int64_t rows, int64_t vocab, int64_t limit, double inv_temperature,
               double top_p, TopPBand* out, void* scratch, void* stream);

// A draw among the ids of a row below its top (the ids < limit whose logit is < `below` and >= at_least:
// -inf for all of them, top-p's boundary for those it keeps), each weighing exp(logit * inv_temperature -
// max_scaled) (as topk_candidates' rest mass): *out = the first such id, in id order, at which the running
// sum of the weights exceeds `target` (the last such id when none does, by rounding; -1 when there is
// none). The inverse CDF of the ids below the top, in id order, at a point the caller picks: a draw that
// lands below a row's top ids (decode/sampler.h) without copying the row. The sums run in double in an
// order fixed by `limit` alone. scratch: device memory of draw_below_scratch_bytes().
int64_t draw_below_scratch_bytes();
void draw_below(const float* row, int64_t limit, float below, float at_least, double inv_temperature,
                double max_scaled, double target, void* scratch, int32_t* out, void* stream);

// ---- Mixture-of-experts layers (model/moe.h has the math; moe.cu the kernels). A pass of T rows, each
// routed to k of E experts, is planned as entries (row t, slot s) = t * k + s, grouped by expert into tasks
// of at most kMoeTaskRows entries: each task reads its expert's weights once for all its entries, and every
// entry's arithmetic is the same whichever entries share its task (batch-invariant, as above).

// All experts' matrices of one kind (gate, up or down projection), each a Matrix of the same type, shape and
// quantization whose pointers are in `table` (device memory, one ExpertPointers per expert).
struct ExpertPointers {
  const void* data = nullptr;
  const void* scales = nullptr;  // affine only
  const void* biases = nullptr;
};
struct ExpertMatrices {
  Dtype type = Dtype::kBF16;
  int64_t rows = 0, cols = 0;
  int bits = 0;
  int64_t group_size = 0;
  Dtype scale_type = Dtype::kBF16;  // kBF16 or kF32
  const ExpertPointers* table = nullptr;
};
inline constexpr int64_t kMoeTaskRows =
    16;  // more than a verify window's rows: a window reads an expert once
inline constexpr int64_t kMoeMaxExperts = 1024;
inline constexpr int64_t kMoeMaxTopK = 32;

// Whether the MoE kernels take experts of this kind and this many experts routed per row; "" when they do.
const char* moe_unsupported(const ExpertMatrices& m, int64_t experts, int64_t k);

// The plan of a pass: bytes of device memory it needs, and the most tasks it can hold (the grids of the
// expert products are sized by it, so a captured pass replays for any routing).
int64_t moe_plan_bytes(int64_t t_count, int64_t k, int64_t experts);
int64_t moe_max_tasks(int64_t t_count, int64_t k, int64_t experts);
// Routing of T rows of router logits [T, E] (float32): per row p = softmax(logits) in float32, the k
// largest p in torch.topk's order (descending; where the k-th and (k+1)-th largest tie, the choice CPU
// torch.topk makes: util/libstdcxx_select.h), then w = p / sum of the chosen p (summed in that order).
// chosen, weights: [T, k], each row's experts stored in ascending index order (moe_combine's order). Then the
// plan: the entries grouped by expert into tasks. traffic (4 x uint64, device memory, or null): += 1 block,
// += T rows, += the distinct experts chosen, and the most distinct experts of one call (model/state.h,
// ExpertTraffic).
void moe_route(const float* logits, int64_t t_count, int64_t experts, int64_t k, int32_t* chosen,
               float* weights, void* plan, unsigned long long* traffic, void* stream);
// act[t * k + s, :I] = silu(x[t] gate_e^T) * (x[t] up_e^T) for every entry, e = chosen[t, s]; x: [T, H].
void moe_expert_swiglu(const ExpertMatrices& gate, const ExpertMatrices& up, const void* plan,
                       int64_t t_count, int64_t k, int64_t experts, const float* x, float* act, void* stream);
// y[entry, :H] = act[entry] down_e^T for every entry.
void moe_expert_down(const ExpertMatrices& down, const void* plan, int64_t t_count, int64_t k,
                     int64_t experts, const float* act, float* y, void* stream);
// x[t] += (sum over s < k, i.e. t's chosen experts in ascending index, of weights[t, s] * y[t * k + s])
//         + sigmoid(shared_gate[t]) * shared[t]    (x, shared: [T, H]; shared_gate: [T])
void moe_combine(float* x, const float* y, const int32_t* chosen, const float* weights, const float* shared,
                 const float* shared_gate, int64_t t_count, int64_t k, int64_t hidden, void* stream);

}  // namespace mtpx::cuda
