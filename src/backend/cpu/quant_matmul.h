// Group-wise affine quantized weights (WeightType::kAffine, MLX's layout; see WeightMatrix in matmul.h):
// the quantizer, and the kernels behind matmul() / matmul_reference() / weight_row_to_f32().
//
// The product for one activation row x and output o, with G = cols / group_size groups, is computed as
//   y[o] = sum_g ( bias[o,g] * sum(x_g) + scale[o,g] * dot(x_g, q[o]_g) )
// in vector lanes: per chunk of 32 groups, first acc += bias[o, g..g+L-1] * sum(x_{g..g+L-1}) (L lanes,
// one FMA per L groups), then for each group acc += scale_g * group_acc, where group_acc = dot(x_g, q_g)
// by lane-blocked FMAs in a fixed order, reset at each group; y is one fixed horizontal sum of acc.
// sum(x_g) is computed once per call and row in a fixed order. Every (row, output) therefore runs the same
// operations whatever the number of rows and the tile shape, and threads split outputs only: the batch
// invariance of matmul.h holds for M < kGemmMinRows. From kGemmMinRows rows, blocks of weight rows are
// dequantized to float32 for sgemm.
#pragma once

#include <cstdint>

#include "backend/cpu/matmul.h"

namespace mtpx::cpu {

// Quantizes w [rows, cols] exactly as MLX's mx.quantize(w, group_size, bits) in mode "affine" does for
// float32 input (same codes, scales and biases, bit for bit). For each group of group_size consecutive
// values of a row, with n = 2^bits - 1 and every operation in float32:
//   step  = max((max - min) / n, 1e-7)
//   edge  = the one of {min, max} with the larger magnitude (max on a tie); step is negated when edge is max
//   q0    = round(edge / step)                       (round half to even)
//   scale = q0 != 0 ? edge / q0 : step,  bias = q0 != 0 ? edge : 0
//   q     = clamp(round((w - bias) / scale), 0, n)
// Choosing scale = edge / q0 makes the larger-magnitude end exact (code 0 decodes to bias = edge) and, when
// the range contains zero, puts zero on the grid (w = 0 gets code -q0 and decodes to 0 up to rounding).
// A group whose values are all equal gets bias = that value, scale = -1e-7 (or 1e-7) and codes 0.
// Because scale is rounded to a whole number of steps from the edge, the far end of the range can fall
// up to one step outside [bias, bias + n * scale] and is clamped: its error is then at most |scale|,
// every other value's at most |scale| / 2 (plus float rounding).
// packed: [rows, cols * bits / 32] uint32 (little-endian bit stream per row), scales and biases:
// [rows, cols / group_size]. Requires bits in {2, 3, 4, 5, 6, 8}, group_size in {32, 64, 128},
// cols a multiple of group_size; throws Error(kInvalidInput) otherwise.
void quantize_affine(const float* w, int64_t rows, int64_t cols, int bits, int64_t group_size,
                     uint32_t* packed, float* scales, float* biases);

// The same layout with each group's scale and bias chosen to make the group's squared error small, for
// parameters stored in bf16 (as MLX stores them for a bf16 model): starting from MLX's choice above, 21
// code assignments (those of ranges stretched from n - 1 to n + 1 steps, as llama.cpp's make_qkx2_quants
// tries) each get the least-squares scale and bias for their codes, rounded to bf16; the codes are then
// recomputed for the rounded scale and bias, and the group keeps whichever candidate has the smallest
// squared error (MLX's own on a tie). Returned scales and biases are exactly representable in bf16. Same
// requirements and errors as quantize_affine.
// column_weights [cols] (optional, >= 0): the error of column k counts column_weights[k] times, in the
// fits and in the comparison (calibration: the mean square of each input, model/input_statistics.h).
void quantize_affine_least_squares(const float* w, int64_t rows, int64_t cols, int bits, int64_t group_size,
                                   uint32_t* packed, float* scales, float* biases,
                                   const float* column_weights = nullptr);

// Code k (0 <= code < 2^bits) of row `row` of a kAffine matrix.
uint32_t affine_code(const WeightMatrix& w, int64_t row, int64_t k);

// Throws Error(kInvalidInput) unless w is a kAffine matrix the kernels handle: bits in {2, 3, 4, 5, 6, 8},
// group_size in {32, 64, 128}, cols a multiple of group_size, scale_type f32/f16/bf16, data, scales and
// biases set.
void check_affine(const WeightMatrix& w);

// The kernel families. matmul() uses the one simd_path() names; tests run every one this CPU supports
// (each is batch-invariant on its own; they differ from one another in the last bits).
// kAvx512Vnni: for 4-bit matrices whose columns are a multiple of 128, the activations are quantized to
// int8 per run of 32 values (s = max|x| / 127, xq = x * (1 / s) rounded to nearest) and the scale term of
// each group is an integer dot product (vpdpbusd); y then differs from the float kernels by at most sum_k
// |scale_g(k) * q_k| * s_k / 2. Other matrices run kAvx512's float tiles. matmul() uses it where the CPU has
// AVX-512 VNNI, unless the environment sets MTPX_AFFINE_ACTIVATIONS=f32. kAvx2Int8: the same on AVX2
// (vpmaddubsw + vpmaddwd), what matmul() uses on AVX2 CPUs unless MTPX_AFFINE_ACTIVATIONS=f32.
enum class AffineKernel { kAvx512Vnni, kAvx512, kAvx2Int8, kAvx2, kScalar };
bool affine_kernel_supported(AffineKernel kernel);

// The family matmul() uses in this process.
AffineKernel affine_default_kernel();

// matmul() for kAffine with a given kernel family (m >= kGemmMinRows always takes the sgemm path).
void affine_matmul(const WeightMatrix& w, const float* x, int64_t m, float* y, AffineKernel kernel);
// ... with the family matmul() uses.
void affine_matmul(const WeightMatrix& w, const float* x, int64_t m, float* y);
// matmul_reference() for kAffine: double accumulation of double-dequantized weights.
void affine_matmul_reference(const WeightMatrix& w, const float* x, int64_t m, float* y);
// weight_row_to_f32() for kAffine: out[k] = fma(scale, q, bias) in float32 (one rounding, on every path).
void affine_row_to_f32(const WeightMatrix& w, int64_t row, float* out);

}  // namespace mtpx::cpu
